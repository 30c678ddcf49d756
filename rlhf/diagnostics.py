"""Gradient diagnostics: each arm's KL-gradient estimate against the true gradient of the sequence KL.

The true gradient. With KL_t(y_<t) = KL(pi_theta(.|y_<t) || pi_ref(.|y_<t)) exact over the vocabulary and
S(y) = sum_t m_t KL_t the sequence KL (what ``rlhf.evaluate`` reports and the controller steers),

    g* = grad E_{x, y ~ pi_theta}[S(y)] = E[sum_t m_t grad KL_t (prefix fixed) + sum_t m_t s_t sum_{t'>t} m_t' KL_t']

(the second term is the score-function "future KL", Tang & Munos 2025, arXiv 2506.09477). ``true_gradient``
averages the gradient of ``sequence_kl_surrogate`` over ``n_true`` fresh samples of the policy on uniformly drawn
training prompts: an unbiased estimate (tests check it against exact enumeration of a small response space).

The arm's estimate (``arm_kl_surrogate``): the gradient of the arm's KL term as the loop applies it, per unit of
its coefficient, on one minibatch:
    loss side    grad of aggregate(loss_kl_terms) -- estimator, straight-through, IS weight, return-to-go and
                 aggregation exactly as ``rlhf.kl`` applies them in the loop;
    reward side  grad of the loop's token-mean policy-gradient loss -mean_t(ratio_t * A^KL_t) with the KL-only
                 advantages A^KL = the algorithm's own advantage function applied to the reward-side KL penalty
                 -c_t k_t (rollout-time values), with values 0, lam = 1 and normalize=False. So PPO and
                 REINFORCE++ credit the discounted KL-to-go (what GAE targets with an unbiased critic, for any lam),
                 GRPO the group-centred and RLOO the leave-one-out sequence KL. Left out: the critic's baseline,
                 reward whitening, advantage whitening and GRPO's std division (they depend on the score too) and
                 the ratio clipping (it depends on the sign of the total advantage);
    both         reward side + loss side (``placement_coefs``: coef in each place).
Scale: per unit coefficient, as the loop applies it, then divided by the aggregation's nominal strength
``strength`` (reported): 1 for seq-mean-token-sum, 1 / L-bar for token-mean and seq-mean-token-mean (L-bar: the mean
response length over all the regime's estimate batches, one constant), 1 / T for seq-mean-token-sum-norm. The
constant puts every arm on the scale of grad S without making two aggregations equal: before issue 18 each
minibatch's token mean was multiplied by that minibatch's own mean length, which turned it exactly into the
per-sequence sum, so token-mean and seq-mean-token-sum arms gave identical estimates on the same batch. Now a
token-mean estimate is a ratio (sum over the minibatch / its token count) and differs from the sum.

Regimes. ``on_policy``: minibatches of fresh samples from the current policy. ``off_policy``: a copy of the
policy (with its value model and optimizer state) takes the arm's own epochs x minibatches - 1 updates on the
iteration's batch, i.e. reaches the parameters at which the loop computes its last gradient of the iteration;
the estimate uses fresh samples of the rollout policy pi_old evaluated there, the truth fresh samples there.
Each estimate uses one minibatch (minibatch_size responses) of an independently sampled batch (batch_size, for
the batch-level parts: group baselines, reward aggregation).

Reported per regime and per ``against`` (the frozen SFT ``reference``; and ``own``, the arm's own target when it
differs: the moving reference, or the rollout policy for target old_policy), with g-hat the mean of the
``n_minibatches`` estimates and g* the true gradient:
    cosine            cos(g-hat, g*), the bias-only cosine (noise averages out over minibatches); NaN when g-hat
                      is 0 (e.g. a KL to the old policy, on-policy). Read it with cosine_noise_floor: an unbiased
                      estimator with this arm's scale and noise would reach about that value, so only a cosine
                      clearly below the floor shows bias
    cosine_noise_floor  s |g*| / sqrt(s^2 |g*|^2 + tr Var(g_m) / M + s^2 tr Var(g*-estimate)), s = scale
    cosine_minibatch  mean over minibatches of cos(g_m, g*): one step's alignment, which mostly measures the
                      estimator's variance (do not rank arms by it)
    scale             <g-hat, g*> / |g*|^2: strength along the true gradient per unit coefficient
    rel_bias          |g-hat - g*| / |g*|;  rel_bias_noise: its expected value from sampling noise alone,
                      sqrt(tr Var(g_m) / n_minibatches + tr Var(g*-estimate)) / |g*|;  rel_bias_excess:
                      sqrt(max(rel_bias^2 - rel_bias_noise^2, 0)), the bias with the noise taken out
                      (E|g-hat - g*|^2 = |bias|^2 + the two variances)
    rel_var           tr Var(g_m) / |g*|^2 (unbiased over minibatches): the variance of one minibatch's estimate
    true_norm, true_rel_se   |g*| and the relative standard error of its estimate
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from rlhf import kl as K
from rlhf.algorithms import ALGORITHMS, AdvantageParams
from rlhf.config import PPOConfig
from rlhf.model import generate, logprobs_from_logits, response_logits
from rlhf.task import EOS, Task, response_mask

TRUE_CHUNKS = 8  # the true gradient is averaged over this many chunks of n_true / 8 samples (its standard error)


def sequence_kl_surrogate(logits, ref_logits, logprobs, mask) -> torch.Tensor:
    """Per response, (b,): sum_t m KL_t + sum_t m (log pi_t - sg log pi_t) sg(sum_{t'>t} m KL_t'), whose gradient,
    averaged over responses sampled from the policy, estimates g* without bias. logits (b, t, V) and logprobs
    (b, t) carry the gradient, ref_logits (b, t, V) not; the value is the exact sequence KL."""
    kl = K.full_kl(logits, ref_logits.detach())  # (b, t)
    return (kl * mask + K.kl_return_to_go(kl, logprobs, mask)).sum(1)


def arm_kl_surrogate(cfg: PPOConfig, kl: K.ResolvedKL, policy, traj, mb: torch.Tensor) -> torch.Tensor:
    """Scalar whose gradient is the arm's KL-gradient estimate on minibatch ``mb`` (indices into ``traj``), per unit
    coefficient and on the per-sequence scale (module docstring). ``traj``: an ``rlhf.ppo.Trajectory``; ``kl``: the
    run's resolved arm (its reward and loss sides, as the loop calls them)."""
    pg_mode = cfg.pg_mode
    mask = traj.mask[mb]
    logits = response_logits(policy, traj.prompts[mb], traj.responses[mb], cfg.temperature)  # (m, t, V)
    logprobs = logprobs_from_logits(logits, traj.responses[mb])  # (m, t)
    total = torch.zeros((), device=mask.device)
    if kl.loss_kl is not None:  # coefficient 1
        total = total + K.aggregate(kl.loss_kl(traj, mb, logprobs, logits), mask, kl.mode)
    if kl.reward_kl is not None:
        kl_rewards = K.reward_penalty(kl.reward_kl(traj, traj.logprobs, traj.logits), 1.0, traj.mask)
        params = AdvantageParams(cfg.gamma, 1.0, cfg.group_size, normalize=False)  # (b, t) credit below
        credit, _ = ALGORITHMS[cfg.algorithm].advantages(kl_rewards, torch.zeros_like(kl_rewards), traj.mask, params)
        ratio = torch.exp(logprobs - traj.logprobs[mb])
        total = total - K.aggregate(ratio * credit[mb], mask, pg_mode)
    return total


def flat_grad(scalar: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """The gradient of ``scalar`` w.r.t. ``params`` as one float64 vector (zeros where it does not depend on them)."""
    grads = torch.autograd.grad(scalar, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double() for g, p in zip(grads, params)])


def true_gradient(policy, ref_policy, train_prompts, task: Task, temperature: float, n: int, gen):
    """g* estimated from ``n`` fresh samples of ``policy`` (prompts uniform over ``train_prompts``): returns
    (mean gradient (P,), trace of the variance of that mean), from TRUE_CHUNKS chunks of n // TRUE_CHUNKS."""
    params = list(policy.parameters())
    size = n // TRUE_CHUNKS
    chunks = []
    for _ in range(TRUE_CHUNKS):
        idx = torch.randint(0, len(train_prompts), (size,), generator=gen, device=train_prompts.device)
        prompts = train_prompts[idx]
        responses = generate(policy, prompts, task.max_new_tokens, temperature, gen, EOS)
        logits = response_logits(policy, prompts, responses, temperature)
        with torch.no_grad():
            ref_logits = response_logits(ref_policy, prompts, responses, temperature)
        surrogate = sequence_kl_surrogate(
            logits, ref_logits, logprobs_from_logits(logits, responses), response_mask(responses)
        )
        chunks.append(flat_grad(surrogate.mean(), params))
    grads = torch.stack(chunks)  # (C, P)
    return grads.mean(0), grads.var(0).sum().item() / TRUE_CHUNKS


def compare(estimates: torch.Tensor, truth: torch.Tensor, truth_var: float) -> dict[str, float]:
    """Metrics of the module docstring from per-minibatch estimates (M, P) and the true gradient (P,)."""
    mean = estimates.mean(0)
    norm2 = truth.dot(truth).item()
    norm = math.sqrt(norm2)
    if norm2 == 0.0:  # e.g. the KL to the old policy, on-policy: nothing to compare with
        keys = ("cosine", "cosine_noise_floor", "cosine_minibatch", "scale", "rel_bias", "rel_bias_noise")
        return {**dict.fromkeys(keys + ("rel_bias_excess", "rel_var"), float("nan")), "true_norm": 0.0,
                "true_rel_se": float("nan")}  # fmt: skip
    est_var = estimates.var(0).sum().item()
    cos = lambda a: a.dot(truth).item() / (a.norm().item() * norm) if a.norm().item() > 0 else float("nan")
    bias = (mean - truth).norm().item() / norm
    noise = math.sqrt(est_var / len(estimates) + truth_var) / norm
    s = mean.dot(truth).item() / norm2
    floor = abs(s) * norm / math.sqrt(s * s * norm2 + est_var / len(estimates) + s * s * truth_var) if s else 0.0
    return {
        "cosine": cos(mean),
        "cosine_noise_floor": floor,
        "cosine_minibatch": sum(cos(e) for e in estimates) / len(estimates),
        "scale": mean.dot(truth).item() / norm2,
        "rel_bias": bias,
        "rel_bias_noise": noise,
        "rel_bias_excess": math.sqrt(max(bias**2 - noise**2, 0.0)),
        "rel_var": est_var / norm2,
        "true_norm": norm,
        "true_rel_se": math.sqrt(truth_var) / norm,
    }


def arm_estimates(cfg: PPOConfig, kl, policy, sampling_policy, sample: Callable, gen) -> tuple[torch.Tensor, float]:
    """((n_minibatches, P), strength): the arm's estimate at ``policy``, each on one minibatch of a fresh batch of
    ``sampling_policy``'s responses, divided by the aggregation's nominal strength (module docstring)."""
    params = list(policy.parameters())
    rows, tokens = [], 0.0
    for _ in range(cfg.diagnostics.n_minibatches):
        traj = sample(sampling_policy, cfg.batch_size, gen)
        mb = torch.randperm(cfg.batch_size, generator=gen, device=traj.mask.device)[: cfg.minibatch_size]
        rows.append(flat_grad(arm_kl_surrogate(cfg, kl, policy, traj, mb), params))
        tokens += traj.mask[mb].sum().item()
    strength = nominal_strength(kl.mode, tokens / (len(rows) * cfg.minibatch_size), traj.mask.shape[1])
    return torch.stack(rows) / strength, strength


def nominal_strength(mode: str, mean_length: float, width: int) -> float:
    """Per-sequence strength of one unit of coefficient under aggregation ``mode``: 1 (seq-mean-token-sum),
    1 / mean_length (token-mean, seq-mean-token-mean), 1 / width (seq-mean-token-sum-norm)."""
    return {"seq-mean-token-sum": 1.0, "seq-mean-token-sum-norm": 1.0 / width}.get(mode, 1.0 / max(mean_length, 1.0))


def gradient_diagnostics(
    policy, value_model, opt, ref_policy, train_prompts, task: Task, cfg: PPOConfig, kl: K.ResolvedKL, iteration: int,
    sample: Callable, updates: Callable, train_ref=None,
) -> list[dict]:  # fmt: skip
    """The diagnostic rows (on-policy, and off-policy when the arm takes more than one update per batch) at
    ``iteration``. ``sample(policy, n, generator)`` runs steps 1-2 of the loop for n responses;
    ``updates(policy, value_model, opt, g=generator, max_steps=n)`` takes the loop's first n updates on the
    iteration's batch. ``train_ref``: the moving reference (None: the frozen one). Works on copies with its own
    generator: the run itself is unchanged. Rows against the frozen reference first (``against`` 'reference'),
    then, for a moving reference or target old_policy, against the arm's own target (``against`` 'own')."""
    d = cfg.diagnostics
    gen = torch.Generator(device=train_prompts.device).manual_seed(d.seed * 1_000_003 + iteration)
    truth_at = lambda pol, to: true_gradient(pol, to, train_prompts, task, cfg.temperature, d.n_true, gen)
    target = kl.config.target
    own = {"old_policy": copy.deepcopy(policy), "reference": train_ref}.get(target)
    own = None if own is ref_policy else own  # old_policy_forward: judged against the frozen reference only
    base = {"iteration": iteration}
    n_updates = cfg.epochs * (cfg.batch_size // cfg.minibatch_size) - 1
    regimes = [("on_policy", 0, policy)]
    if n_updates > 0:
        moved, moved_value, moved_opt = copy.deepcopy((policy, value_model, opt))
        updates(moved, moved_value, moved_opt, g=gen, max_steps=n_updates)
        regimes.append(("off_policy", n_updates, moved))
    rows = []
    for regime, n, pol in regimes:
        truth, truth_var = truth_at(pol, ref_policy)
        est, strength = arm_estimates(cfg, kl, pol, policy, sample, gen)
        row = {**base, "regime": regime, "updates": n, "strength": strength}
        rows.append({**row, "against": "reference", **compare(est, truth, truth_var)})
        if own is not None and not (regime == "on_policy" and target == "old_policy"):  # there 0 exactly
            truth, truth_var = truth_at(pol, own)
            rows.append({**row, "against": "own", **compare(est, truth, truth_var)})
    return rows
