"""The knobs of issue 18, each against its formula: clip-higher, dual-clip, GSPO's sequence ratio, the entropy bonus,
Dr. GRPO, the policy-loss aggregation, the abs estimator, KL value clamping and the old-policy KL in both
directions. Every one is off by default (tests/rlhf/test_ppo.py keeps the default loss's hand-computed values)."""

import pytest
import torch
from pydantic import ValidationError

from rlhf import kl as K
from rlhf.algorithms import AdvantageParams, grpo_advantages
from rlhf.config import KLConfig
from rlhf.ppo import policy_loss

from ..conftest import KL_BASE, small_ppo_config

D = torch.float64


def _loss(ratio, adv, **kw):
    lp = torch.log(torch.tensor([ratio], dtype=D))
    return policy_loss(lp, torch.zeros(1, 1, dtype=D), torch.tensor([[adv]], dtype=D), torch.ones(1, 1, dtype=D),
                       0.2, **kw)[0].item()  # fmt: skip


def test_clip_higher_widens_only_the_upper_side():
    """DAPO eq. 10: clip(r, 1 - eps_low, 1 + eps_high)."""
    assert _loss([1.25], 1.0) == pytest.approx(-1.2)  # symmetric clip at 1.2
    assert _loss([1.25], 1.0, cliprange_high=0.28) == pytest.approx(-1.25)
    assert _loss([1.4], 1.0, cliprange_high=0.28) == pytest.approx(-1.28)
    assert _loss([0.7], -1.0, cliprange_high=0.28) == pytest.approx(0.8)  # lower side unchanged


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """Ye et al. 2020 eq. 5: for A < 0, min(max(-A r, -A clip(r)), -c A)."""
    assert _loss([5.0], -1.0) == pytest.approx(5.0)
    assert _loss([5.0], -1.0, dual_clip=3.0) == pytest.approx(3.0)
    assert _loss([5.0], 1.0, dual_clip=3.0) == pytest.approx(-1.2)  # A > 0 untouched
    assert _loss([2.0], -1.0, dual_clip=3.0) == pytest.approx(2.0)  # below the cap


def test_gspo_sequence_ratio_value_and_gradient():
    """GSPO eq. 7 / GSPO-token eq. 13: s_b = exp(mean_t log ratio) for every token, gradient sg(s_b) A s_t, under
    GSPO's aggregation (seq-mean-token-mean; the only one params validation accepts with the sequence ratio)."""
    lp = torch.tensor([[-0.1, -0.5, -0.3], [-0.2, -0.4, 0.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-0.2, -0.3, -0.3], [-0.1, -0.6, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]], dtype=D)
    loss, _, _ = policy_loss(lp, old, adv, mask, 10.0, ratio_level="sequence", mode="seq-mean-token-mean")
    s = torch.exp(((lp.detach() - old) * mask).sum(1) / mask.sum(1))  # (b,)
    want = -(adv[:, 0] * s).mean()  # GSPO eq. 5: (1/G) sum_i s_i A_i, whatever each response's length
    assert loss.item() == pytest.approx(want.item())
    (grad,) = torch.autograd.grad(loss, lp)  # eq. 7: grad s_i = s_i (1/|y_i|) sum_t grad log pi_t
    torch.testing.assert_close(grad, -adv * s[:, None] * mask / (mask.sum(1, keepdim=True) * len(s)))


def test_policy_loss_aggregations():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=D)
    assert K.aggregate(x, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))  # Dr. GRPO
    assert K.aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)  # DeepSeekMath eq. 3
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert (K.aggregation_weights(mask, mode) * x).sum().item() == pytest.approx(K.aggregate(x, mask, mode).item())


def test_dr_grpo_drops_the_std_and_sets_the_aggregation():
    r = torch.tensor([[1.0], [3.0], [0.0], [0.0]], dtype=D)
    mask = torch.ones(4, 1, dtype=D)
    a, _ = grpo_advantages(r, None, mask, AdvantageParams(1.0, 1.0, 2, True, group_std=False))
    torch.testing.assert_close(a, torch.tensor([[-1.0], [1.0], [0.0], [0.0]], dtype=D))
    std, _ = grpo_advantages(r, None, mask, AdvantageParams(1.0, 1.0, 2, True))
    assert std[0, 0].item() == pytest.approx(-1.0 / (2**0.5 + 1e-6))
    cfg = small_ppo_config(algorithm="grpo", group_size=2, dr_grpo=True)
    assert cfg.pg_mode == "seq-mean-token-sum-norm" and small_ppo_config().pg_mode == "token-mean"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dr_grpo=True), "dr_grpo changes GRPO's advantages: algorithm 'grpo'"),
        (dict(algorithm="grpo", group_size=2, dr_grpo=True, pg_aggregation="token-mean"), "pg_aggregation null"),
        (dict(ratio_level="seq"), "'token' or 'sequence'"),
        (dict(ratio_level="sequence"), "ratio_level 'sequence' .GSPO. is GSPO's objective only with pg_aggregation"),
        (dict(dual_clip=1.0), "greater than 1"),
        (dict(pg_aggregation="sum"), "'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'"),
    ],
)
def test_policy_options_refused_with_one_message(overrides, message):
    with pytest.raises(ValidationError, match=message) as e:
        small_ppo_config(**overrides)
    assert e.value.error_count() == 1


def test_abs_estimator_clamp_and_forward_old_policy_kl():
    lp, tgt = torch.tensor([[0.3, -1.2]], dtype=D), torch.tensor([[-0.4, 0.5]], dtype=D)
    torch.testing.assert_close(K.kl_per_token("abs", lp, tgt), (lp - tgt).abs())
    kc = KLConfig(**{**KL_BASE, "placement": "loss", "estimator": "k1", "kl_clamp": 1.0})
    torch.testing.assert_close(K.estimate(kc, lp, tgt), torch.tensor([[0.7, -1.0]], dtype=D))
    g = torch.Generator().manual_seed(0)
    logits, old_logits = torch.randn(1, 2, 4, generator=g, dtype=D), torch.randn(1, 2, 4, generator=g, dtype=D)
    fwd = KLConfig(**{**KL_BASE, "placement": "loss", "estimator": "full", "target": "old_policy_forward"})
    rev = KLConfig(**{**KL_BASE, "placement": "loss", "estimator": "full", "target": "old_policy"})
    po, pn = torch.softmax(old_logits, -1), torch.softmax(logits, -1)
    torch.testing.assert_close(K.estimate(fwd, None, None, logits, old_logits), (po * (po / pn).log()).sum(-1))
    torch.testing.assert_close(K.estimate(rev, None, None, logits, old_logits), (pn * (pn / po).log()).sum(-1))


def test_entropy_bonus_runs_and_changes_the_run(run_ppo):
    plain = run_ppo(iterations=1)
    bonus = run_ppo(iterations=1, entropy_coef=0.5)
    assert "entropy" in bonus["history"][0] and "entropy" not in plain["history"][0]
    assert bonus["history"][0]["entropy"] > 0
    assert plain["evals"][-1] != bonus["evals"][-1]


@pytest.mark.parametrize(
    "overrides",
    [dict(cliprange_high=0.28, dual_clip=3.0), dict(ratio_level="sequence", pg_aggregation="seq-mean-token-mean"),
     dict(algorithm="grpo", group_size=2, dr_grpo=True), dict(pg_aggregation="seq-mean-token-mean")],
)  # fmt: skip
def test_options_run_end_to_end(run_ppo, overrides):
    out = run_ppo(iterations=1, **overrides)
    assert out["history"][0]["pg_loss"] == out["history"][0]["pg_loss"]  # finite, no NaN
