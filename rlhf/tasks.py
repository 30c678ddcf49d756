"""The built-in tasks by name, registered in one place: each task's class, how an instance is built, and the
plain-data form an instance is stored in (``dataclasses.asdict``). ablations/tasks.py registers the same names with
their params.yaml sections.

grammar     RLHF: a bigram language with an exact gold reward that a learned proxy only approximates
            (rlhf/task.py)
arithmetic  RLVR: fixed-width addition scored by an exact verifier, subtraction held out (rlhf/arithmetic.py)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlhf.arithmetic import Arithmetic, build_arithmetic
from rlhf.task import Grammar, Task, build_grammar


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """A task: its class (``rlhf.task.Task``; ``cls.reward`` is "learned" for a task scored by a reward model,
    "verifier" otherwise) and ``build(seed, **values)``, the instance ``seed`` from the values of params.yaml's
    ``<task>.task`` section: {"task": the instance, "demo_prompts", "demo_responses", "train_prompts",
    "eval_prompts"} and, for a task with an out-of-domain set, "ood_prompts"."""

    cls: type
    build: Callable[..., dict]


TASKS: dict[str, TaskKind] = {
    "grammar": TaskKind(Grammar, build_grammar),
    "arithmetic": TaskKind(Arithmetic, build_arithmetic),
}


def build_instance(name: str, seed: int, values: dict) -> dict:
    """Instance ``seed`` of task ``name`` as tensors and numbers, the task itself as ``task_state``."""
    data = TASKS[name].build(seed, **values)
    return {**data, "task": task_state(name, data["task"])}


def task_state(name: str, task: Task) -> dict:
    """{"name", "fields"}: the task as tensors and numbers (``torch.load(weights_only=True)`` reads it back)."""
    return {"name": name, "fields": dataclasses.asdict(task)}


def task_from_state(state: dict) -> Task:
    """The task instance ``task_state`` wrote."""
    if state.get("name") not in TASKS:
        raise ValueError(f"unknown task {state.get('name')!r}; allowed: {', '.join(TASKS)}")
    return TASKS[state["name"]].cls(**state["fields"])
