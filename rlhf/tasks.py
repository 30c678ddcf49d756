"""The built-in tasks by name, and the plain-data form a task instance is stored in (``dataclasses.asdict``).

grammar     RLHF: a bigram language with an exact gold reward that a learned proxy only approximates
            (rlhf/task.py)
arithmetic  RLVR: fixed-width addition scored by an exact verifier, subtraction held out (rlhf/arithmetic.py)
"""

from __future__ import annotations

import dataclasses

from rlhf.arithmetic import Arithmetic
from rlhf.task import Grammar, Task

TASKS: dict[str, type] = {"grammar": Grammar, "arithmetic": Arithmetic}


def task_state(name: str, task: Task) -> dict:
    """{"name", "fields"}: the task as tensors and numbers (``torch.load(weights_only=True)`` reads it back)."""
    return {"name": name, "fields": dataclasses.asdict(task)}


def task_from_state(state: dict) -> Task:
    """The task instance ``task_state`` wrote."""
    if state.get("name") not in TASKS:
        raise ValueError(f"unknown task {state.get('name')!r}; allowed: {', '.join(TASKS)}")
    return TASKS[state["name"]](**state["fields"])
