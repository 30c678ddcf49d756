"""data -> sft (-> rm) in one process, without files: for the benchmarks, the figure script and the slow tests."""

from __future__ import annotations

import torch

from ablations.experiment import Experiment
from ablations.tasks import TASKS
from pipelines import data, rm, sft
from pipelines.common import load_task
from rlhf.model import ScalarModel, TinyLM
from rlhf.task import Task


def build_upstream(
    params: Experiment, task_name: str, instance: int, device: torch.device
) -> tuple[dict, Task, TinyLM, ScalarModel | None, dict]:
    """Returns (data, task, SFT model, reward model (None for a verifier task), metrics) of instance ``instance``
    of ``task_name``, as the DVC stages would make them."""
    section = getattr(params, task_name)
    instance_data = data.build(task_name, section.task, instance)
    task = load_task(instance_data)
    sft_model, _, sft_metrics, _ = sft.fit(section, instance, instance_data, device)
    if not TASKS[task_name].learned_reward:
        return instance_data, task, sft_model, None, {"sft": sft_metrics}
    reward_model, rm_metrics, _ = rm.fit(section, instance, task, sft_model, device)
    return instance_data, task, sft_model, reward_model, {"sft": sft_metrics, "rm": rm_metrics}
