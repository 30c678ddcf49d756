"""The library's half of the task registry (``LIBRARY``): each task's class, how an instance is built, and the
plain-data form an instance is stored in (``dataclasses.asdict``). The other half, ``ablations.tasks.TASKS``, gives
the same names (torch-free: the params check imports it) their params.yaml sections, metrics and report order;
tests/ablations/test_tasks.py checks that the two name the same tasks in the same order. The task protocol is
``rlhf.task.Task``.

grammar     RLHF: a bigram language with an exact gold reward that a learned proxy only approximates
            (rlhf/grammar.py)
arithmetic  RLVR: fixed-width addition scored by an exact verifier, subtraction held out (rlhf/arithmetic.py)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlhf.arithmetic import Arithmetic, build_arithmetic
from rlhf.grammar import Grammar, build_grammar
from rlhf.task import Task


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """A task: its class (an ``rlhf.task.Task``; ``cls.reward`` is "learned" for a task scored by a reward model,
    an ``rlhf.task.LearnedRewardTask``, "verifier" otherwise) and ``build(seed, **values)``, the instance ``seed``
    from the values of params.yaml's ``<task>.task`` section: {"task": the instance, "demo_prompts",
    "demo_responses", "train_prompts", "eval_prompts"} and, for a task with an out-of-domain set, "ood_prompts"."""

    cls: type
    build: Callable[..., dict]


LIBRARY: dict[str, TaskKind] = {
    "grammar": TaskKind(Grammar, build_grammar),
    "arithmetic": TaskKind(Arithmetic, build_arithmetic),
}


def build_instance(name: str, seed: int, values: dict) -> dict:
    """Instance ``seed`` of task ``name`` as tensors and numbers, the task itself as ``task_state``."""
    data = kind(name).build(seed, **values)
    return {**data, "task": task_state(name, data["task"])}


def task_state(name: str, task: Task) -> dict:
    """{"name", "fields"}: the task as tensors and numbers (``torch.load(weights_only=True)`` reads it back)."""
    return {"name": name, "fields": dataclasses.asdict(task)}


def task_from_state(state: dict) -> Task:
    """The task instance ``task_state`` wrote."""
    return kind(state.get("name")).cls(**state["fields"])


def kind(name) -> TaskKind:
    """The registered task ``name``; ValueError naming the registered ones otherwise."""
    if name not in LIBRARY:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(LIBRARY)}")
    return LIBRARY[name]
