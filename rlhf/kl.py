"""Every KL variant, side by side. ``ppo.py`` calls these and nothing else decides how KL enters training.

Notation, per sampled response token y_t with prefix y_<t:
    delta_t = log pi_theta(y_t | y_<t) - log pi_target(y_t | y_<t),   r_t = exp(-delta_t) = pi_target / pi_theta.
``pi_target`` is the frozen SFT model (target ``reference``) or the rollout-time policy (target ``old_policy``).

Estimators of KL(pi_theta || pi_target) per token (J. Schulman, "Approximating KL Divergence", 2020,
joschu.net/blog/kl-approx.html), all shaped (b, t):
    k1   = delta                                   unbiased, can be negative
    k2   = delta^2 / 2                             >= 0, biased, low variance
    k3   = exp(-delta) - 1 + delta                 >= 0, unbiased under samples of pi_theta (GRPO's choice)
    full = sum_v pi_theta(v) (log pi_theta(v) - log pi_target(v))    exact at each position, needs logits

Placements:
    reward: rewards_t = -kl_coef * k(delta_t) (+ score at the last token), before GAE. Ziegler et al. 2019
            (arXiv 1909.08593) eq. 2; openai/lm-human-preferences `train_policy.py` (`non_score_reward`).
    loss:   policy loss += kl_coef * masked_mean_t k(delta_t), gradient through pi_theta. GRPO
            (Shao et al. 2024, arXiv 2402.03300) eq. 3; verl `actor.use_kl_loss`.
    both:   both at once (verl allows it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.config import ESTIMATORS


def kl_per_token(
    estimator: str,
    logprobs: torch.Tensor,
    target_logprobs: torch.Tensor,
    logits: torch.Tensor | None = None,
    target_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate, (b, t), from sampled-token log-probs (b, t) or, for ``full``, logits (b, t, V).

    Gradients flow through whatever of ``logprobs``/``logits`` carries them; the target is the caller's to detach.
    """
    if estimator == "full":
        if logits is None or target_logits is None:
            raise ValueError("estimator 'full' needs logits and target_logits of shape (b, t, V)")
        return full_kl(logits, target_logits)
    delta = logprobs - target_logprobs
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.expm1(-delta) + delta
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(ESTIMATORS)}")


def full_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(softmax(logits) || softmax(target_logits)) at every position: (b, t, V) x2 -> (b, t)."""
    logp, logq = F.log_softmax(logits, dim=-1), F.log_softmax(target_logits, dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at every position: (b, t, V) -> (b, t)."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (x, mask: (b, t)) -> scalar."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def reward_penalty(kl: torch.Tensor, kl_coef: float, mask: torch.Tensor) -> torch.Tensor:
    """Per-token reward from the KL placed in the reward: -kl_coef * k_t on response tokens, (b, t)."""
    return -kl_coef * kl * mask


def loss_penalty(kl: torch.Tensor, kl_coef: float, mask: torch.Tensor) -> torch.Tensor:
    """Auxiliary loss from the KL placed in the loss: kl_coef * masked token-mean of k_t, scalar."""
    return kl_coef * masked_mean(kl, mask)


class AdaptiveKLController:
    """Ziegler et al. 2019, sec. 2.2; openai/lm-human-preferences `train_policy.py` `AdaptiveKLController`.

        e = clip(KL_now / KL_target - 1, -0.2, 0.2);   kl_coef <- kl_coef * (1 + e * n_steps / horizon)

    ``KL_now`` here is the batch mean of the per-sequence *sum* of the training estimator against the reference
    (as lm-human-preferences and old TRL; verl/OpenRLHF feed a per-token mean instead), ``n_steps`` the number
    of episodes in the batch, ``horizon`` in episodes (10,000 in the paper).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class FixedKLController:
    """A constant kl_coef; same interface as ``AdaptiveKLController``."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass
