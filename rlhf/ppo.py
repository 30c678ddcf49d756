"""PPO for RLHF with every KL variant as a named option (Ziegler et al. 2019; Huang et al. 2024).

One iteration, as in openai/lm-human-preferences `train_policy.py` and Huang et al. 2024 (arXiv 2403.17031):
    1. generate responses from the policy for a batch of prompts
    2. log-probs of the responses under the policy and the reference; values
    3. score with the proxy reward model at the last response token
    4. rewards: score at the last token, minus kl_coef * KL per token if the KL is in the reward
    5. optionally whiten rewards
    6. GAE advantages and returns, advantages whitened
    7. epochs x minibatches of clipped policy + value updates, plus kl_coef * KL if the KL is in the loss
The KL variant is chosen in ``KLConfig`` and applied only through ``rlhf.kl``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from rlhf import kl as K
from rlhf.config import PPOConfig
from rlhf.evaluate import evaluate
from rlhf.model import ScalarModel, TinyLM, generate, logprobs_from_logits, response_logits
from rlhf.reward_model import missing_eos, score
from rlhf.task import EOS, Grammar, gold_reward, response_mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over masked entries, (b, t). TRL `core.masked_whiten`; shift_mean=False keeps the mean."""
    mean = K.masked_mean(x, mask)
    var = K.masked_mean((x - mean).square(), mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), (b, t) -> advantages, returns (b, t).

        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = sum_{l >= 0} (gamma * lam)^l delta_{t+l},   R_t = A_t + V_t
    Vectorised as A = delta @ D with D[s, t] = (gamma * lam)^(s - t) for s >= t (a (t, t) upper-triangular
    discount matrix) instead of the usual reverse loop. Values past the last response token are masked to 0, so
    the last token bootstraps from 0 and every delta in the padding is 0.
    """
    values = values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # (b, t)
    deltas = (rewards + gamma * next_values - values) * mask  # (b, t)
    steps = torch.arange(rewards.shape[1], device=rewards.device, dtype=rewards.dtype)
    lag = steps[:, None] - steps[None, :]  # (t, t): s - t
    discount = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0), torch.zeros_like(lag))
    advantages = deltas @ discount  # (b, t)
    return advantages * mask, (advantages + values) * mask


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: float):
    """Clipped surrogate (Schulman et al. 2017, eq. 7) as a loss, token-mean over the mask. (b, t) -> scalars.

    Returns (loss, clipfrac, approxkl); approxkl = mean(ratio - 1 - log ratio), k3 of old vs new (CleanRL)."""
    logratio = logprobs - old_logprobs
    ratio = logratio.exp()
    losses = torch.max(-advantages * ratio, -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange))
    clipfrac = K.masked_mean(((ratio - 1.0).abs() > cliprange).float(), mask)
    approxkl = K.masked_mean(ratio - 1.0 - logratio, mask)
    return K.masked_mean(losses, mask), clipfrac.detach(), approxkl.detach()


def value_loss(values, old_values, returns, mask, cliprange_value: float) -> torch.Tensor:
    """Clipped value loss (lm-human-preferences): 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    return 0.5 * K.masked_mean(torch.max((values - returns).square(), (clipped - returns).square()), mask)


def check_finite(name: str, x: torch.Tensor, iteration: int) -> None:
    if not torch.isfinite(x).all():
        raise FloatingPointError(f"non-finite {name} at PPO iteration {iteration}")


def response_values(value_model: ScalarModel, prompts, responses) -> torch.Tensor:
    """V(state before each response token): (b, t), read at positions p-1 .. p+t-2 (TRL convention)."""
    return value_model(torch.cat([prompts, responses], dim=1))[:, prompts.shape[1] - 1 : -1]


def advantages_and_returns(scores, kl_reward, kl_coef, values, mask, cfg: PPOConfig):
    """Steps 4-6: rewards (score at the last token, KL penalty if in the reward), optional whitening, GAE."""
    rewards = K.reward_penalty(kl_reward, kl_coef, mask) if kl_reward is not None else torch.zeros_like(values)
    rewards = rewards.scatter_add(1, (mask.sum(1).long() - 1)[:, None], scores[:, None])  # (b, t)
    if cfg.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
    return rewards, masked_whiten(advantages, mask) * mask, returns


def train_ppo(
    policy: TinyLM,
    ref_policy: TinyLM,
    reward_model: ScalarModel,
    grammar: Grammar,
    train_prompts: torch.Tensor,
    eval_prompts: torch.Tensor,
    cfg: PPOConfig,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Runs PPO in place on ``policy``. Returns {"history": per-iteration dicts, "evals": held-out measurements
    every ``eval_every`` iterations (and at 0 and the end), "summary": the final measurement}."""
    kc = cfg.kl
    device = train_prompts.device
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    value_model = copy.deepcopy(reward_model)  # value model initialised from the reward model (Huang et al.)
    params = list(policy.parameters()) + list(value_model.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr, eps=1e-5)
    ctl = (
        K.FixedKLController(kc.coef)
        if kc.adaptive_target is None
        else K.AdaptiveKLController(kc.coef, kc.adaptive_target, kc.horizon)
    )
    in_reward, in_loss = kc.placement in ("reward", "both"), kc.placement in ("loss", "both")
    measure = lambda it: {
        "iteration": it,
        **evaluate(policy, ref_policy, reward_model, grammar, eval_prompts, cfg.temperature, cfg.eval_seed),
    }
    history, evals = [], [measure(0)]
    n_mb = cfg.batch_size // cfg.minibatch_size

    for it in range(1, cfg.iterations + 1):
        kl_coef = ctl.value
        # 1. generate
        prompts = train_prompts[torch.randint(0, len(train_prompts), (cfg.batch_size,), generator=g, device=device)]
        responses = generate(policy, prompts, grammar.max_new_tokens, cfg.temperature, g, EOS)  # (b, t)
        mask = response_mask(responses)  # (b, t)
        with torch.no_grad():
            # 2. log-probs under the policy (old, rollout-time) and the reference; values
            logits = response_logits(policy, prompts, responses, cfg.temperature)  # (b, t, V)
            logprobs = logprobs_from_logits(logits, responses)  # (b, t)
            ref_logits = response_logits(ref_policy, prompts, responses, cfg.temperature)
            ref_logprobs = logprobs_from_logits(ref_logits, responses)
            values = response_values(value_model, prompts, responses) * mask  # (b, t)
            # 3. score at the last response token (a fixed score for a response without EOS, if configured)
            scores = missing_eos(score(reward_model, prompts, responses), responses, cfg.missing_eos_score)  # (b,)
            check_finite("scores", scores, it)
            if kc.target == "reference":
                target_logits, target_logprobs = ref_logits, ref_logprobs
            else:  # old_policy: the rollout-time policy (lucidrains/PaLM-rlhf-pytorch)
                target_logits, target_logprobs = logits, logprobs
            kl_rollout = None
            if kc.estimator is not None:
                kl_rollout = K.kl_per_token(kc.estimator, logprobs, target_logprobs, logits, target_logits) * mask
            # 4-6. rewards (KL if in reward), whitening, GAE
            kl_reward = kl_rollout if in_reward else None
            rewards, advantages, returns = advantages_and_returns(scores, kl_reward, kl_coef, values, mask, cfg)
            check_finite("rewards", rewards, it)

        # 7. epochs of clipped updates (KL if in loss)
        stats = {"pg_loss": 0.0, "vf_loss": 0.0, "clipfrac": 0.0, "approxkl": 0.0, "kl_loss": 0.0}
        kl_reward_used = kl_reward.sum(1).mean().item() if kl_reward is not None else 0.0
        for epoch in range(cfg.epochs):
            if in_reward and kc.target == "old_policy" and epoch > 0:
                # KL to the rollout policy is 0 at rollout; as PaLM-rlhf-pytorch 0.2 it is re-measured with the
                # current policy and subtracted from the rewards before each later epoch (GAE re-run).
                with torch.no_grad():
                    cur_logits = response_logits(policy, prompts, responses, cfg.temperature)
                    kl_reward = (
                        K.kl_per_token(
                            kc.estimator, logprobs_from_logits(cur_logits, responses), logprobs, cur_logits, logits
                        )
                        * mask
                    )
                    rewards, advantages, returns = advantages_and_returns(scores, kl_reward, kl_coef, values, mask, cfg)
                    kl_reward_used = kl_reward.sum(1).mean().item()
            perm = torch.randperm(cfg.batch_size, generator=g, device=device)
            for mb in perm.view(n_mb, cfg.minibatch_size):
                new_logits = response_logits(policy, prompts[mb], responses[mb], cfg.temperature)
                new_logprobs = logprobs_from_logits(new_logits, responses[mb])
                pg_loss, clipfrac, approxkl = policy_loss(
                    new_logprobs, logprobs[mb], advantages[mb], mask[mb], cfg.cliprange
                )
                new_values = response_values(value_model, prompts[mb], responses[mb])
                vf_loss = value_loss(new_values, values[mb], returns[mb], mask[mb], cfg.cliprange_value)
                loss = pg_loss + cfg.vf_coef * vf_loss
                if in_loss:
                    kl_tok = K.kl_per_token(
                        kc.estimator, new_logprobs, target_logprobs[mb], new_logits, target_logits[mb]
                    )
                    kl_term = K.loss_penalty(kl_tok, kl_coef, mask[mb])
                    loss = loss + kl_term
                    stats["kl_loss"] += K.masked_mean(kl_tok, mask[mb]).item() / (cfg.epochs * n_mb)
                check_finite("loss", loss, it)
                opt.zero_grad()
                loss.backward()
                opt.step()
                for k, v in (
                    ("pg_loss", pg_loss),
                    ("vf_loss", vf_loss),
                    ("clipfrac", clipfrac),
                    ("approxkl", approxkl),
                ):
                    stats[k] += v.item() / (cfg.epochs * n_mb)

        # Adaptive controller: fed the batch mean of the per-sequence summed estimator vs the reference.
        if kl_rollout is not None:
            ctl.update(kl_rollout.sum(1).mean().item(), cfg.batch_size)
        row = {
            "iteration": it,
            "kl_coef": kl_coef,
            "kl_reward": kl_reward_used,
            **stats,
            "score": scores.mean().item(),
            "gold_train": gold_reward(grammar, prompts, responses).mean().item(),
            "length": mask.sum(1).mean().item(),
        }
        history.append(row)
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            evals.append(measure(it))
        if progress is not None:
            progress(row)
    return {"history": history, "evals": evals, "summary": final_summary(evals)}


def final_summary(evals: list[dict]) -> dict:
    """The last held-out measurement plus sqrt(KL), and the gold peak along the way (reported, never selected)."""
    last = evals[-1]
    peak = max(evals, key=lambda e: e["gold"])
    return {
        **{f"final_{k}": v for k, v in last.items() if k != "iteration"},
        "final_sqrt_kl": math.sqrt(max(last["kl"], 0.0)),
        "peak_gold": peak["gold"],
        "peak_gold_iteration": peak["iteration"],
    }
