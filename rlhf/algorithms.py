"""One advantage function per algorithm (verl `verl/trainer/ppo/core_algos.py` registers them the same way).

Every function maps per-token rewards (b, t) -- the score at the last response token plus the reward-side KL
penalty, already whitened if asked -- to (advantages (b, t), returns (b, t) or None), zero outside the mask:

    ppo           GAE with a value model (Schulman et al. 2016), advantages whitened over the batch
    grpo          A_i = (R_i - mean_G R) / (std_G R + eps) on every token of response i; R_i = sum_t r_t
                  (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300, eq. 3 and sec. 4.1.2)
    rloo          A_i = R_i - mean_{j != i} R_j on every token (Ahmadian et al. 2024, arXiv 2402.14740)
    reinforce_pp  returns G_t = sum_{t' >= t} gamma^(t'-t) r_t', whitened over the whole batch; no critic
                  (REINFORCE++, Hu 2025, arXiv 2501.03262; the paper uses gamma = 1)

Groups (grpo, rloo) are ``group_size`` consecutive rows sampled for one prompt. What the reward-side KL becomes:
under ppo and reinforce_pp each token is credited with the KL of itself and later tokens (returns); under grpo
and rloo the response's whole KL sum sg(sum_t c_t k_t) enters R_i *before* the group baseline (TRL RLOO and
GRPO subtract it from the score), so every token of the response is credited with all of it, the baseline
removes the group's mean KL, and grpo's division by the group's reward std rescales the KL with the score: the
KL's effective coefficient becomes beta / std_G R, prompt by prompt. ``normalize=False`` leaves out the
whitening (ppo, reinforce_pp) and the std division (grpo, Dr. GRPO arXiv 2503.20783); the gradient
diagnostics use it to follow the KL alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from rlhf.kl import masked_mean

GRPO_EPS = 1e-6  # verl `compute_grpo_outcome_advantage` epsilon


class AdvantageParams(NamedTuple):
    gamma: float
    lam: float
    group_size: int
    normalize: bool  # whiten (ppo, reinforce_pp) / divide by the group std (grpo); False for diagnostics
    group_std: bool = True  # grpo: divide by the group std when normalize; False = Dr. GRPO (arXiv 2503.20783)


AdvantageFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, AdvantageParams], tuple]


class Algorithm(NamedTuple):
    advantages: AdvantageFn
    critic: bool  # whether the algorithm builds and trains a value model


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over masked entries, (b, t). TRL `core.masked_whiten`; shift_mean=False keeps the mean."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), (b, t) -> advantages, returns (b, t).

        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = sum_{l >= 0} (gamma * lam)^l delta_{t+l},   R_t = A_t + V_t
    Vectorised as A = delta @ D with D[s, t] = (gamma * lam)^(s - t) for s >= t (a (t, t) upper-triangular
    discount matrix) instead of the usual reverse loop. Values past the last response token are masked to 0, so
    the last token bootstraps from 0 and every delta in the padding is 0. With values 0 and lam = 1, A_t is the
    discounted return sum_{t' >= t} gamma^(t'-t) r_t'.
    """
    values = values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # (b, t)
    deltas = (rewards + gamma * next_values - values) * mask  # (b, t)
    steps = torch.arange(rewards.shape[1], device=rewards.device, dtype=rewards.dtype)
    lag = steps[:, None] - steps[None, :]  # (t, t): s - t
    discount = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0), torch.zeros_like(lag))
    advantages = deltas @ discount  # (b, t)
    return advantages * mask, (advantages + values) * mask


def _groups(rewards: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sequence returns R_i = sum_t m r_t arranged as (n_prompts, group_size)."""
    return (rewards * mask).sum(1).view(-1, group_size)


def ppo_advantages(rewards, values, mask, p: AdvantageParams):
    """GAE(gamma, lam) on the value model's values (b, t); advantages whitened over the batch (lm-human-preferences,
    TRL PPO). Returns (advantages, returns = A + V, the value targets)."""
    advantages, returns = gae(rewards, values, mask, p.gamma, p.lam)
    if p.normalize:
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


def grpo_advantages(rewards, values, mask, p: AdvantageParams):
    """A_i = (R_i - mean_G R) / (std_G R + 1e-6), std with Bessel's correction as torch.std in verl and TRL,
    broadcast over the response's tokens; (b, t), None. ``values`` is ignored (no critic). Without
    ``group_std`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783 eq. 3 / verl ``norm_adv_by_std_in_grpo: False``)
    A_i = R_i - mean_G R = (G - 1)/G (R_i - mean_{j != i} R_j)."""
    r = _groups(rewards, mask, p.group_size)  # (n, G)
    a = r - r.mean(1, keepdim=True)
    if p.normalize and p.group_std:
        a = a / (r.std(1, keepdim=True) + GRPO_EPS)
    return a.reshape(-1, 1) * mask, None


def rloo_advantages(rewards, values, mask, p: AdvantageParams):
    """A_i = R_i - (sum_G R - R_i) / (G - 1), broadcast over the response's tokens (TRL RLOO `baseline`), not
    normalised (TRL `normalize_advantage` defaults to off); (b, t), None."""
    r = _groups(rewards, mask, p.group_size)  # (n, G)
    a = r - (r.sum(1, keepdim=True) - r) / (p.group_size - 1)
    return a.reshape(-1, 1) * mask, None


def reinforce_pp_advantages(rewards, values, mask, p: AdvantageParams):
    """Per-token returns G_t = sum_{t'>=t} gamma^(t'-t) r_t' (the KL in the reward enters token by token), whitened
    over every response token of the batch (OpenRLHF / verl `compute_reinforce_plus_plus_outcome_advantage`);
    (b, t), None."""
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, p.gamma, 1.0)
    return (masked_whiten(returns, mask) * mask if p.normalize else returns), None


ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm(ppo_advantages, critic=True),
    "grpo": Algorithm(grpo_advantages, critic=False),
    "rloo": Algorithm(rloo_advantages, critic=False),
    "reinforce_pp": Algorithm(reinforce_pp_advantages, critic=False),
}
