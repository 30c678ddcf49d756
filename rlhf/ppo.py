"""PPO for RLHF and its critic-free relatives (GRPO, RLOO, REINFORCE++), with every KL variant as a named option.

One iteration of the training loop ``train``, as in openai/lm-human-preferences `train_policy.py` and Huang et al.
2024 (arXiv 2403.17031):
    1. generate responses from the policy (group_size per prompt)
    2. log-probs under the policy (old, rollout-time) and the reference; exact KL to the reference; values
    3. score: the proxy reward model at the last response token (RLHF), or the task's verifier (RLVR)
    4. rewards: score at the last token, minus the reward-side KL per token (computed once per rollout)
    5. optionally whiten rewards
    6. advantages: the algorithm's one advantage function (``rlhf.algorithms``)
    7. epochs x minibatches of clipped policy updates (+ value loss with a critic), plus the loss-side KL
    8. coefficient controller fed with step 2's exact KL; moving reference; held-out evaluation
How KL enters training is decided only in ``rlhf.kl``, the advantages only in ``rlhf.algorithms``.

``train`` is the one loop: it drives one cell (``Cell``, for ``train_ppo``) or a population of B cells trained as
one batched computation (``rlhf.population.Population``) through the same steps (``Cells``), and writes every
iteration's record (``Stats``) in one place.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

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


def rollout_batch(traj: Trajectory, kl_coef, cfg: PPOConfig, kl: K.ResolvedKL) -> Batch:
    """Steps 4-6 on a scored rollout: ``rewards_and_advantages`` with the reward-side KL of the rollout policy,
    computed once here (a later epoch re-makes the batch in ``update`` when ``kl.remeasured``)."""
    return rewards_and_advantages(traj, step_kl_reward(traj, traj.logprobs, traj.logits, kl), kl_coef, cfg)


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


class Stats(NamedTuple):
    """One row of ``history``: the per-iteration record of both training paths (``train_ppo``, and each cell of
    ``rlhf.population``), its fields in this order; a None field is not in the row (``row``)."""

    iteration: int
    kl_coef: float  # the coefficient used in this iteration (the controller's value before step 8)
    kl_reward: float  # mean over responses of sum_t of the reward-side KL per unit coefficient (0.0 without)
    pg_loss: float  # step 7's stats: means over epochs x minibatches (``update``) ...
    vf_loss: float | None  # ... None without a critic
    clipfrac: float
    approxkl: float
    kl_loss: float  # the loss-side KL term (0.0 without one)
    entropy: float | None  # None without an entropy bonus
    kl_exact: float  # mean exact sum_t KL(pi_old || pi_ref) of the rollout (what the controller is fed)
    score: float  # mean step-3 score
    gold_train: float  # mean gold reward of the rollout
    length: float  # mean response length (EOS included)

    def row(self) -> dict:
        return {k: v for k, v in self._asdict().items() if v is not None}


UPDATE_STATS = Stats._fields[Stats._fields.index("pg_loss") : Stats._fields.index("kl_exact")]


def update_stats(cfg: PPOConfig, critic: bool) -> dict[str, float]:
    """Step 7's stats of ``cfg``'s run, in ``Stats`` order, at 0.0: vf_loss with a critic, entropy with a bonus."""
    off = {k for k, on in (("vf_loss", critic), ("entropy", cfg.entropy_coef is not None)) if not on}
    return {k: 0.0 for k in UPDATE_STATS if k not in off}


def update(policy, value_model, opt, traj, batch: Batch, kl_coef, cfg: PPOConfig, kl, g, it, max_steps=None):
    """Step 7: epochs x minibatches of updates on one batch. Returns (per-iteration means of the minibatch stats,
    the batch last used: re-made before each later epoch when ``kl.remeasured``). ``max_steps`` stops after
    that many updates (gradient diagnostics)."""
    n_mb = cfg.batch_size // cfg.minibatch_size
    stats = update_stats(cfg, value_model is not None)
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
            accumulate(stats, mb_stats, cfg.epochs * n_mb, lambda v: v.item())
    return stats, batch


def accumulate(stats: dict, mb_stats: dict, n: int, value: Callable) -> None:
    """stats[k] += value(mb_stats[k]) / n: the running mean of the minibatch stats over the n minibatches of an
    iteration (``value``: a Python float, or a float64 tensor (B,) in a population: the same rounding)."""
    for k, v in mb_stats.items():
        stats[k] += value(v) / n


def scorer(reward_model: ScalarModel | None, task: Task, missing_eos_score: float | None):
    """Step 3's score of (prompts (b, p), responses (b, t)) -> (b,): the proxy reward model at the last response
    token, with the missing-EOS score if configured (Huang et al. 2024), for a learned-reward task; the task's own
    verifier (``task.gold``) for a verifier task, which already judges a response without EOS."""
    if task.reward == "verifier":
        return task.gold
    return lambda prompts, responses: missing_eos(score(reward_model, prompts, responses), responses, missing_eos_score)


class Cells(Protocol):
    """What ``train`` needs of the cells it trains: one (``Cell``, for ``train_ppo``) or B at once as one batched
    computation (``rlhf.population.Population``). A trajectory's and a batch's tensors carry the cells' leading
    dim B in a population (none for one cell); a list holds one entry per cell; ``coefs``: each cell's KL
    coefficient this iteration."""

    cfg: PPOConfig  # the structure every cell shares (a population's cells differ in seed and KL strength only)
    kl: K.ResolvedKL  # cfg.kl resolved once per run (``rlhf.kl.resolve``)
    controllers: list  # each cell's coefficient controller

    def rollout(self, it: int) -> Trajectory: ...  # steps 1-3: prompts, responses, log-probs, KL, values, scores
    def advantages(self, traj: Trajectory, coefs: list[float]) -> Batch: ...  # steps 4-6
    def diagnose(self, traj: Trajectory, batch: Batch, coefs: list[float], it: int) -> list[dict]: ...
    def update(self, traj, batch: Batch, coefs: list[float], it: int) -> tuple[list[dict], Batch]: ...  # step 7
    def sync_reference(self, it: int) -> None: ...  # step 8's moving reference
    def per_cell(self, fn: Callable, x: torch.Tensor) -> list[float]: ...  # fn over each cell's own dims
    def gold(self, traj: Trajectory) -> list[float]: ...  # each cell's mean gold reward of the rollout
    def evaluate(self, it: int) -> list[dict]: ...  # rlhf.evaluate of each cell, {"iteration": it, ...}


def train(cells: Cells, initial_evals: list[dict | None], progress: Callable[[int, list[dict]], None] | None = None):
    """The training loop (module docstring, steps 1-8) of ``cells``, the one loop of ``train_ppo`` and of
    ``rlhf.population``. ``initial_evals``: each cell's iteration-0 measurement when already made (the SFT
    policy's, ``rlhf.evaluate``), None where ``cells`` must measure it. Returns (histories, evals, diagnostics):
    per cell its ``Stats`` rows and its measurements every ``eval_every`` iterations (and at 0 and the end);
    gradient-diagnostic rows (one cell only). ``progress(it, rows)`` after each iteration."""
    cfg, kl = cells.cfg, cells.kl
    if any(e is None for e in initial_evals):
        initial_evals = [m if e is None else e for e, m in zip(initial_evals, cells.evaluate(0))]
    evals, histories, diagnostics = [[dict(e)] for e in initial_evals], [[] for _ in initial_evals], []
    for it in range(1, cfg.iterations + 1):
        coefs = [ctl.value for ctl in cells.controllers]
        # 1-3. generate; log-probs under the policy (old) and the reference, exact KL to the reference; values;
        # score: proxy at the last response token (missing-EOS score if configured), or the verifier
        traj = cells.rollout(it)
        check_finite("scores", traj.scores, it)
        # 4-6. rewards (reward-side KL, computed once here), whitening, advantages of the algorithm
        batch = cells.advantages(traj, coefs)
        check_finite("rewards", batch.rewards, it)
        # gradient diagnostics, on copies with their own generator; a run without KL has no KL gradient to judge
        if cfg.diagnostics is not None and kl.on and it in cfg.diagnostics.at:
            diagnostics += cells.diagnose(traj, batch, coefs, it)
        # 7. epochs x minibatches of clipped updates (loss-side KL)
        stats, batch = cells.update(traj, batch, coefs, it)
        # 8. controller on the exact KL of step 2; moving reference; evaluation
        kl_exact = cells.per_cell(torch.mean, traj.kl_to_ref)
        for ctl, value in zip(cells.controllers, kl_exact):
            ctl.update(value, cfg.batch_size)
        cells.sync_reference(it)
        rows = [r.row() for r in records(cells, it, coefs, stats, traj, batch, kl_exact)]
        for h, row in zip(histories, rows):
            h.append(row)
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            for e, row in zip(evals, cells.evaluate(it)):
                e.append(row)
        if progress is not None:
            progress(it, rows)
    return histories, evals, diagnostics


class Cell:
    """One cell's models, optimiser, generator and controller, as ``train`` drives them (``Cells``; its tensors
    have no cell dim). Set up in ``train_ppo``'s order: the run's generator and the global seed, then a value model
    (its new head is drawn from the global generator), the optimiser, the controller."""

    def __init__(self, policy, ref_policy, reward_model, task: Task, train_prompts, eval_sets: dict, cfg: PPOConfig):
        if (task.reward == "learned") != (reward_model is not None):
            need = "a reward model" if task.reward == "learned" else "no reward model"
            raise ValueError(f"a task with a {task.reward!r} reward needs {need}")
        self.policy, self.ref_policy, self.reward_model, self.task = policy, ref_policy, reward_model, task
        self.train_prompts, self.eval_sets, self.cfg = train_prompts, eval_sets, cfg
        self.kl = K.resolve(cfg.kl, cfg.pg_mode)  # the only reading of cfg.kl: both sides, once per run
        self.g = torch.Generator(device=train_prompts.device).manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        # value model initialised from the reward model (Huang et al.), or from the SFT backbone with a new head
        self.value_model = None
        if ALGORITHMS[cfg.algorithm].critic:
            self.value_model = (
                copy.deepcopy(reward_model) if reward_model is not None else init_reward_model(ref_policy)
            )
        self.score = scorer(reward_model, task, cfg.missing_eos_score)
        params = list(policy.parameters()) + (list(self.value_model.parameters()) if self.value_model else [])
        self.opt = adam(params, lr=cfg.lr, eps=cfg.adam_eps)
        self.controllers = [self.kl.controller()]
        self.train_ref = copy.deepcopy(ref_policy) if self.kl.moving_reference else ref_policy

    # Steps 1-6 run under inference mode: nothing there is differentiated (the reward model's and the reference's
    # parameters require grad, so plain autograd would record their graphs), and the losses of step 7 read the
    # trajectory and the batch only through minibatch indexing, which makes ordinary tensors of them.
    @torch.inference_mode()
    def rollout(self, it: int) -> Trajectory:
        prompts = draw_prompts(self.train_prompts, self.cfg.batch_size, self.cfg.group_size, self.g)
        traj = self.sample(self.policy, prompts, self.g, self.value_model)
        return traj._replace(scores=self.score(traj.prompts, traj.responses))  # (b,)

    def sample(self, policy, prompts, g, value_model=None) -> Trajectory:
        """Steps 1-2 (``rollout``) of ``policy`` on ``prompts`` with generator ``g``."""
        return rollout(
            policy, self.ref_policy, self.train_ref, value_model, prompts, self.task, self.cfg.temperature, g
        )

    @torch.inference_mode()
    def advantages(self, traj: Trajectory, coefs: list[float]) -> Batch:
        return rollout_batch(traj, coefs[0], self.cfg, self.kl)

    def diagnose(self, traj: Trajectory, batch: Batch, coefs: list[float], it: int) -> list[dict]:
        cfg, kl = self.cfg, self.kl
        updates = functools.partial(update, traj=traj, batch=batch, kl_coef=coefs[0], cfg=cfg, kl=kl, it=it)
        sample = lambda pol, n, gen: self.sample(pol, draw_prompts(self.train_prompts, n, cfg.group_size, gen), gen)
        return gradient_diagnostics(
            self.policy, self.value_model, self.opt, self.ref_policy, self.train_prompts, self.task, cfg, kl, it,
            sample, updates, self.train_ref,
        )  # fmt: skip

    def update(self, traj: Trajectory, batch: Batch, coefs: list[float], it: int) -> tuple[list[dict], Batch]:
        stats, batch = update(self.policy, self.value_model, self.opt, traj, batch, coefs[0], self.cfg, self.kl,
                              self.g, it)  # fmt: skip
        return [stats], batch

    def sync_reference(self, it: int) -> None:
        self.kl.sync_reference_due(self.train_ref, self.policy, it)

    def per_cell(self, fn: Callable, x: torch.Tensor) -> list[float]:
        return [fn(x).item()]

    def gold(self, traj: Trajectory) -> list[float]:
        return [self.task.gold(traj.prompts, traj.responses).mean().item()]

    def evaluate(self, it: int) -> list[dict]:
        t, s = self.cfg.temperature, self.cfg.eval_seed
        return [{"iteration": it, **evaluate(self.policy, self.ref_policy, self.reward_model, self.task,
                                             self.eval_sets, t, s)}]  # fmt: skip


def train_ppo(
    policy: TinyLM,
    ref_policy: TinyLM,
    reward_model: ScalarModel | None,
    task: Task,
    train_prompts: torch.Tensor,
    eval_sets: dict[str, torch.Tensor] | torch.Tensor,
    cfg: PPOConfig,
    progress: Callable[[dict], None] | None = None,
    initial_eval: dict | None = None,
) -> dict:
    """Runs ``cfg.algorithm`` in place on ``policy``. ``reward_model``: the proxy of a learned-reward task (None for
    a verifier task); ``eval_sets``: held-out prompts by name ({"": in-domain, "ood": ...}, rlhf.evaluate; a tensor
    is the in-domain set alone). ``initial_eval``: the iteration-0 measurement of this ``policy`` if already made,
    {"iteration": 0, **rlhf.evaluate.evaluate(policy, ref_policy, reward_model, task, eval_sets, cfg.temperature,
    cfg.eval_seed)}; None measures it (the same numbers: the evaluation draws from its own generator only).
    Returns {"history": per-iteration dicts (``Stats``), "evals": held-out measurements every ``eval_every``
    iterations (and at 0 and the end), "summary": the final measurement, "diagnostics": gradient-diagnostic rows
    (empty unless ``cfg.diagnostics``)}. ``progress(row)`` after each iteration."""
    eval_sets = eval_sets if isinstance(eval_sets, dict) else {"": eval_sets}
    cell = Cell(policy, ref_policy, reward_model, task, train_prompts, eval_sets, cfg)
    report = None if progress is None else lambda it, rows: progress(rows[0])
    histories, evals, diagnostics = train(cell, [initial_eval], report)
    return {"history": histories[0], "evals": evals[0], "summary": final_summary(evals[0]), "diagnostics": diagnostics}


def records(cells: Cells, it: int, coefs, step7: list[dict], traj, batch: Batch, kl_exact) -> list[Stats]:
    """Each cell's ``Stats`` of iteration ``it``: its coefficient, its step-7 stats ``step7`` (vf_loss and entropy
    None when its run has none), the exact KL of its rollout ``kl_exact`` and the other means over its rollout."""
    per_cell, n = cells.per_cell, len(coefs)
    kl_used = [0.0] * n if batch.kl_reward is None else per_cell(lambda x: x.sum(1).mean(), batch.kl_reward)
    scores, lengths, gold = (
        per_cell(torch.mean, traj.scores),
        per_cell(lambda m: m.sum(1).mean(), traj.mask),
        cells.gold(traj),
    )
    return [
        Stats(it, coefs[i], kl_used[i], **(dict.fromkeys(("vf_loss", "entropy")) | step7[i]),
              kl_exact=kl_exact[i], score=scores[i], gold_train=gold[i], length=lengths[i])
        for i in range(n)
    ]  # fmt: skip


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
