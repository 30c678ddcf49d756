"""Every KL variant, side by side. The training loop calls these and nothing else decides how KL enters training.

Notation, per sampled response token y_t with prefix y_<t (tensors (b, t) unless said otherwise):
    delta_t = log pi_theta(y_t | y_<t) - log pi_target(y_t | y_<t),   r_t = exp(-delta_t) = pi_target / pi_theta,
    s_t = grad log pi_theta(y_t | y_<t),   w_t = pi_theta(y_t | y_<t) / sg(pi_old(y_t | y_<t)),   sg = stop-gradient,
    m_t = response mask (1 up to and including EOS).
``pi_target`` is the SFT model (target ``reference``; a moving copy of it with ``ref_sync_every``) or the
rollout-time policy pi_old (target ``old_policy``).

Estimators of KL(pi_theta || pi_target) per token (J. Schulman, "Approximating KL Divergence", 2020,
joschu.net/blog/kl-approx.html), with their per-sample gradient and, on-policy, its expectation at one position
(Tang & Munos 2025, arXiv 2506.09477; Shah et al. 2025, arXiv 2512.21852):
    k1   = delta                         grad s_t               E = 0 (no regularisation)
    k2   = delta^2 / 2                   grad delta_t s_t       E = grad KL(pi_theta || pi_ref)
    k3   = exp(-delta) - 1 + delta       grad (1 - r_t) s_t     E = grad KL(pi_ref || pi_theta) (forward KL)
    full = sum_v pi_theta(v) (log pi_theta(v) - log pi_target(v))   exact at each position, needs logits (b, t, V)
    k1+, k3+  value of k1/k3, gradient of k2 (straight-through; verl ``kl_penalty``)          ``straight_through``
Loss-side weighting and terms:
    is_weight     w_t * k_t; grad of w k3 is w_t delta_t s_t, unbiased off-policy          ``importance_weight``
    return_to_go  + (log pi_t - sg log pi_t) * sg(sum_{t' > t} m k_t'): the future KL       ``kl_return_to_go``
Placements (``placement_coefs``; the coefficient of each side):
    reward: rewards_t = -kl_coef * c_t * k_t (+ score at the last token) before the advantages. Ziegler et al.
            2019 (arXiv 1909.08593) eq. 2; openai/lm-human-preferences `train_policy.py` (`non_score_reward`).
    loss:   loss += kl_coef * aggregate(k), gradient through pi_theta. GRPO (arXiv 2402.03300) eq. 3; verl
            `actor.use_kl_loss`.
    both:   kl_coef in each place (verl), or split: both_split * kl_coef in the reward, the rest in the loss.
Aggregation of the KL term (``aggregate``, ``reward_weights``), verl ``loss_agg_mode`` names, over a batch of B:
    token-mean           sum_bt m k / sum_bt m                 native (the policy loss's own aggregation)
    seq-mean-token-sum   (1/B) sum_b sum_t m k
    seq-mean-token-mean  (1/B) sum_b (sum_t m k / L_b)          DeepSeekMath eq. 3's per-response mean
In the reward an aggregation is a per-token weight c_t = a_mode / a_pg, constant in a response (a: the aggregation's
weights, ``aggregation_weights``; pg: the policy loss's aggregation): the penalty reaches s_t through the returns
with the policy loss's weight, so one coefficient means the same strength in both places for every aggregation.

Contract: the expected gradient of every accepted combination (``CONTRACT``; ``contract_rows`` finds a config's
row; tests/rlhf/test_kl_contracts.py checks every row on- and off-policy by exact enumeration, and that every
combination the schema accepts has exactly one row; each sampled-token estimator's value and score coefficient are
in ``FORMULAS``, which the test evaluates). Per unit coefficient, per-sequence scale (other aggregations multiply by
their weight). With KL_t = KL(pi(.|y<t) || target(.|y<t)) and F_t = sum_{t'>t} delta_t':
g_seq = grad KL(P_pi || P_target) over whole responses = g_tok + g_fut; g_tok = E[sum_t grad KL_t] (prefix fixed);
g_fut = E[sum_t s_t sum_{t'>t} KL_t']. Refused (one line naming the keys, rlhf/config.py): full in the reward alone
(g_fut only), return_to_go with k1/k3 unweighted or outside placement loss, is_weight outside placement loss or
with full/abs, k1+/k3+/abs in both places, both_split, old_policy_forward other than exact KL in the loss. The
table (``contract_text``; the README's is ``contract_markdown``, spliced in by ``python -m pipelines.readme``):
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rlhf.config import ESTIMATORS, IS_DETACHED, STRAIGHT_THROUGH, KLConfig


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
    if estimator in STRAIGHT_THROUGH:
        value = kl_per_token(estimator[:2], logprobs, target_logprobs)
        return straight_through(value, kl_per_token("k2", logprobs, target_logprobs))
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
    if estimator == "abs":  # verl `kl_penalty` 'abs'
        return delta.abs()
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(ESTIMATORS)}")


def straight_through(value: torch.Tensor, grad_of: torch.Tensor) -> torch.Tensor:
    """The value of ``value`` with the gradient of ``grad_of`` (both (b, t)): grad_of - sg(grad_of) + sg(value).

    verl `verl/trainer/ppo/core_algos.py` ``kl_penalty`` (estimators 'k1+', 'k3+': the value of k1/k3, the
    gradient of k2, whose on-policy expectation is the reverse-KL gradient at each position)."""
    return grad_of - grad_of.detach() + value.detach()


def estimate(kc: KLConfig, logprobs, target_logprobs, logits=None, target_logits=None) -> torch.Tensor:
    """The arm's per-token KL (b, t): ``kl_per_token`` of its estimator, in its target's direction, clamped.

    target 'old_policy_forward' is KL(pi_old || pi_theta) = sum_v pi_old(v) (log pi_old(v) - log pi_theta(v)) at
    each position, lucidrains/PaLM-rlhf-pytorch `palm_rlhf_pytorch/ppo.py` ``masked_kl_div(old, new)`` (full
    only). ``kl_clamp`` = c clamps each value to [-c, c] (verl `core_algos.kl_penalty` clamps k3 to +-10,
    OpenRLHF `compute_approx_kl` its estimators to +-10/+-20); a clamped value has no gradient."""
    if kc.target == "old_policy_forward":
        k = full_kl(target_logits, logits)
    else:
        k = kl_per_token(kc.estimator, logprobs, target_logprobs, logits, target_logits)
    return k if kc.kl_clamp is None else k.clamp(-kc.kl_clamp, kc.kl_clamp)


def full_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(softmax(logits) || softmax(target_logits)) at every position: (b, t, V) x2 -> (b, t)."""
    logp, logq = F.log_softmax(logits, dim=-1), F.log_softmax(target_logits, dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def sequence_kl(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact per-sequence KL sum_t m_t KL(pi(.|y_<t) || pi_target(.|y_<t)): (b, t, V) x2, mask (b, t) -> (b,).

    The quantity ``rlhf.evaluate`` reports and the adaptive controller steers, whatever the arm's estimator."""
    return (full_kl(logits, target_logits) * mask).sum(1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at every position: (b, t, V) -> (b, t)."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (x, mask: (b, t)) -> scalar."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


# --- which target, which side, how much ------------------------------------------------------------------------


def kl_target(kc: KLConfig, logprobs, logits, ref_logprobs, ref_logits):
    """(target_logprobs (b, t), target_logits (b, t, V)): the reference's, or for target ``old_policy`` the
    rollout policy's own (lucidrains/PaLM-rlhf-pytorch)."""
    return (ref_logprobs, ref_logits) if kc.target == "reference" else (logprobs, logits)


def placement_coefs(kc: KLConfig, kl_coef: float) -> tuple[float | None, float | None]:
    """(reward-side coefficient, loss-side coefficient); None where the placement has no KL.

    ``both`` puts kl_coef in each place (verl allows both at once). The same estimator in both places has
    per-sample gradient (k + dk/dlog pi) s_t; for k1 (delta + 1) and k3 (delta) its on-policy expectation is the
    reverse-KL gradient, with the future KL through the returns: kl_coef * grad KL in total, the same strength as
    one placement at kl_coef (a split f / 1 - f is refused: the halves add up only at equal coefficients)."""
    reward = kl_coef if kc.placement in ("reward", "both") else None
    loss = kl_coef if kc.placement in ("loss", "both") else None
    return reward, loss


def aggregation_of(kc: KLConfig, pg_mode: str = "token-mean") -> str:
    """The aggregation of the KL term on either side: the configured one, else the policy loss's (``pg_mode``,
    token-mean unless PPOConfig says otherwise), which is what the reward side gets natively (its per-token
    penalties, summed by the returns, enter the policy loss with the policy loss's weights)."""
    return kc.aggregation or pg_mode


def aggregation_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Weights a (b, t) with aggregate(x, mask, mode) = sum_bt a x, verl `core_algos.agg_loss` names:
    token-mean m / sum m;  seq-mean-token-sum m / B;  seq-mean-token-mean m / (B L_b);
    seq-mean-token-sum-norm m / (B T), T = the padded response width (Dr. GRPO's constant, arXiv 2503.20783)."""
    b, t = mask.shape
    if mode == "token-mean":
        return mask / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        return mask / b
    if mode == "seq-mean-token-mean":
        return mask / (b * mask.sum(1, keepdim=True).clamp(min=1.0))
    if mode == "seq-mean-token-sum-norm":
        return mask / (b * t)
    raise ValueError(f"unknown aggregation {mode!r}")


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Aggregation of per-token terms x (b, t) -> scalar (``aggregation_weights``): token-mean sum m x / sum m;
    seq-mean-token-sum mean_b sum_t m x;  seq-mean-token-mean mean_b (sum_t m x / L_b);  seq-mean-token-sum-norm
    sum m x / (B T)."""
    if mode == "token-mean":
        return masked_mean(x, mask)
    if mode == "seq-mean-token-sum":
        return (x * mask).sum(1).mean()
    if mode == "seq-mean-token-mean":
        return ((x * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if mode == "seq-mean-token-sum-norm":
        return (x * mask).sum() / (mask.shape[0] * mask.shape[1])
    raise ValueError(f"unknown aggregation {mode!r}")


def reward_weights(mask: torch.Tensor, mode: str, pg_mode: str = "token-mean") -> torch.Tensor:
    """Per-token weights c (b, t) of the reward-side KL that give it the strength of the loss-side KL with
    aggregation ``mode``: c = a_mode / a_pg (``aggregation_weights``), constant within a response. The reward-side
    penalty at t' reaches s_t (t <= t') through the returns with the policy loss's weight a_pg, so its expected
    gradient is then that of aggregate(k, mode) plus the future KL at the same weights. With mode == pg_mode
    (native) c = m, the per-token penalty of Ziegler et al. E.g. pg token-mean: token-mean c = m;
    seq-mean-token-sum c = m sum m / B (the mean length); seq-mean-token-mean c = m (sum m / B) / L_b."""
    if mode == pg_mode:
        return mask
    a, a_pg = aggregation_weights(mask, mode), aggregation_weights(mask, pg_mode)
    return torch.where(mask > 0, a / torch.where(mask > 0, a_pg, torch.ones_like(a_pg)), torch.zeros_like(a))


def per_sequence_factor(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Mean response length sum m / B for the two mean aggregations, 1 for seq-mean-token-sum: multiplying a
    token-mean by it gives exactly the per-sequence sum (seq-mean-token-mean: nominally, it weights response b by
    L-bar / L_b). Puts gradient diagnostics of every aggregation on the scale of the sequence KL."""
    if mode == "seq-mean-token-sum":
        return torch.ones((), dtype=mask.dtype, device=mask.device)
    return mask.sum() / mask.shape[0]


# --- the reward side ---------------------------------------------------------------------------------------------


def reward_kl(
    kc: KLConfig, logprobs, target_logprobs, logits, target_logits, mask, pg_mode: str = "token-mean"
) -> torch.Tensor | None:
    """The KL the reward placement charges, per token and per unit coefficient: c_t * k_t (b, t) with the
    aggregation weights c of ``reward_weights`` (``pg_mode``: the policy loss's aggregation); None when the
    placement has no reward side. Computed once per rollout (and, for target ``old_policy`` only, again before
    each later epoch: ``reward_kl_remeasured``)."""
    if placement_coefs(kc, 1.0)[0] is None:
        return None
    k = estimate(kc, logprobs, target_logprobs, logits, target_logits)
    return k * reward_weights(mask, aggregation_of(kc, pg_mode), pg_mode)


def reward_kl_remeasured(kc: KLConfig) -> bool:
    """KL to the rollout policy is identically 0 at rollout; as lucidrains/PaLM-rlhf-pytorch 0.2 it is re-measured
    with the updated policy before each later epoch and subtracted from the rewards (advantages re-run)."""
    return kc.target == "old_policy" and kc.placement in ("reward", "both")


def reward_penalty(kl: torch.Tensor, kl_coef: float, mask: torch.Tensor) -> torch.Tensor:
    """Per-token reward from the KL placed in the reward: -kl_coef * kl_t on response tokens, (b, t)."""
    return -kl_coef * kl * mask


# --- the loss side -----------------------------------------------------------------------------------------------


def importance_weight(logprobs: torch.Tensor, old_logprobs: torch.Tensor, detach: bool = False) -> torch.Tensor:
    """w_t = exp(log pi_theta - sg(log pi_old)), (b, t): the weight of ``is_weight``, multiplying the loss-side k_t.

    DeepSeek-V3.2 (arXiv 2512.02556) "unbiased KL estimate"; TRL GRPO `use_bias_correction_kl`; OpenRLHF
    `--algo.kl.unbiased_gradient`. For k3 the per-sample gradient of w k3 is w (k3 + 1 - r) s = w delta s, for k1
    w (delta + 1) s, whose expectations under pi_old are the reverse-KL gradient at each position, on- and
    off-policy; the weight carries gradient even where w = 1, so it changes the on-policy gradient too.
    ``detach``: sg(w), for k2, k1+, k3+ whose own gradient delta s is already the target's (RPG, Zhang et al.
    2025, arXiv 2505.17508, the detached-ratio form); a differentiable w would add w k s (k1+ x w: twice the
    gradient off-policy, k2 x w and k3+ x w biased)."""
    w = torch.exp(logprobs - old_logprobs.detach())
    return w.detach() if detach else w


def kl_return_to_go(kl: torch.Tensor, score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Score-function term for the KL of later tokens: (score_t - sg(score_t)) * sg(sum_{t' > t} m_t' k_t'), (b, t).

    A per-token loss never credits y_t for the KL it causes at t' > t; the gradient of the sequence KL adds
    E[sum_t s_t sum_{t'>t} KL_t'] (Tang & Munos 2025, arXiv 2506.09477; FRPO, arXiv 2601.10201). ``score`` is
    log pi_theta (gradient s_t) or, with ``is_weight``, w_t (gradient w_t s_t, per-token off-policy correction).
    Written so that its value is 0 and only its gradient counts. ``kl`` (b, t) holds the per-token values summed
    into the future KL: delta_t' (k1, the issue's sg(delta_t')) for every sampled-token estimator and the exact
    KL_t' for 'full' (current parameters); both estimate KL_t' without bias given the prefix, so a per-token term
    whose expected gradient is grad KL_t with the prefix fixed (k2, k1+, k3+, full, w * k3) plus this one is
    the exact sequence-KL gradient on-policy."""
    future = (kl * mask).detach()
    future = future.flip(1).cumsum(1).flip(1) - future  # (b, t): sum over t' > t
    return (score - score.detach()) * future * mask


def loss_kl_terms(kc: KLConfig, logprobs, old_logprobs, target_logprobs, logits, target_logits, mask) -> torch.Tensor:
    """Per-token loss-side KL terms (b, t) under the current policy (``logprobs`` (b, t), ``logits`` (b, t, V) carry
    the gradient; ``old_logprobs`` are the rollout's): k_t, times w_t with ``is_weight``, plus the return-to-go
    term with ``return_to_go``. Values are the (weighted) KL estimate."""
    k = estimate(kc, logprobs, target_logprobs.detach(), logits, _detach(target_logits))
    if not kc.is_weight:
        terms, score = k, logprobs  # (b, t)
    elif kc.estimator in IS_DETACHED:  # RPG: sg(w) k; the future-KL term's score is then w s (w * log pi)
        w = importance_weight(logprobs, old_logprobs, detach=True)
        terms, score = w * k, w * logprobs
    else:
        score = importance_weight(logprobs, old_logprobs)
        terms = score * k
    if kc.return_to_go:  # the future KL as delta_t' (k1 values) or, for 'full', the exact KL at each position
        future = k if kc.estimator == "full" else logprobs - target_logprobs.detach()
        terms = terms + kl_return_to_go(future, score, mask)
    return terms


def loss_penalty(terms: torch.Tensor, kl_coef: float, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Auxiliary loss from the KL placed in the loss: kl_coef * aggregate(terms, mask, mode), scalar."""
    return kl_coef * aggregate(terms, mask, mode)


def _detach(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach()


# --- the arm resolved once per run ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedKL:
    """An arm's KLConfig resolved once per run (``resolve``) into what the training loop (rlhf.ppo) and the gradient
    diagnostics (rlhf.diagnostics) call; neither reads the config's fields nor decides the side itself.

    ``traj`` is the rollout (rlhf.ppo.Trajectory: logprobs, logits, ref_logprobs, ref_logits, mask), ``logprobs``
    (b, t) / ``logits`` (b, t, V) the policy side:
        reward_kl(traj, logprobs, logits) -> c_t k_t (b, t), per unit coefficient (``reward_kl``); None: no reward side
        loss_kl(traj, mb, logprobs, logits) -> loss-side terms (m, t) of minibatch ``mb`` (``loss_kl_terms``), the
                                             policy side being the minibatch's; None: no loss side
    ``mode``: the aggregation of the KL term (``aggregation_of``); ``remeasured``: ``reward_kl_remeasured``."""

    config: KLConfig
    mode: str
    reward_kl: Callable[..., torch.Tensor] | None
    loss_kl: Callable[..., torch.Tensor] | None
    remeasured: bool

    @property
    def on(self) -> bool:
        """Whether the arm has a KL term at all (the no-KL baseline has neither side)."""
        return self.reward_kl is not None or self.loss_kl is not None

    def controller(self) -> AdaptiveKLController | FixedKLController:
        return controller(self.config)

    @property
    def moving_reference(self) -> bool:
        return self.config.ref_sync_every is not None

    def sync_reference_due(self, ref: nn.Module, policy: nn.Module, iteration: int) -> None:
        """Moves the training reference toward ``policy`` after ``iteration`` when the schedule says so."""
        if reference_due(self.config, iteration):
            sync_reference(ref, policy, self.config.ref_sync_alpha)


def resolve(kc: KLConfig, pg_mode: str = "token-mean") -> ResolvedKL:
    """``kc`` as the reward-side and loss-side functions of ``ResolvedKL`` (``placement_coefs``: 'both' has each),
    under a policy loss aggregated as ``pg_mode``."""
    reward, loss = placement_coefs(kc, 1.0)

    def targets(traj):
        return kl_target(kc, traj.logprobs, traj.logits, traj.ref_logprobs, traj.ref_logits)

    def reward_side(traj, logprobs, logits) -> torch.Tensor:
        target_logprobs, target_logits = targets(traj)
        return reward_kl(kc, logprobs, target_logprobs, logits, target_logits, traj.mask, pg_mode)

    def loss_side(traj, mb, logprobs, logits) -> torch.Tensor:
        tlp, tl = targets(traj)
        return loss_kl_terms(kc, logprobs, traj.logprobs[mb], tlp[mb], logits, tl[mb], traj.mask[mb])

    return ResolvedKL(
        kc,
        aggregation_of(kc, pg_mode),
        None if reward is None else reward_side,
        None if loss is None else loss_side,
        reward_kl_remeasured(kc),
    )


# --- moving reference --------------------------------------------------------------------------------------------


def reference_due(kc: KLConfig, iteration: int) -> bool:
    """Whether the moving reference is updated after ``iteration`` (every ``ref_sync_every`` iterations)."""
    return kc.ref_sync_every is not None and iteration % kc.ref_sync_every == 0


@torch.no_grad()
def sync_reference(ref: nn.Module, policy: nn.Module, alpha: float) -> None:
    """ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter, in place; alpha = 1 resets the reference
    to the policy exactly. TRL `SyncRefModelCallback` (`ref_model_mixup_alpha`, every `ref_model_sync_steps`);
    slime `--ref-update-interval` (a reset)."""
    for p_ref, p in zip(ref.parameters(), policy.parameters(), strict=True):
        p_ref.mul_(1.0 - alpha).add_(p, alpha=alpha)


# --- coefficient controllers -------------------------------------------------------------------------------------


class AdaptiveKLController:
    """Ziegler et al. 2019, sec. 2.2; openai/lm-human-preferences `train_policy.py` `AdaptiveKLController`.

        e = clip(KL_now / KL_target - 1, -0.2, 0.2);   kl_coef <- kl_coef * (1 + e * n_steps / horizon)

    ``KL_now`` here is the batch mean of the *exact* per-sequence KL to the (frozen SFT) reference on the rollout,
    sum_t KL(pi_old(.|y_<t) || pi_ref(.|y_<t)) (``sequence_kl``), for every arm. Deviation from Ziegler et al.
    (and lm-human-preferences, old TRL), who feed the per-sequence sum of k1: "matched KL" is then steered on the
    same quantity whatever the arm's training estimator, and the one ``rlhf.evaluate`` reports. ``n_steps`` is
    the number of episodes in the batch, ``horizon`` in episodes (10,000 in the paper; within a run of about 60
    iterations of 64 episodes a few hundred lets the coefficient move by up to 1 +- 0.2 * 64 / horizon per
    iteration).
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


def controller(kc: KLConfig) -> AdaptiveKLController | FixedKLController:
    """The arm's coefficient controller: adaptive with ``adaptive_target`` and ``horizon``, fixed otherwise."""
    if kc.adaptive_target is None:
        return FixedKLController(kc.coef)
    return AdaptiveKLController(kc.coef, kc.adaptive_target, kc.horizon)


# --- the contract: what every accepted combination's expected gradient is -----------------------------------------


class Contract(NamedTuple):
    """One row of CONTRACT: the combinations it covers (a field's tuple lists the values it matches) and the
    expected gradient of the KL term per unit coefficient, on the per-sequence scale (aggregation
    seq-mean-token-sum; every other aggregation multiplies it by its weight a, the same in both places: token-mean
    and seq-mean-token-mean 1/L at a fixed length L, seq-mean-token-sum-norm 1/T; at variable lengths token-mean is
    a ratio estimator, 1/L-bar in the large-batch limit, and seq-mean-token-mean weights response y by 1/L_y).
    ``on_key``/``off_key`` name the exact quantity it equals (tests/rlhf/test_kl_contracts.py computes each by
    exact enumeration): 'seq' grad KL(P_pi || P_target) over whole responses; 'tok' sum_t E[grad KL_t] with the
    prefix held fixed (prefixes from the sampling policy); 'tok_fwd' the same for KL_t(target || pi); 'zero';
    '' when it is the row's per-sample formula and nothing cleaner (the tests check the formula then)."""

    placement: tuple[str, ...]
    estimator: tuple[str, ...]
    is_weight: bool
    return_to_go: bool
    target: tuple[str, ...]
    algorithm: tuple[str, ...]  # rlhf.config ALGORITHMS and 'dr_grpo' (grpo with PPOConfig.dr_grpo)
    on_policy: str
    off_policy: str
    source: str
    on_key: str
    off_key: str


_ALL_ALGOS = ("ppo", "reinforce_pp", "rloo", "grpo", "dr_grpo")
_RETURNS = ("ppo", "reinforce_pp", "rloo")  # credit sum_{t' >= t} k (ppo: critic aside) or the leave-one-out sum
_REF, _OLD = ("reference",), ("old_policy",)
_STALE = "the reward's KL values are the rollout policy's (stale), the ratio w_t corrects the token only"


class Formula(NamedTuple):
    """A sampled-token estimator as the contract reads it: its value k(delta) and its score coefficient c(delta) with
    grad k = c(delta) s_t (python expressions in ``delta`` with exp, abs and sign; the contract test evaluates them
    against the code by exact enumeration: the row formulas are E[sum_t c s_t] in the loss, w_t (k + c) with a
    differentiable importance weight, sg(w_t) c with a detached one, and k credited through the returns in the
    reward)."""

    value: str
    score: str


FORMULAS: dict[str, Formula] = {  # every estimator but 'full' (the exact KL, from logits)
    "k1": Formula("delta", "1"),
    "k2": Formula("delta**2 / 2", "delta"),
    "k3": Formula("exp(-delta) - 1 + delta", "1 - exp(-delta)"),
    "abs": Formula("abs(delta)", "sign(delta)"),
    "k1+": Formula("delta", "delta"),  # straight-through: k1's value, k2's gradient
    "k3+": Formula("exp(-delta) - 1 + delta", "delta"),
}
CONTRACT: tuple[Contract, ...] = (
    # loss side: the advantages never touch it, so every algorithm
    Contract(("loss",), ("k1",), False, False, _REF + _OLD, _ALL_ALGOS,
             "0: no regularisation (E[s_t] = 0)",
             "E_old[sum_t s_t] = -grad CE(pi_old, pi): a descent step raises CE(pi_old, pi), a push away from pi_old",
             "Schulman 2020; Tang & Munos 2025 (arXiv 2506.09477) sec. 3", "zero", ""),
    Contract(("loss",), ("k2", "k1+", "k3+"), False, False, _REF + _OLD, _ALL_ALGOS,
             "g_tok: per-position grad KL(pi || target), no future-KL term", "biased: E_old[sum_t delta_t s_t]",
             "Tang & Munos 2025; verl core_algos.kl_penalty 'k1+'/'k3+'", "tok", ""),
    Contract(("loss",), ("k3",), False, False, _REF + _OLD, _ALL_ALGOS,
             "per-position grad KL(target || pi): the forward KL, no future term",
             "biased: E_old[sum_t (1 - r_t) s_t]", "GRPO (arXiv 2402.03300) eq. 4; Tang & Munos 2025", "tok_fwd", ""),
    Contract(("loss",), ("abs",), False, False, _REF + _OLD, _ALL_ALGOS,
             "biased: E[sum_t sign(delta_t) s_t], not a KL gradient", "biased: E_old[sum_t sign(delta_t) s_t]",
             "verl core_algos.kl_penalty 'abs'", "", ""),
    Contract(("loss",), ("full",), False, False, _REF + _OLD, _ALL_ALGOS,
             "g_tok: exact per-position grad KL_t, no future term", "g_tok at prefixes from pi_old",
             "Amini et al. 2025 (the pathwise half)", "tok", "tok"),
    Contract(("loss",), ("full",), False, False, ("old_policy_forward",), _ALL_ALGOS,
             "0 (grad KL(pi_old || pi) at pi = pi_old)",
             "grad KL(P_old || P_pi) over whole responses, exactly (its expectation is under pi_old)",
             "lucidrains/PaLM-rlhf-pytorch ppo.py masked_kl_div(old, new)", "tok_fwd", "tok_fwd"),
    Contract(("loss",), ("k1", "k3"), True, False, _REF + _OLD, _ALL_ALGOS,
             "g_tok (w_t (delta_t + 1) s_t, w_t delta_t s_t)", "g_tok at prefixes from pi_old: w corrects the token",
             "DeepSeek-V3.2 (arXiv 2512.02556); TRL use_bias_correction_kl", "tok", "tok"),
    Contract(("loss",), ("k2", "k1+", "k3+"), True, False, _REF + _OLD, _ALL_ALGOS,
             "g_tok (sg(w_t) delta_t s_t)", "g_tok at prefixes from pi_old",
             "RPG, Zhang et al. 2025 (arXiv 2505.17508): detached ratio", "tok", "tok"),
    Contract(("loss",), ("k2", "k1+", "k3+", "full"), False, True, _REF + _OLD, _ALL_ALGOS,
             "g_seq: grad KL(P_pi || P_target) over whole responses, exactly",
             "biased: E_old[sum_t (per-token term + F_t) s_t], F_t = sum_{t' > t} delta_t' (full: KL_t')",
             "Tang & Munos 2025; FRPO (arXiv 2601.10201)", "seq", ""),
    Contract(("loss",), ("k1", "k3", "k2", "k1+", "k3+"), True, True, _REF + _OLD, _ALL_ALGOS,
             "g_seq exactly", "g_tok at pi_old prefixes + E_old[sum_t w_t s_t F_t]: the future KL sampled from pi_old",
             "Tang & Munos 2025 with the IS weight", "seq", ""),
    # reward side: credit through the returns (ppo with the critic neutralised, reinforce_pp) or the group baseline
    Contract(("reward",), ("k1",), False, False, _REF, _RETURNS,
             "g_seq exactly (REINFORCE on the sequence KL; RLOO's leave-one-out baseline has mean 0)",
             f"E_old[sum_t w_t s_t sum_(t'>=t) k1_t']: {_STALE}", "Ziegler et al. 2019 eq. 2; RLOO arXiv 2402.14740",
             "seq", ""),
    Contract(("reward",), ("k2", "k3", "abs"), False, False, _REF, _RETURNS,
             "biased: E[sum_t s_t sum_(t'>=t) k_t'] (k3 in the reward: Comedy; collapses here)",
             f"biased: E_old[sum_t w_t s_t sum_(t'>=t) k_t']: {_STALE}", "Shah et al. 2025 (arXiv 2512.21852)", "", ""),
    Contract(("reward",), ("k1", "k2", "k3", "abs"), False, False, _REF, ("dr_grpo",),
             "(G - 1)/G times the ppo row (the group mean includes the response itself)",
             "(G - 1)/G times the ppo row's off-policy formula", "Dr. GRPO (arXiv 2503.20783) eq. 3", "", ""),
    Contract(("reward", "both"), ("k1", "k2", "k3", "abs", "full"), False, False, _REF + _OLD, ("grpo",),
             "biased: each group's KL divided by std_G R + eps with the score (no KL gradient; the reward weight c "
             "of an aggregation cancels in that division when the score is constant)",
             "the same with pi_old's samples", "DeepSeekMath (arXiv 2402.03300) sec. 4.1.2; rlhf.algorithms", "", ""),
    Contract(("reward",), ("k1", "k2", "k3", "abs"), False, False, _OLD, _RETURNS + ("dr_grpo",),
             "0: the KL to the rollout policy is 0 at rollout",
             "E_old[sum_t w_t s_t sum_(t'>=t) k_t'(pi || pi_old)], re-measured before each later epoch",
             "lucidrains/PaLM-rlhf-pytorch 0.2 (KL subtracted from the reward)", "zero", ""),
    # both: the reward half gives the score-function part (and the future KL), the loss half the pathwise part
    Contract(("both",), ("k1", "k3"), False, False, _REF, _RETURNS,
             "g_seq exactly: E[(k + dk/dlog pi) s] = grad KL_t, the future KL through the returns",
             f"reward half {_STALE}; loss half as its loss row off-policy", "Shah et al. 2025; verl (both)", "seq", ""),
    Contract(("both",), ("full",), False, False, _REF, _RETURNS,
             "g_seq exactly: g_tok from the loss, the future KL from the returns",
             "g_tok at pi_old prefixes + E_old[sum_t w_t s_t sum_(t'>t) KL_t'(pi_old)]",
             "Amini et al. 2025 (Rao-Blackwellised KL)", "seq", ""),
    Contract(("both",), ("k2",), False, False, _REF, _RETURNS,
             "biased: E[(delta^2/2 + delta) s] per position plus the k2 future term", "biased (formula)",
             "Shah et al. 2025", "", ""),
    Contract(("both",), ("k1", "k2", "k3", "full"), False, False, _REF, ("dr_grpo",),
             "not g_seq: the reward half at (G - 1)/G, the loss half at 1", "formula", "Dr. GRPO; this table", "", ""),
    Contract(("both",), ("k1", "k2", "k3", "full"), False, False, _OLD, _RETURNS + ("dr_grpo",),
             "0 (both halves vanish at pi = pi_old)", "the reward row's re-measured formula + the loss row's",
             "PaLM-rlhf-pytorch (both versions at once)", "zero", ""),
)  # fmt: skip


def contract_rows(kc: KLConfig, algorithm: str) -> list[Contract]:
    """The CONTRACT rows that cover ``kc`` under ``algorithm`` ('dr_grpo' for grpo with dr_grpo); exactly one for
    every accepted combination (tests/rlhf/test_kl_contracts.py enumerates them all from the schema)."""
    return [
        row
        for row in CONTRACT
        if kc.placement in row.placement
        and kc.estimator in row.estimator
        and kc.is_weight == row.is_weight
        and kc.return_to_go == row.return_to_go
        and kc.target in row.target
        and algorithm in row.algorithm
    ]


def contract_text(width: int = 116) -> str:
    """CONTRACT as the plain-text table of this module's docstring (tests check that the two agree)."""
    import textwrap

    out = []
    for i, r in enumerate(CONTRACT, 1):
        opts = [o for o, on in (("is_weight", r.is_weight), ("return_to_go", r.return_to_go)) if on] or ["-"]
        head = f"{i:>2}. {'/'.join(r.placement)} | {', '.join(r.estimator)} | {' + '.join(opts)} | "
        head += f"target {', '.join(r.target)} | {', '.join(r.algorithm)}"
        out += textwrap.wrap(head, width, subsequent_indent="    ")
        for tag, text in (("on ", r.on_policy), ("off", r.off_policy), ("src", r.source)):
            out += textwrap.wrap(f"{tag}: {text}", width, initial_indent="    ", subsequent_indent="         ")
    return "\n".join(out)


if __doc__ is not None:  # None under python -OO
    __doc__ += contract_text() + "\n"  # the table, once: CONTRACT in this module's help (pydoc, help(rlhf.kl))


def contract_markdown() -> str:
    """CONTRACT as the README's markdown table."""
    head = (
        "#",
        "placement",
        "estimator",
        "options",
        "target",
        "algorithm",
        "on-policy",
        "off-policy (π_old ≠ π)",
        "src",
    )
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(CONTRACT, 1):
        opts = " + ".join(o for o, on in (("is_weight", r.is_weight), ("return_to_go", r.return_to_go)) if on) or "–"
        cells = [str(i), "/".join(r.placement), ", ".join(r.estimator), opts, ", ".join(r.target)]
        cells += [", ".join(r.algorithm), r.on_policy, r.off_policy, r.source]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)
