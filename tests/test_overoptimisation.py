"""The experiment is meaningful: on the default settings, PPO without KL over-optimises the proxy, and not by
going silent: gold rises, then falls through the proxy's blind spot while the proxy holds its plateau, and the mean
response length never falls more than LENGTH_BOUND tokens below the SFT policy's (issue 7).

Slow (a few minutes on one thread): run with `make test-all`.
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
RISE = 0.3  # gold units: the early gain of every seed (the SFT policy scores 0.24 on the held-out prompts)
CLEAR_DROP = 0.1  # gold units; the held-out gold mean of one evaluation has an SD of about 0.01-0.02
# proxy units: about 3 SD of the difference of two evaluations on the proxy's plateau (one evaluation's SD there is
# 0.010-0.015 on seeds 0-2). The proxy saturates near 1.7 by iteration ~25; gold then falls by 0.4-0.8.
PROXY_NOISE = 0.05
LENGTH_BOUND = 0.5  # tokens: no evaluation's mean length may be further below the SFT policy's (iteration 0)
EMPTY_BOUND = 0.05  # share of empty responses (EOS first) any evaluation may add to the SFT policy's


@pytest.fixture(scope="module")
def runs():
    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    task, grammar, sft_model, reward_model, _ = build_upstream(params, "grammar", 0, torch.device("cpu"))

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


def peak(evals: list[dict]) -> int:
    return max(range(len(evals)), key=lambda i: evals[i]["gold"])


@pytest.mark.parametrize("seed", SEEDS)
def test_without_kl_gold_peaks_then_falls_while_the_proxy_holds(runs, seed):
    evals = runs[seed]["none"]
    top = evals[peak(evals)]
    assert top["gold"] > evals[0]["gold"] + RISE  # optimisation first helps
    assert evals[-1]["gold"] < top["gold"] - CLEAR_DROP  # then hurts
    assert evals[-1]["proxy"] > top["proxy"] - PROXY_NOISE  # while the proxy holds (Gao et al. 2022)
    assert evals[-1]["proxy"] > evals[0]["proxy"] + 1.0  # (by the end far above the SFT policy's)
    assert evals[-1]["illegal"] > 3 * evals[0]["illegal"]  # through the proxy's blind spot


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("arm", ["none", "strong"])
def test_gold_is_not_bought_by_going_silent(runs, seed, arm):
    """Length and empty responses stay at or above the SFT policy's along the whole run, with and without KL."""
    evals = runs[seed][arm]
    sft = evals[0]
    assert min(e["length"] for e in evals) > sft["length"] - LENGTH_BOUND
    assert max(e["empty"] for e in evals) < sft["empty"] + EMPTY_BOUND


@pytest.mark.parametrize("seed", SEEDS)
def test_strong_reference_kl_keeps_kl_small_and_holds_gold(runs, seed):
    """No sustained fall with KL in the reward at 0.3: the last third of the run stays near its best. One evaluation
    moves by about +-0.04 from the next, so like is compared with like: the tail's mean against the best mean of any
    window of as many consecutive evaluations (the best single evaluation is biased up by the noise of 31 draws)."""
    strong, none = runs[seed]["strong"], runs[seed]["none"]
    gold = [e["gold"] for e in strong]
    tail = [e["gold"] for e in strong if e["iteration"] >= 2 * strong[-1]["iteration"] / 3]
    k = len(tail)
    best_window = max(sum(gold[i : i + k]) / k for i in range(len(gold) - k + 1))
    assert strong[-1]["kl"] < 0.25 * none[-1]["kl"]
    assert sum(tail) / k > best_window - CLEAR_DROP
    assert strong[-1]["gold"] > strong[0]["gold"] + RISE
