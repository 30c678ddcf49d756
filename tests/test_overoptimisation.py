"""The experiment is meaningful: on the default settings, PPO without KL over-optimises the proxy.

Slow (about two minutes on one thread): run with `make test-all`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from ablations.config import load_params
from pipelines.upstream import build_upstream
from rlhf.config import no_kl
from rlhf.ppo import train_ppo

pytestmark = pytest.mark.slow
SEEDS = (0, 1, 2)
CLEAR_DROP = 0.08  # gold units; the held-out gold mean has a standard error of about 0.02


@pytest.fixture(scope="module")
def runs():
    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    task, grammar, sft_model, reward_model, _ = build_upstream(params, 0, torch.device("cpu"))

    def run(kl, seed):
        return train_ppo(
            copy.deepcopy(sft_model),
            sft_model,
            reward_model,
            grammar,
            task["train_prompts"],
            task["eval_prompts"],
            params.grammar.ppo_config(kl, seed),
        )["evals"]

    return {
        seed: {"none": run(no_kl(), seed), "strong": run(params.grid.arms["reward_k1"].kl(0.3), seed)} for seed in SEEDS
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_without_kl_gold_peaks_then_falls_while_proxy_keeps_rising(runs, seed):
    evals = runs[seed]["none"]
    peak = max(range(len(evals)), key=lambda i: evals[i]["gold"])
    assert evals[peak]["gold"] > evals[0]["gold"] + 0.2  # optimisation first helps
    assert evals[-1]["gold"] < evals[peak]["gold"] - CLEAR_DROP  # then hurts
    assert evals[-1]["proxy"] > evals[peak]["proxy"] + 0.1  # while the proxy still climbs
    assert evals[-1]["illegal"] > 3 * evals[0]["illegal"]  # through the proxy's blind spot


@pytest.mark.parametrize("seed", SEEDS)
def test_strong_reference_kl_keeps_kl_small_and_gold_near_its_best(runs, seed):
    strong, none = runs[seed]["strong"], runs[seed]["none"]
    assert strong[-1]["kl"] < 0.25 * none[-1]["kl"]
    assert strong[-1]["gold"] > max(e["gold"] for e in strong) - 0.05
    assert strong[-1]["gold"] > strong[0]["gold"] + 0.2
