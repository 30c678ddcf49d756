"""PPO for RLHF and its critic-free relatives (GRPO, RLOO, REINFORCE++), with every KL variant as a named option.

One iteration of ``train_ppo``, as in openai/lm-human-preferences `train_policy.py` and Huang et al. 2024
(arXiv 2403.17031):
    1. generate responses from the policy (group_size per prompt)
    2. log-probs under the policy (old, rollout-time) and the reference; exact KL to the reference; values
    3. score: the proxy reward model at the last response token (RLHF), or the task's verifier (RLVR)
    4. rewards: score at the last token, minus the reward-side KL per token (computed once per rollout)
    5. optionally whiten rewards
    6. advantages: the algorithm's one advantage function (``rlhf.algorithms``)
    7. epochs x minibatches of clipped policy updates (+ value loss with a critic), plus the loss-side KL
    8. coefficient controller fed with step 2's exact KL; moving reference; held-out evaluation
How KL enters training is decided only in ``rlhf.kl``, the advantages only in ``rlhf.algorithms``.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from rlhf import kl as K
from rlhf.algorithms import ALGORITHMS, AdvantageParams, masked_whiten
from rlhf.config import PPOConfig
from rlhf.diagnostics import gradient_diagnostics
from rlhf.evaluate import evaluate
from rlhf.model import ScalarModel, TinyLM, adam, generate, logprobs_from_logits, response_logits
from rlhf.reward_model import init_reward_model, missing_eos, score
from rlhf.task import EOS, Task, response_mask


class Trajectory(NamedTuple):
    """One rollout (torchtune's ``Trajectory`` is the model). Logits are temperature-scaled."""

    prompts: torch.Tensor  # (b, p)
    responses: torch.Tensor  # (b, t)
    mask: torch.Tensor  # (b, t) 1 up to and including EOS
    logits: torch.Tensor  # (b, t, V) rollout policy pi_old (needed by the 'full' estimator)
    logprobs: torch.Tensor  # (b, t)
    ref_logits: torch.Tensor  # (b, t, V) the training reference (a moving copy with ref_sync_every)
    ref_logprobs: torch.Tensor  # (b, t)
    kl_to_ref: torch.Tensor  # (b,) exact sum_t KL(pi_old || pi_ref) to the frozen SFT reference
    values: torch.Tensor | None  # (b, t) critic's values; None without a critic
    scores: torch.Tensor | None  # (b,) proxy reward or verifier, set at step 3


class Batch(NamedTuple):
    """Steps 4-6 on a trajectory."""

    kl_reward: torch.Tensor | None  # (b, t) reward-side KL per unit coefficient; None without one
    rewards: torch.Tensor  # (b, t)
    advantages: torch.Tensor  # (b, t)
    returns: torch.Tensor | None  # (b, t) value targets; None without a critic


def policy_loss(
    logprobs, old_logprobs, advantages, mask, cliprange: float, cliprange_high: float | None = None,
    dual_clip: float | None = None, ratio_level: str = "token", mode: str = "token-mean",
):  # fmt: skip
    """Clipped surrogate (Schulman et al. 2017, eq. 7) as a loss, aggregated over the mask (token-mean by default,
    ``mode``: ``kl.aggregate``). (b, t) -> scalars. Options, off by default:
        cliprange_high   ratio clipped to [1 - cliprange, 1 + cliprange_high] (DAPO clip-higher, arXiv 2503.14476
                         eq. 10; verl ``clip_ratio_low/high``)
        dual_clip = c    for A < 0 the loss is also capped at -c A: min(max(-A r, -A clip(r)), -c A) (Ye et al.
                         2020, arXiv 1912.09729 eq. 5; verl ``clip_ratio_c`` 3)
        ratio_level 'sequence'  GSPO (arXiv 2507.18071 eq. 7, GSPO-token eq. 13): the ratio of every token of
                         response b is s_b = exp(sum_t m (log pi - log pi_old) / L_b), with per-token gradient
                         sg(s_b) * pi_t / sg(pi_t), clipped as a whole
    Returns (loss, clipfrac, approxkl); approxkl = mean(ratio - 1 - log ratio), k3 of old vs new (CleanRL)."""
    logratio = logprobs - old_logprobs
    if ratio_level == "sequence":  # (b, t): sg(s_b) pi_t / sg(pi_t)
        seq = ((logratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)).detach()
        logratio = seq + logprobs - logprobs.detach()
    ratio = logratio.exp()
    high = cliprange if cliprange_high is None else cliprange_high
    losses = torch.max(-advantages * ratio, -advantages * ratio.clamp(1.0 - cliprange, 1.0 + high))
    if dual_clip is not None:
        losses = torch.where(advantages < 0, torch.min(losses, -dual_clip * advantages), losses)
    clipfrac = K.masked_mean(((ratio < 1.0 - cliprange) | (ratio > 1.0 + high)).float(), mask)
    if cliprange_high is None:  # today's expression, bit for bit
        clipfrac = K.masked_mean(((ratio - 1.0).abs() > cliprange).float(), mask)
    approxkl = K.masked_mean(ratio - 1.0 - logratio, mask)
    return K.aggregate(losses, mask, mode), clipfrac.detach(), approxkl.detach()


def value_loss(values, old_values, returns, mask, cliprange_value: float) -> torch.Tensor:
    """Clipped value loss (lm-human-preferences): 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    return 0.5 * K.masked_mean(torch.max((values - returns).square(), (clipped - returns).square()), mask)


def check_finite(name: str, x: torch.Tensor, iteration: int) -> None:
    if not torch.isfinite(x).all():
        raise FloatingPointError(f"non-finite {name} at PPO iteration {iteration}")


def response_values(value_model: ScalarModel, prompts, responses) -> torch.Tensor:
    """V(state before each response token): (b, t), read at positions p-1 .. p+t-2 (TRL convention); the last
    response token is not fed, and only these positions are computed (``ScalarModel``'s ``first``)."""
    return value_model(torch.cat([prompts, responses[:, :-1]], dim=1), first=prompts.shape[1] - 1)


def draw_prompts(train_prompts: torch.Tensor, n: int, group_size: int, g: torch.Generator) -> torch.Tensor:
    """n / group_size prompts drawn uniformly with replacement, each repeated group_size times in consecutive rows
    (the groups of GRPO and RLOO): (n, p)."""
    idx = torch.randint(0, len(train_prompts), (n // group_size,), generator=g, device=train_prompts.device)
    return train_prompts[idx.repeat_interleave(group_size)]


@torch.no_grad()
def rollout(policy, ref_policy, train_ref, value_model, prompts, task: Task, temperature: float, g):
    """Steps 1-2: sample responses to ``prompts`` (b, p), log-probs under the policy and the training reference,
    the exact KL to the frozen reference ``ref_policy``, values. -> Trajectory without scores."""
    responses = generate(policy, prompts, task.max_new_tokens, temperature, g, EOS)  # (b, t)
    return trajectory(policy, ref_policy, train_ref, value_model, prompts, responses, temperature)


def trajectory(policy, ref_policy, train_ref, value_model, prompts, responses, temperature: float) -> Trajectory:
    """Step 2 of ``rollout`` on sampled ``responses`` (b, t) to ``prompts`` (b, p), without scores (also the step
    of every cell of ``rlhf.population``, under ``torch.func.vmap``)."""
    mask = response_mask(responses)  # (b, t)
    logits = response_logits(policy, prompts, responses, temperature)  # (b, t, V)
    logprobs = logprobs_from_logits(logits, responses)  # (b, t)
    ref_logits = response_logits(train_ref, prompts, responses, temperature)
    ref_logprobs = logprobs_from_logits(ref_logits, responses)
    frozen_logits = (
        ref_logits if train_ref is ref_policy else response_logits(ref_policy, prompts, responses, temperature)
    )
    kl_to_ref = K.sequence_kl(logits, frozen_logits, mask)  # (b,)
    values = None if value_model is None else response_values(value_model, prompts, responses) * mask
    return Trajectory(prompts, responses, mask, logits, logprobs, ref_logits, ref_logprobs, kl_to_ref, values, None)


def rewards_and_advantages(traj: Trajectory, kl_reward, kl_coef: float, cfg: PPOConfig) -> Batch:
    """Steps 4-6: rewards (score at the last token, minus the reward-side KL ``kl_reward``, None when the arm has no
    reward side), optional whitening, advantages."""
    mask = traj.mask
    rewards = K.reward_penalty(kl_reward, kl_coef, mask) if kl_reward is not None else torch.zeros_like(mask)
    rewards = rewards.scatter_add(1, (mask.sum(1).long() - 1)[:, None], traj.scores[:, None])  # (b, t)
    if cfg.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    params = AdvantageParams(cfg.gamma, cfg.lam, cfg.group_size, normalize=True, group_std=not cfg.dr_grpo)
    advantages, returns = ALGORITHMS[cfg.algorithm].advantages(rewards, traj.values, mask, params)
    return Batch(kl_reward, rewards, advantages, returns)


def step_kl_reward(traj: Trajectory, logprobs, logits, kl: K.ResolvedKL):
    """The reward-side KL of ``traj`` with the policy side given by ``logprobs``/``logits`` (the rollout's at step 4;
    the current policy's when ``kl.remeasured``); None when the arm has no reward side."""
    return None if kl.reward_kl is None else kl.reward_kl(traj, logprobs, logits)


def minibatch_loss(policy, value_model, traj: Trajectory, batch: Batch, mb, kl_coef, cfg: PPOConfig, kl: K.ResolvedKL):
    """The loss of one minibatch ``mb`` (indices): clipped policy loss, value loss with a critic, loss-side KL at
    ``kl_coef``. Returns (loss, stats of tensors)."""
    mask = traj.mask[mb]
    new_logits = response_logits(policy, traj.prompts[mb], traj.responses[mb], cfg.temperature)
    new_logprobs = logprobs_from_logits(new_logits, traj.responses[mb])
    pg_loss, clipfrac, approxkl = policy_loss(
        new_logprobs, traj.logprobs[mb], batch.advantages[mb], mask, cfg.cliprange, cfg.cliprange_high,
        cfg.dual_clip, cfg.ratio_level, cfg.pg_mode,
    )  # fmt: skip
    stats = {"pg_loss": pg_loss, "clipfrac": clipfrac, "approxkl": approxkl}
    loss = pg_loss
    if cfg.entropy_coef is not None:  # fixed entropy bonus (Schulman et al. 2017, eq. 9): loss -= c * H
        stats["entropy"] = K.aggregate(K.entropy(new_logits), mask, cfg.pg_mode)
        loss = loss - cfg.entropy_coef * stats["entropy"]
        stats["entropy"] = stats["entropy"].detach()
    if value_model is not None:
        new_values = response_values(value_model, traj.prompts[mb], traj.responses[mb])
        stats["vf_loss"] = value_loss(new_values, traj.values[mb], batch.returns[mb], mask, cfg.cliprange_value)
        loss = loss + cfg.vf_coef * stats["vf_loss"]
    if kl.loss_kl is not None:
        terms = kl.loss_kl(traj, mb, new_logprobs, new_logits)
        loss = loss + K.loss_penalty(terms, kl_coef, mask, kl.mode)
        stats["kl_loss"] = K.aggregate(terms.detach(), mask, kl.mode)
    return loss, stats


def update(policy, value_model, opt, traj, batch: Batch, kl_coef, cfg: PPOConfig, kl, g, it, max_steps=None):
    """Step 7: epochs x minibatches of updates on one batch. Returns (per-iteration means of the minibatch stats,
    the batch last used: re-made before each later epoch when ``kl.remeasured``). ``max_steps`` stops after
    that many updates (gradient diagnostics)."""
    n_mb = cfg.batch_size // cfg.minibatch_size
    stats = {"pg_loss": 0.0, "vf_loss": 0.0, "clipfrac": 0.0, "approxkl": 0.0, "kl_loss": 0.0}
    if value_model is None:
        del stats["vf_loss"]
    if cfg.entropy_coef is not None:
        stats["entropy"] = 0.0
    steps = 0
    for epoch in range(cfg.epochs):
        if epoch > 0 and kl.remeasured:
            with torch.no_grad():
                cur_logits = response_logits(policy, traj.prompts, traj.responses, cfg.temperature)
                kl_reward = step_kl_reward(traj, logprobs_from_logits(cur_logits, traj.responses), cur_logits, kl)
                batch = rewards_and_advantages(traj, kl_reward, kl_coef, cfg)
        perm = torch.randperm(cfg.batch_size, generator=g, device=traj.mask.device)
        for mb in perm.view(n_mb, cfg.minibatch_size):
            if max_steps is not None and steps == max_steps:
                return stats, batch
            loss, mb_stats = minibatch_loss(policy, value_model, traj, batch, mb, kl_coef, cfg, kl)
            check_finite("loss", loss, it)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            for k, v in mb_stats.items():
                stats[k] += v.item() / (cfg.epochs * n_mb)
    return stats, batch


def scorer(reward_model: ScalarModel | None, task: Task, missing_eos_score: float | None):
    """Step 3's score of (prompts (b, p), responses (b, t)) -> (b,): the proxy reward model at the last response
    token, with the missing-EOS score if configured (Huang et al. 2024), for a learned-reward task; the task's own
    verifier (``task.gold``) for a verifier task, which already judges a response without EOS."""
    if task.reward == "verifier":
        return task.gold
    return lambda prompts, responses: missing_eos(score(reward_model, prompts, responses), responses, missing_eos_score)


def train_ppo(
    policy: TinyLM,
    ref_policy: TinyLM,
    reward_model: ScalarModel | None,
    task: Task,
    train_prompts: torch.Tensor,
    eval_sets: dict[str, torch.Tensor] | torch.Tensor,
    cfg: PPOConfig,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Runs ``cfg.algorithm`` in place on ``policy``. ``reward_model``: the proxy of a learned-reward task (None for
    a verifier task); ``eval_sets``: held-out prompts by name ({"": in-domain, "ood": ...}, rlhf.evaluate; a tensor
    is the in-domain set alone).
    Returns {"history": per-iteration dicts, "evals": held-out measurements every ``eval_every`` iterations (and at
    0 and the end), "summary": the final measurement, "diagnostics": gradient-diagnostic rows (empty unless
    ``cfg.diagnostics``)}."""
    if (task.reward == "learned") != (reward_model is not None):
        need = "a reward model" if task.reward == "learned" else "no reward model"
        raise ValueError(f"a task with a {task.reward!r} reward needs {need}")
    eval_sets = eval_sets if isinstance(eval_sets, dict) else {"": eval_sets}
    kl = K.resolve(cfg.kl, cfg.pg_mode)  # the only reading of cfg.kl: both sides, once per run
    device = train_prompts.device
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    critic = ALGORITHMS[cfg.algorithm].critic
    # value model initialised from the reward model (Huang et al.), or from the SFT backbone with a new head
    value_model = None
    if critic:
        value_model = copy.deepcopy(reward_model) if reward_model is not None else init_reward_model(ref_policy)
    score_fn = scorer(reward_model, task, cfg.missing_eos_score)
    params = list(policy.parameters()) + (list(value_model.parameters()) if critic else [])
    opt = adam(params, lr=cfg.lr, eps=cfg.adam_eps)
    ctl = kl.controller()
    train_ref = copy.deepcopy(ref_policy) if kl.moving_reference else ref_policy
    measure = lambda it: {
        "iteration": it,
        **evaluate(policy, ref_policy, reward_model, task, eval_sets, cfg.temperature, cfg.eval_seed),
    }
    history, evals, diagnostics = [], [measure(0)], []

    def sample(pol, n, gen):  # steps 1-2 for n responses of ``pol``, for the gradient diagnostics
        prompts = draw_prompts(train_prompts, n, cfg.group_size, gen)
        return rollout(pol, ref_policy, train_ref, None, prompts, task, cfg.temperature, gen)

    for it in range(1, cfg.iterations + 1):
        kl_coef = ctl.value
        # 1-2. generate; log-probs under the policy (old) and the reference, exact KL to the reference; values
        prompts = draw_prompts(train_prompts, cfg.batch_size, cfg.group_size, g)
        traj = rollout(policy, ref_policy, train_ref, value_model, prompts, task, cfg.temperature, g)
        # 3. score: proxy at the last response token (missing-EOS score if configured), or the verifier
        scores = score_fn(traj.prompts, traj.responses)  # (b,)
        check_finite("scores", scores, it)
        traj = traj._replace(scores=scores)
        # 4-6. rewards (reward-side KL, computed once here), whitening, advantages of the algorithm
        with torch.no_grad():
            kl_reward = step_kl_reward(traj, traj.logprobs, traj.logits, kl)
            batch = rewards_and_advantages(traj, kl_reward, kl_coef, cfg)
        check_finite("rewards", batch.rewards, it)
        # gradient diagnostics, on copies with their own generator; a run without KL has no KL gradient to judge
        if cfg.diagnostics is not None and kl.on and it in cfg.diagnostics.at:
            updates = functools.partial(update, traj=traj, batch=batch, kl_coef=kl_coef, cfg=cfg, kl=kl, it=it)
            diagnostics += gradient_diagnostics(
                policy, value_model, opt, ref_policy, train_prompts, task, cfg, kl, it, sample, updates, train_ref
            )
        # 7. epochs x minibatches of clipped updates (loss-side KL)
        stats, batch = update(policy, value_model, opt, traj, batch, kl_coef, cfg, kl, g, it)
        # 8. controller on the exact KL of step 2; moving reference; evaluation
        ctl.update(traj.kl_to_ref.mean().item(), cfg.batch_size)
        kl.sync_reference_due(train_ref, policy, it)
        kl_used = batch.kl_reward.sum(1).mean().item() if batch.kl_reward is not None else 0.0
        row = {
            "iteration": it,
            "kl_coef": kl_coef,
            "kl_reward": kl_used,
            **stats,
            "kl_exact": traj.kl_to_ref.mean().item(),
            "score": scores.mean().item(),
            "gold_train": task.gold(traj.prompts, traj.responses).mean().item(),
            "length": traj.mask.sum(1).mean().item(),
        }
        history.append(row)
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            evals.append(measure(it))
        if progress is not None:
            progress(row)
    return {"history": history, "evals": evals, "summary": final_summary(evals), "diagnostics": diagnostics}


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
