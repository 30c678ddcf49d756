"""data -> sft -> rm in one process, without files: for the benchmark, the figure script and the slow tests."""

from __future__ import annotations

import torch

from ablations.config import Params
from pipelines import data, rm, sft
from pipelines.common import load_grammar
from rlhf.model import ScalarModel, TinyLM
from rlhf.task import Grammar


def build_upstream(
    params: Params, instance: int, device: torch.device
) -> tuple[dict, Grammar, TinyLM, ScalarModel, dict]:
    """Returns (task, grammar, SFT model, reward model, metrics of both) of grammar instance ``instance``, as the
    DVC stages would make them."""
    section = params.grammar
    task = data.build(section.task, instance)
    grammar = load_grammar(task)
    sft_model, _, sft_metrics, _ = sft.fit(section, instance, task, device)
    reward_model, rm_metrics, _ = rm.fit(section, instance, grammar, sft_model, device)
    return task, grammar, sft_model, reward_model, {"sft": sft_metrics, "rm": rm_metrics}
