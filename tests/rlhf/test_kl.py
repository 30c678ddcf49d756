import math

import numpy as np
import pytest
import torch
from scipy.special import rel_entr

from rlhf import kl as K

LOG2 = math.log(2.0)


def _lp(*deltas):
    """(1, n) log-probs with target log-probs 0, so delta equals the given values."""
    return torch.tensor([deltas], dtype=torch.float64), torch.zeros(1, len(deltas), dtype=torch.float64)


@pytest.mark.parametrize(
    "estimator, expected",
    [
        # delta = log 2, -log 2, 0
        ("k1", [0.693147, -0.693147, 0.0]),
        ("k2", [0.240227, 0.240227, 0.0]),  # log(2)^2 / 2
        ("k3", [0.193147, 0.306853, 0.0]),  # 1/2 - 1 + log 2;  2 - 1 - log 2
    ],
)
def test_sampled_estimators_match_hand_computed_values(estimator, expected):
    logprobs, target = _lp(LOG2, -LOG2, 0.0)
    out = K.kl_per_token(estimator, logprobs, target)
    assert out.shape == (1, 3)
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_estimators_use_logprobs_minus_target_not_reverse():
    out = K.kl_per_token("k1", torch.tensor([[-1.0]]), torch.tensor([[-3.0]]))
    assert out.item() == pytest.approx(2.0)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_k2_k3_are_nonnegative_everywhere(estimator):
    delta = (torch.arange(-800, 801, dtype=torch.float64) / 100)[None]  # -8 .. 8, exact 0 at index 800
    out = K.kl_per_token(estimator, delta, torch.zeros_like(delta))
    assert (out >= 0).all()
    assert out[0, 800] == 0.0 and (out[0, :800] > 0).all() and (out[0, 801:] > 0).all()


def test_full_matches_hand_computed_kl():
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.25, 0.5])
    # unnormalised logits: full must normalise them itself
    logits, target_logits = (p.log() + 3.0)[None, None], (q.log() - 1.0)[None, None]
    out = K.kl_per_token("full", None, None, logits, target_logits)
    assert out.shape == (1, 1)
    assert out.item() == pytest.approx(0.25 * LOG2, abs=1e-6)  # 0.5 log 2 + 0 + 0.25 log(1/2)


def test_full_matches_scipy_kl_of_random_categoricals():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    target_logits = 2 * torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, -1).numpy()
    q = torch.softmax(target_logits, -1).numpy()
    expected = rel_entr(p, q).sum(-1)
    out = K.kl_per_token("full", None, None, logits, target_logits)
    assert out.shape == (3, 5)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-10)


def test_full_is_kl_of_policy_to_target_not_reverse():
    logits, target_logits = torch.tensor([[[0.0, 2.0, -1.0]]]), torch.tensor([[[1.0, -1.0, 0.5]]])
    p = torch.distributions.Categorical(logits=logits)
    q = torch.distributions.Categorical(logits=target_logits)
    forward, reverse = torch.distributions.kl_divergence(p, q), torch.distributions.kl_divergence(q, p)
    out = K.full_kl(logits, target_logits)
    assert torch.allclose(out, forward, atol=1e-6)
    assert not torch.allclose(out, reverse, atol=1e-3)


def test_monte_carlo_k1_and_k3_unbiased_k2_biased():
    """Under samples from p, mean(k1) and mean(k3) estimate KL(p||q); mean(k2) does not (here E[k2] = 2.41)."""
    p, q = torch.tensor([0.9, 0.1], dtype=torch.float64), torch.tensor([0.1, 0.9], dtype=torch.float64)
    true_kl = 0.8 * math.log(9.0)  # 0.9 log 9 + 0.1 log(1/9) = 1.7578
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logprobs, target = p.log()[x][None], q.log()[x][None]
    for estimator in ("k1", "k3"):
        k = K.kl_per_token(estimator, logprobs, target)
        stderr = k.std().item() / math.sqrt(k.numel())
        assert abs(k.mean().item() - true_kl) < 5 * stderr, estimator
    k2 = K.kl_per_token("k2", logprobs, target)
    assert abs(k2.mean().item() - true_kl) > 0.5


def test_unknown_estimator_raises_and_names_allowed_values():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="k1, k2, k3, full"):
        K.kl_per_token("k4", lp, lp)


@pytest.mark.parametrize("missing", ["logits", "target_logits"])
def test_full_without_logits_raises(missing):
    lp, logits = torch.zeros(1, 2), torch.zeros(1, 2, 3)
    kwargs = {"logits": logits, "target_logits": logits, missing: None}
    with pytest.raises(ValueError, match="full"):
        K.kl_per_token("full", lp, lp, **kwargs)


def test_reward_penalty_and_loss_penalty():
    kl = torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(K.reward_penalty(kl, 0.5, mask), torch.tensor([[-0.5, -1.0, 0.0], [-1.5, 0.0, 0.0]]))
    assert K.loss_penalty(kl, 0.5, mask).item() == pytest.approx(0.5 * (1 + 2 + 3) / 3)


# --- KL coefficient controllers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "current_kl, expected_error",
    [
        (12.0, 0.2),  # far above target: error clipped at +0.2
        (6.6, 0.1),  # slightly above: unclipped
        (6.0, 0.0),  # on target
        (5.4, -0.1),  # slightly below
        (0.0, -0.2),  # far below: clipped at -0.2
    ],
)
def test_adaptive_controller_update_exact_value(current_kl, expected_error):
    ctl = K.AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl, n_steps=64)
    assert ctl.value == pytest.approx(0.1 * (1 + expected_error * 64 / 10_000), rel=1e-12)


def test_adaptive_controller_grows_above_target_and_shrinks_below():
    up, down = K.AdaptiveKLController(0.1, 6.0, 100), K.AdaptiveKLController(0.1, 6.0, 100)
    up_values, down_values = [], []
    for _ in range(10):
        up.update(9.0, 8)
        down.update(3.0, 8)
        up_values.append(up.value)
        down_values.append(down.value)
    assert all(b > a for a, b in zip([0.1] + up_values, up_values))
    assert all(b < a for a, b in zip([0.1] + down_values, down_values))


@pytest.mark.parametrize("init", [0.5, 0.005])
def test_adaptive_controller_converges_in_closed_loop(init):
    """With KL = 0.3 / coef (a stronger penalty gives a smaller KL) the fixed point is coef = 0.05 for target 6."""
    ctl = K.AdaptiveKLController(init, target=6.0, horizon=100)
    for _ in range(300):
        ctl.update(0.3 / ctl.value, n_steps=64)
    assert ctl.value == pytest.approx(0.05, rel=1e-3)


def test_fixed_controller_never_changes():
    ctl = K.FixedKLController(0.05)
    for kl in (0.0, 100.0, -3.0):
        ctl.update(kl, 64)
    assert ctl.value == 0.05
