"""A cell's result does not depend on its population (issue 21): alone (B = 1) and as one of 8 cells with other
coefficients and seeds, bit for bit, on the tiny backend and on both families of the hf backend (Llama, GPT-2; every
arm of ``ARMS``); and how close a population of 1 is to ``rlhf.ppo.train_ppo``."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf import hf
from rlhf.model import ScalarModel
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


def cell(ppo_setup, arm: str, coef: float, seed: int, models=None) -> CellInputs:
    """A cell of ``arm``; ``models``: (ref, policy, reward model) instead of ppo_setup's TinyLMs."""
    over = copy.deepcopy(ARMS[arm])
    kl = over.pop("kl")
    kl = kl if kl["placement"] == "none" else {**kl, "coef": coef}
    cfg = small_ppo_config(kl=kl, seed=seed, **over)
    s = ppo_setup
    ref, policy, rm = models or (s.ref, s.policy, s.reward_model)
    return CellInputs(ref, rm, s.grammar, s.train_prompts, {"": s.eval_prompts}, cfg, policy)


@pytest.fixture(scope="module", params=hf.FAMILIES)
def hf_models(request, grammar):
    """(ref, policy, reward model) of one hf family: random weights (the identity does not need trained ones), the
    policy perturbed so that KL > 0 from the first rollout, the reward model a copy of the reference's backbone."""
    torch.manual_seed(0)
    size = dict(d_model=16, n_layers=1, n_heads=2, intermediate_size=32)
    ref = hf.from_config(request.param, grammar.vocab_size, grammar.prompt_len + grammar.max_new_tokens, **size)
    policy, g = copy.deepcopy(ref), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return ref.eval(), policy.eval(), ScalarModel(copy.deepcopy(ref)).eval()


def alone_and_inside(ppo_setup, arm, models=None) -> dict:
    """Cell 5 trained alone and as one of 8 cells (other coefficients and seeds): asserts they are bit-identical,
    returns the cell's result."""
    cells = [cell(ppo_setup, arm, coef, seed, models) for coef, seed in zip([0.01, 0.03, 0.1, 0.3] * 2, range(8))]
    alone = train_population([cells[5]])[0]
    inside = train_population(cells)[5]
    assert alone["history"] == inside["history"]
    assert alone["evals"] == inside["evals"]
    assert alone["summary"] == inside["summary"]
    assert all(torch.equal(alone["policy"][k], inside["policy"][k]) for k in alone["policy"])
    return alone


@pytest.mark.parametrize("arm", list(ARMS))
def test_a_cell_alone_and_in_a_population_of_8_are_bit_identical(ppo_setup, arm):
    alone_and_inside(ppo_setup, arm)


@pytest.mark.parametrize("arm", list(ARMS))
def test_an_hf_cell_alone_and_in_a_population_of_8_are_bit_identical(ppo_setup, hf_models, arm):
    """The hf backend: teacher-forced passes through ``functional_call`` over stacked transformers weights, and
    generation with its KV cache carried through vmap as tensors (``rlhf.population.policy_hidden``)."""
    alone = alone_and_inside(ppo_setup, arm, hf_models)
    assert alone["evals"][0]["kl"] > 0 and alone["policy"].keys() == hf_models[1].state_dict().keys()


def test_a_population_of_one_matches_train_ppo_to_float_rounding(ppo_setup):
    """Not bit for bit: vmapped kernels (batched matmuls, per-cell reductions, the batched LayerNorm backward)
    round the last bits differently, so population results are a re-baseline of ``train_ppo``'s; the tiny
    2-iteration run stays within 1e-4 (parameters) and 1e-4 relative (every recorded number)."""
    matches_train_ppo(cell(ppo_setup, "ppo-reward-k1", 0.1, 3))


def test_an_hf_population_of_one_matches_train_ppo_to_float_rounding(ppo_setup, hf_models):
    """As on the tiny backend (tokens sampled with a KV cache in both)."""
    matches_train_ppo(cell(ppo_setup, "ppo-reward-k1", 0.1, 3, hf_models))


def matches_train_ppo(c: CellInputs) -> None:
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
    other_model = c._replace(ref=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"TinyLM or rlhf\.hf\.HFLM models only"):
        train_population([other_model])


def test_hf_cells_under_bf16_autocast_or_beside_tiny_cells_are_refused(ppo_setup, hf_models):
    ref, policy, rm = (copy.deepcopy(m) for m in hf_models)
    hf.set_autocast(policy, torch.bfloat16)
    with pytest.raises(ValueError, match=r"bf16 autocast.*Expected query, key, and value to have the same dtype"):
        train_population([cell(ppo_setup, "ppo-reward-k1", 0.1, 0, (ref, policy, rm))])
    with pytest.raises(ValueError, match="model, prompt and evaluation-set shapes"):
        train_population(
            [cell(ppo_setup, "ppo-reward-k1", 0.1, 0, hf_models), cell(ppo_setup, "ppo-reward-k1", 0.1, 1)]
        )


def test_a_given_iteration_0_evaluation_is_used_and_changes_nothing_else(ppo_setup):
    """A cell's ``initial_eval`` (its instance's eval0 in the pipeline) is its first measurement; training and the
    later measurements are those of the same cell that measures iteration 0 itself (the evaluation has its own
    generator). The other cells of the population still measure theirs."""
    cells = [cell(ppo_setup, "ppo-reward-k1", coef, seed) for coef, seed in ((0.03, 0), (0.1, 1), (0.3, 2))]
    measured = train_population(cells)
    given = {**measured[1]["evals"][0], "gold": -7.0}
    got = train_population([cells[0], cells[1]._replace(initial_eval=given), cells[2]])
    assert got[1]["evals"][0] == given and got[1]["evals"][1:] == measured[1]["evals"][1:]
    assert got[1]["history"] == measured[1]["history"] and got[0]["evals"] == measured[0]["evals"]
    assert all(torch.equal(got[1]["policy"][k], v) for k, v in measured[1]["policy"].items())


@pytest.mark.parametrize("arm", ["ppo-reward-k1", "ppo-none-entropy"])
def test_history_rows_have_train_ppos_keys_in_its_order(ppo_setup, arm):
    """One record (``rlhf.ppo.Stats``) for both paths: the same keys in the same order (vf_loss with a critic,
    entropy with an entropy bonus)."""
    c = cell(ppo_setup, arm, 0.1, 0)
    ref = train_ppo(copy.deepcopy(c.policy), c.ref, c.reward_model, c.task, c.train_prompts, c.eval_sets, c.cfg)
    pop = train_population([c])[0]
    assert [list(r) for r in pop["history"]] == [list(r) for r in ref["history"]]
    assert ("entropy" in ref["history"][0]) == (arm == "ppo-none-entropy") and "vf_loss" in ref["history"][0]
