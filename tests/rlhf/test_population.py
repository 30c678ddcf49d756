"""A cell's result does not depend on its population (issue 21): alone (B = 1) and as one of 8 cells with other
coefficients and seeds, bit for bit; and how close a population of 1 is to ``rlhf.ppo.train_ppo``."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.population import CellInputs, train_population
from rlhf.ppo import train_ppo

from ..conftest import small_ppo_config

ARMS = {  # algorithm and KL structure: one population each
    "ppo-reward-k1": dict(kl={"placement": "reward", "estimator": "k1"}),
    "grpo-loss-k3": dict(algorithm="grpo", group_size=2, kl={"placement": "loss", "estimator": "k3"}),
    "rloo-both-full-adaptive": dict(
        algorithm="rloo",
        group_size=2,
        kl={"placement": "both", "estimator": "full", "adaptive_target": 0.5, "horizon": 100},
    ),
    "reinforce_pp-loss-k2-rtg": dict(
        algorithm="reinforce_pp", kl={"placement": "loss", "estimator": "k2", "return_to_go": True}
    ),
    "ppo-none-entropy": dict(kl={"placement": "none", "estimator": None, "coef": 0.0}, entropy_coef=0.01),
}


def cell(ppo_setup, arm: str, coef: float, seed: int) -> CellInputs:
    over = copy.deepcopy(ARMS[arm])
    kl = over.pop("kl")
    kl = kl if kl["placement"] == "none" else {**kl, "coef": coef}
    cfg = small_ppo_config(kl=kl, seed=seed, **over)
    s = ppo_setup
    return CellInputs(s.ref, s.reward_model, s.grammar, s.train_prompts, {"": s.eval_prompts}, cfg, s.policy)


@pytest.mark.parametrize("arm", list(ARMS))
def test_a_cell_alone_and_in_a_population_of_8_are_bit_identical(ppo_setup, arm):
    cells = [cell(ppo_setup, arm, coef, seed) for coef, seed in zip([0.01, 0.03, 0.1, 0.3] * 2, range(8))]
    alone = train_population([cells[5]])[0]
    inside = train_population(cells)[5]
    assert alone["history"] == inside["history"]
    assert alone["evals"] == inside["evals"]
    assert alone["summary"] == inside["summary"]
    assert all(torch.equal(alone["policy"][k], inside["policy"][k]) for k in alone["policy"])


def test_a_population_of_one_matches_train_ppo_to_float_rounding(ppo_setup):
    """Not bit for bit: vmapped kernels (batched matmuls, per-cell reductions, the batched LayerNorm backward)
    round the last bits differently, so population results are a re-baseline of ``train_ppo``'s; the tiny
    2-iteration run stays within 1e-4 (parameters) and 1e-4 relative (every recorded number)."""
    c = cell(ppo_setup, "ppo-reward-k1", 0.1, 3)
    policy = copy.deepcopy(c.policy)
    ref = train_ppo(policy, c.ref, c.reward_model, c.task, c.train_prompts, c.eval_sets, c.cfg)
    pop = train_population([c])[0]
    for got, want in [*zip(pop["evals"], ref["evals"]), *zip(pop["history"], ref["history"])]:
        assert list(got) == list(want)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(pop["policy"][k], v, atol=1e-4, rtol=0)


def test_what_a_population_cannot_train_is_refused_in_one_line(ppo_setup):
    c = cell(ppo_setup, "ppo-reward-k1", 0.1, 0)
    moving = c._replace(cfg=small_ppo_config(kl={"ref_sync_every": 2, "ref_sync_alpha": 1.0}))
    with pytest.raises(ValueError, match="moving reference"):
        train_population([moving])
    other = cell(ppo_setup, "grpo-loss-k3", 0.1, 1)
    with pytest.raises(ValueError, match="share their config"):
        train_population([c, other])
    hf = c._replace(ref=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="tiny backend only"):
        train_population([hf])
