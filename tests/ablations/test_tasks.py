"""The two halves of the task registry (rlhf/tasks.py LIBRARY: class and builder; ablations/tasks.py TASKS: params
section and metrics) name the same tasks in the same order, and agree on which one has a learned reward model."""

from __future__ import annotations

from ablations import tasks as schema
from rlhf import tasks as library


def test_both_registries_name_the_same_tasks_in_order():
    assert list(schema.TASKS) == list(library.LIBRARY)


def test_a_task_has_an_rm_section_iff_its_class_scores_with_a_learned_reward():
    for name, spec in schema.TASKS.items():
        assert spec.learned_reward == (library.LIBRARY[name].cls.reward == "learned"), name
