"""Advantage functions against hand-computed tensors; the config rules of algorithms, groups and KL variants; the
training loop under every algorithm."""

import copy

import pytest
import torch
from pydantic import ValidationError

from rlhf import ppo
from rlhf.algorithms import ALGORITHMS, AdvantageParams, gae, masked_whiten
from rlhf.config import ALGORITHMS as ALGORITHM_NAMES
from rlhf.config import KLConfig
from rlhf.ppo import Trajectory, draw_prompts, rewards_and_advantages

from ..conftest import KL_BASE, small_ppo_config

GROUPED = dict(group_size=3, batch_size=6)

# --- advantage functions ---------------------------------------------------------------------------------------------


def _outcome_rewards(scores, lengths, t=4):
    """Rewards with each score at the last token of a response of the given length; mask (b, t)."""
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(len(scores), t)
    rewards[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores)
    return rewards, mask


def _params(group_size, normalize=True, gamma=1.0, lam=1.0):
    return AdvantageParams(gamma, lam, group_size, normalize)


def test_registry_matches_config_and_only_ppo_has_a_critic():
    assert set(ALGORITHMS) == set(ALGORITHM_NAMES)
    assert {name for name, a in ALGORITHMS.items() if a.critic} == {"ppo"}


def test_grpo_hand_computed():
    # two groups of 3: R = (1, 3, 5) -> mean 3, std 2;  R = (0, 0, 3) -> mean 1, std sqrt(3)
    rewards, mask = _outcome_rewards([1.0, 3.0, 5.0, 0.0, 0.0, 3.0], [4, 2, 3, 1, 4, 2])
    adv, returns = ALGORITHMS["grpo"].advantages(rewards, None, mask, _params(3))
    s3 = 3**0.5 + 1e-6
    expected = torch.tensor([-2 / (2 + 1e-6), 0.0, 2 / (2 + 1e-6), -1 / s3, -1 / s3, 2 / s3])
    torch.testing.assert_close(adv, expected[:, None] * mask)
    assert returns is None
    centred, _ = ALGORITHMS["grpo"].advantages(rewards, None, mask, _params(3, normalize=False))
    torch.testing.assert_close(centred, torch.tensor([-2.0, 0.0, 2.0, -1.0, -1.0, 2.0])[:, None] * mask)


def test_rloo_hand_computed():
    rewards, mask = _outcome_rewards([1.0, 3.0, 5.0, 0.0, 0.0, 3.0], [4, 2, 3, 1, 4, 2])
    adv, returns = ALGORITHMS["rloo"].advantages(rewards, None, mask, _params(3))
    # A_i = R_i - mean of the other two
    expected = torch.tensor([1 - 4.0, 3 - 3.0, 5 - 2.0, 0 - 1.5, 0 - 1.5, 3 - 0.0])
    torch.testing.assert_close(adv, expected[:, None] * mask)
    assert returns is None


def test_rloo_is_grpo_centred_times_g_over_g_minus_1():
    g = torch.Generator().manual_seed(0)
    rewards, mask = torch.randn(8, 5, generator=g), torch.ones(8, 5)
    rloo, _ = ALGORITHMS["rloo"].advantages(rewards, None, mask, _params(4))
    centred, _ = ALGORITHMS["grpo"].advantages(rewards, None, mask, _params(4, normalize=False))
    torch.testing.assert_close(rloo, centred * 4 / 3)


@pytest.mark.parametrize(
    "gamma, returns", [(1.0, [[1.5, 1.0, 1.0], [1.0, 2.0, 0.0]]), (0.5, [[0.75, 0.5, 1.0], [0.0, 2.0, 0.0]])]
)
def test_reinforce_pp_hand_computed(gamma, returns):
    rewards = torch.tensor([[0.5, 0.0, 1.0], [-1.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    raw, none = ALGORITHMS["reinforce_pp"].advantages(rewards, None, mask, _params(1, normalize=False, gamma=gamma))
    torch.testing.assert_close(raw, torch.tensor(returns))
    assert none is None
    adv, _ = ALGORITHMS["reinforce_pp"].advantages(rewards, None, mask, _params(1, gamma=gamma))
    if gamma == 1.0:  # returns 1.5, 1, 1, 1, 2 on the mask: mean 1.3, std 0.4
        expected = torch.tensor([[0.5, -0.75, -0.75], [-0.75, 1.75, 0.0]])
        torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_ppo_advantages_are_whitened_gae():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4])[:, None]).float()
    adv, ret = ALGORITHMS["ppo"].advantages(rewards * mask, values, mask, _params(1, gamma=0.9, lam=0.8))
    ref_adv, ref_ret = gae(rewards * mask, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, masked_whiten(ref_adv, mask) * mask)
    torch.testing.assert_close(ret, ref_ret)


def _trajectory(scores, mask):
    b, t = mask.shape
    zeros, logits = torch.zeros(b, t), torch.zeros(b, t, 3)
    return Trajectory(None, None, mask, logits, zeros, logits, zeros, torch.zeros(b), None, scores)


def test_rloo_reward_kl_enters_before_the_baseline():
    """TRL RLOO: R_i = score_i - beta * sum_t k_t, then the leave-one-out baseline."""
    cfg = small_ppo_config(algorithm="rloo", **GROUPED, minibatch_size=3)
    mask = torch.tensor(
        [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0] * 3]
    )
    kl = torch.tensor([[0.5, 1.0, 9.0], [0.0, 2.0, 1.0], [3.0, 9.0, 9.0], [1.0, 1.0, 1.0], [0.0, 0.0, 9.0], [2.0] * 3])
    scores = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 0.0])
    batch = rewards_and_advantages(_trajectory(scores, mask), kl * mask, 0.1, cfg)
    r = scores - 0.1 * (kl * mask).sum(1)  # 0.85, -0.3, 1.7 | -1.3, 0.5, -0.6
    expected = torch.stack([r[i] - (r[(i // 3) * 3 : (i // 3) * 3 + 3].sum() - r[i]) / 2 for i in range(6)])
    torch.testing.assert_close(batch.advantages, expected[:, None] * mask)
    assert batch.returns is None


# --- configuration rules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(group_size=3), "group_size must divide batch_size 8: one of 1, 2, 4, 8"),
        (dict(algorithm="grpo", group_size=1), "group_size >= 2"),
        (dict(algorithm="rloo", group_size=1), "group_size >= 2"),
        (dict(algorithm="a2c"), "'ppo', 'grpo', 'rloo' or 'reinforce_pp'"),
        (dict(diagnostics=dict(at=[3], n_true=64, n_minibatches=4, seed=0)), "diagnostics.at must list"),
    ],
)
def test_ppo_config_refuses_with_one_message(overrides, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace("+", r"\+")) as e:
        small_ppo_config(**overrides)
    assert e.value.error_count() == 1


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(placement="reward", is_weight=True), "is_weight weights a loss-side KL: placement 'loss'"),
        (dict(placement="both", is_weight=True), "is_weight weights a loss-side KL: placement 'loss'"),
        (dict(placement="loss", estimator="abs", is_weight=True), "is_weight needs a sampled-token estimator"),
        (dict(placement="both", estimator="k3", return_to_go=True), "return_to_go is a loss-side term"),
        (dict(placement="loss", estimator="k3", return_to_go=True), "estimator one of 'k2', 'k1\\+', 'k3\\+', 'full'"),
        (dict(placement="loss", estimator="k1", return_to_go=True), "is_weight true \\(got 'k1'"),
        (dict(placement="reward", estimator="full"), "estimator 'full' with placement 'reward'"),
        (dict(placement="both", estimator="k3+"), "counted twice"),
        (dict(placement="loss", estimator="k3", target="old_policy_forward"), "placement 'loss', estimator 'full'"),
        (dict(placement="reward", kl_clamp=0.0), "greater than 0"),
        (dict(placement="loss", estimator="full", is_weight=True), "is_weight needs a sampled-token estimator"),
        (dict(placement="reward", return_to_go=True), "return_to_go is a loss-side term"),
        (dict(placement="reward", estimator="k3+"), "placement one of 'loss', 'both' \\(got 'reward'\\)"),
        (dict(placement="both", both_split=0.5), "both_split is refused"),
        (dict(placement="both", both_split=1.0), "less than 1"),
        (dict(placement="none", estimator=None, aggregation="token-mean"), "aggregation needs a KL"),
        (dict(placement="none", estimator=None, is_weight=True), "is_weight needs a KL"),
        (dict(aggregation="sum"), "'token-mean', 'seq-mean-token-sum' or 'seq-mean-token-mean'"),
        (dict(ref_sync_every=5), "ref_sync_every and ref_sync_alpha go together"),
        (dict(ref_sync_every=5, ref_sync_alpha=0.0), "greater than 0"),
        (dict(target="old_policy", ref_sync_every=5, ref_sync_alpha=1.0), "target 'reference' \\(got 'old_policy'\\)"),
    ],
)
def test_klconfig_refuses_invalid_variants_with_one_message(kw, message):
    with pytest.raises(ValidationError, match=message) as e:
        KLConfig(**{**KL_BASE, **kw})
    assert e.value.error_count() == 1


@pytest.mark.parametrize(
    "kw",
    [
        dict(placement="loss", estimator="k3", is_weight=True, return_to_go=True, aggregation="seq-mean-token-sum"),
        dict(placement="both", estimator="k3"),
        dict(placement="both", estimator="full", aggregation="seq-mean-token-sum"),
        dict(placement="loss", estimator="k1+", is_weight=True),
        dict(placement="loss", estimator="k1", is_weight=True, return_to_go=True, kl_clamp=10.0),
        dict(placement="loss", estimator="full", target="old_policy_forward"),
        dict(placement="reward", estimator="abs"),
        dict(placement="reward", estimator="k1", aggregation="token-mean", ref_sync_every=10, ref_sync_alpha=0.6),
        dict(placement="loss", estimator="k2", target="old_policy", is_weight=True, return_to_go=True),
        # the controller sees the exact KL to the frozen reference whatever the target, so any arm can be steered
        dict(placement="loss", estimator="full", target="old_policy", adaptive_target=4.0, horizon=640),
    ],
)
def test_klconfig_accepts_valid_variants(kw):
    KLConfig(**{**KL_BASE, **kw})


# --- the loop under every algorithm ----------------------------------------------------------------------------------


def _algo(algorithm):
    return dict(algorithm=algorithm, group_size=1 if algorithm in ("ppo", "reinforce_pp") else 2)


def _without_kl_stats(history):
    return [{k: v for k, v in row.items() if k not in ("kl_reward", "kl_loss")} for row in history]


VARIANTS = [
    dict(placement="reward", estimator="k1"),
    dict(placement="loss", estimator="k3", is_weight=True, return_to_go=True, aggregation="seq-mean-token-sum"),
    dict(placement="both", estimator="k2", aggregation="seq-mean-token-sum"),
    dict(placement="both", estimator="full", aggregation="seq-mean-token-mean", ref_sync_every=1, ref_sync_alpha=0.5),
    dict(placement="loss", estimator="k3+", target="old_policy", kl_clamp=0.05),
    dict(placement="loss", estimator="full", target="old_policy_forward"),
]


@pytest.fixture(scope="module")
def no_kl_runs(run_ppo):
    return {a: run_ppo(**_algo(a), kl=dict(placement="none", estimator=None, coef=0.0)) for a in ALGORITHM_NAMES}


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_zero_coef_is_bit_identical_to_no_kl_for_every_algorithm(run_ppo, no_kl_runs, algorithm, variant):
    out = run_ppo(**_algo(algorithm), kl={**VARIANTS[variant], "coef": 0.0})
    assert _without_kl_stats(out["history"]) == _without_kl_stats(no_kl_runs[algorithm]["history"])
    assert out["evals"] == no_kl_runs[algorithm]["evals"]


def test_algorithms_differ_and_kl_matters(run_ppo, no_kl_runs):
    """Guards the test above: the algorithms are not the same run, and a nonzero coefficient changes each one."""
    evals = [no_kl_runs[a]["evals"][-1]["gold"] for a in ALGORITHM_NAMES]
    assert len(set(evals)) == len(evals)
    for a in ALGORITHM_NAMES:
        out = run_ppo(**_algo(a), kl={**VARIANTS[1], "coef": 0.5})
        assert out["evals"][-1] != no_kl_runs[a]["evals"][-1]


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_pp"])
def test_critic_free_algorithms_build_and_train_no_value_model(run_ppo, monkeypatch, algorithm):
    def forbidden(*args, **kwargs):
        raise AssertionError("a critic-free algorithm used the value model")

    monkeypatch.setattr(ppo, "response_values", forbidden)
    monkeypatch.setattr(ppo, "value_loss", forbidden)
    out = run_ppo(**_algo(algorithm))
    assert all("vf_loss" not in row for row in out["history"])


def test_draw_prompts_repeats_each_prompt_group_size_times_consecutively():
    prompts = torch.arange(40).view(20, 2)
    out = draw_prompts(prompts, 12, 3, torch.Generator().manual_seed(0))
    assert out.shape == (12, 2)
    groups = out.view(4, 3, 2)
    assert (groups == groups[:, :1]).all()
    assert len({tuple(g[0].tolist()) for g in groups}) > 1
    # group_size 1 draws exactly what an ungrouped draw would
    a = draw_prompts(prompts, 8, 1, torch.Generator().manual_seed(5))
    b = prompts[torch.randint(0, 20, (8,), generator=torch.Generator().manual_seed(5))]
    assert torch.equal(a, b)


def test_moving_reference_reset_every_iteration_makes_the_rollout_kl_zero(ppo_setup):
    """Reset to the policy after each iteration: the next rollout's policy IS the reference, so the reward-side k1
    is exactly 0 there; the frozen-reference KL (kl_exact) is not, and the caller's reference is untouched."""
    s = ppo_setup
    policy, ref = copy.deepcopy(s.policy), copy.deepcopy(s.ref)
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
    kl = dict(placement="reward", estimator="k1", coef=0.5, ref_sync_every=1, ref_sync_alpha=1.0)
    cfg = small_ppo_config(iterations=3, kl=kl)
    out = ppo.train_ppo(policy, ref, copy.deepcopy(s.reward_model), s.grammar, s.train_prompts, s.eval_prompts, cfg)
    assert out["history"][0]["kl_reward"] != 0.0
    assert [row["kl_reward"] for row in out["history"][1:]] == [0.0, 0.0]
    assert all(row["kl_exact"] > 0 for row in out["history"])
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in ref_state.items())
