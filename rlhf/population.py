"""A population of B independent PPO cells trained as one batched computation (issue 21).

Each cell has its own parameters, Adam state, generator, task instance, KL coefficient (and controller) and seed;
the cells of one population share their structure (algorithm, placement, estimator, every other PPOConfig field,
the model and task shapes). ``rlhf.ppo.train``, the loop of ``train_ppo``, drives a ``Population`` through its
steps (``rlhf.ppo.Cells``). The cells' parameters are stacked along a leading cell dimension B (``Population.state``:
weights (B, ...)), and every per-cell step of ``rlhf.ppo`` runs unchanged, once, for all cells, under
``torch.func.vmap`` over that dimension with ``torch.func.functional_call`` swapping a cell's slice into a template
module (the "model ensembling" pattern of the torch.func docs, https://pytorch.org/docs/stable/func.html,
``stack_module_state`` / ``functional_call`` / ``vmap``). Under vmap every reduction of ``rlhf.ppo`` and
``rlhf.kl`` (masked means, whitening, group baselines, aggregations) runs over the cell's own dims only, and

    loss_i = minibatch_loss(cell i),   sum_i loss_i .backward()  ->  grad_i = d loss_i / d theta_i  (cells disjoint)

then one fused Adam step over every cell's own parameter tensors (the stacked weights are ``torch.stack`` of
them, rebuilt differentiably for each minibatch; Adam on one stacked tensor would round an element differently
depending on its offset in it) applies each cell's update as ``train_ppo``'s would. Random draws (prompts,
sampled tokens, minibatch permutations) come from each cell's own ``torch.Generator`` in the order of
``rlhf.ppo.train_ppo``, outside vmap (torch.func cannot take a generator), so a cell's draws do not depend on its
neighbours. The proxy reward model is batched as the policy is; a verifier (``task.gold``, per instance) and the
evaluation statistics are per-cell loops over slices. On CUDA attention takes SDPA's math path (``attention``).

Identity (tests/rlhf/test_population.py): on CPU, with one torch thread, a cell run alone and inside a population
of 8 gives bit-identical histories, evaluations and parameters (a single cell runs as B = 2, itself twice: a cell
dim of size 1 is coalesced away by the CPU kernels, which then reduce by another path). Against ``train_ppo`` (one
cell, no vmap) it is not bit-identical: batched kernels (per-cell reductions, the batched LayerNorm backward) round
the last float bits differently, and training amplifies that: population results are a re-baseline of the cells
they run (benchmarks/bench_population.py measures the final gold and KL difference).

Coverage: the tiny backend (``rlhf.model.TinyLM``) and the hf backend (``rlhf.hf.HFLM``, both families of
``rlhf.hf``: Llama and GPT-2, fp32); every algorithm (ppo with its critic, grpo, rloo, reinforce_pp), every placement
and estimator, fixed or adaptive coefficient, every policy-loss option. On the hf backend the teacher-forced passes
go through ``functional_call`` over the stacked ``transformers`` weights as TinyLM's do, and generation keeps its KV
cache as (keys, values) tensors per layer between vmapped calls (``policy_hidden``: vmap carries tensors, not a
``DynamicCache``, which is rebuilt from them inside each call). Refused with a
ValueError: hf models under bf16 autocast (``AUTOCAST_REFUSED``: with torch 2.13.0 and transformers 5.23.0, inside
``vmap`` ``torch.autocast`` casts a matmul but not ``F.linear`` with per-cell weights, so Llama's attention stops in
``scaled_dot_product_attention`` with "RuntimeError: Expected query, key, and value to have the same dtype, but got
query.dtype: float key.dtype: float and value.dtype: c10::BFloat16 instead." and GPT-2 would run at another precision
than ``train_ppo``), the moving reference (``ref_sync_every``), target 'old_policy' with a reward-side KL
(``rlhf.kl.reward_kl_remeasured``) and gradient diagnostics: they run one cell per process, as today.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_unflatten

from rlhf import kl as K
from rlhf.algorithms import ALGORITHMS
from rlhf.config import PPOConfig
from rlhf.evaluate import response_stats
from rlhf.model import ScalarModel, TinyLM, adam, full_precision, response_logits
from rlhf.ppo import (
    Batch,
    Trajectory,
    accumulate,
    check_finite,
    draw_prompts,
    final_summary,
    minibatch_loss,
    rollout_batch,
    scorer,
    train,
    trajectory,
    update_stats,
)
from rlhf.reward_model import init_reward_model, score
from rlhf.task import EOS, Task, response_mask

# torch.func has no batching rule for the CPU flash-attention kernel: it runs SDPA cell by cell (correct, only
# slower); the warning would repeat at every call site
warnings.filterwarnings(
    "ignore", message="There is a performance drop because we have not yet implemented the batching"
)


class CellInputs(NamedTuple):
    """What ``rlhf.ppo.train_ppo`` takes for one cell (its policy starts as a copy of ``ref``)."""

    ref: TinyLM
    reward_model: ScalarModel | None
    task: Task
    train_prompts: torch.Tensor  # (n, p)
    eval_sets: dict[str, torch.Tensor]  # name -> (m, p)
    cfg: PPOConfig
    policy: TinyLM | None = None  # the initial policy; None: a copy of ``ref`` (as every pipeline cell)
    initial_eval: dict | None = None  # its iteration-0 measurement if already made (``train_ppo``'s)


class Models(nn.Module):
    """One cell's modules: ``functional_call`` puts a cell's tensors in, ``forward(fn, *args)`` = fn(self, *args)."""

    def __init__(self, policy: TinyLM, ref: TinyLM, value: ScalarModel | None, rm: ScalarModel | None):
        super().__init__()
        self.policy, self.ref, self.value, self.rm = policy, ref, value, rm

    def forward(self, fn: Callable, *args):
        return fn(self, *args)


def is_hf(model: nn.Module) -> bool:
    """Whether ``model`` is an ``rlhf.hf.HFLM`` (without importing ``transformers`` for a TinyLM population)."""
    hf = sys.modules.get("rlhf.hf")
    return hf is not None and isinstance(model, hf.HFLM)


def hf_config(model: nn.Module) -> dict | None:
    """An HFLM's architecture config (without where it was loaded from), None for a TinyLM."""
    if not is_hf(model):
        return None
    return {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}


def structure(cfg: PPOConfig) -> dict:
    """What the cells of one population share: the config without seed and KL strength."""
    kl = cfg.kl.model_dump(exclude={"coef", "adaptive_target", "horizon"})
    return {**cfg.model_dump(exclude={"seed", "kl"}), "kl": kl}


def refused(cfg: PPOConfig) -> str | None:
    """Why a cell with config ``cfg`` cannot be one of a population, or None."""
    if cfg.kl.ref_sync_every is not None or K.reward_kl_remeasured(cfg.kl) or cfg.diagnostics:
        return (
            "population: a moving reference (ref_sync_every), target 'old_policy' with a reward-side KL and "
            "gradient diagnostics run one cell per process (rlhf.ppo.train_ppo)"
        )
    return None


AUTOCAST_REFUSED = (
    "population: hf models under bf16 autocast (rlhf.hf.set_autocast) run one cell per process: inside "
    "torch.func.vmap torch.autocast casts some ops and not others (F.linear with per-cell weights stays float32), so "
    "Llama's attention fails (scaled_dot_product_attention: 'Expected query, key, and value to have the same dtype') "
    "and GPT-2 would not run at train_ppo's precision"
)


def check_cells(cells: list[CellInputs]) -> None:
    """ValueError (one line) for a population this module cannot train, or cells that differ in structure."""
    if not cells:
        raise ValueError("a population needs at least one cell")
    first = cells[0]
    for c in cells:
        if not (isinstance(c.ref, TinyLM) or is_hf(c.ref)):
            raise ValueError(f"population: TinyLM or rlhf.hf.HFLM models only, not {type(c.ref).__name__}")
        if refused(c.cfg):
            raise ValueError(refused(c.cfg))
        if any(
            getattr(m, "autocast_dtype", None) is not None
            for x in (c.ref, c.reward_model, c.policy)
            if x is not None
            for m in x.modules()
        ):
            raise ValueError(AUTOCAST_REFUSED)
        if (c.task.reward == "learned") != (c.reward_model is not None):
            raise ValueError(f"population: a task with a {c.task.reward!r} reward needs a reward model iff learned")
        if structure(c.cfg) != structure(first.cfg):
            raise ValueError("population: cells must share their config except seed and KL coefficient")
        shapes = lambda x: {k: v.shape for k, v in x.state_dict().items()}
        same = shapes(c.ref) == shapes(first.ref) and c.task.max_new_tokens == first.task.max_new_tokens
        same = same and hf_config(c.ref) == hf_config(first.ref)  # the template runs the first cell's config
        sets = lambda x: {k: v.shape[1:] for k, v in x.eval_sets.items()}
        same = same and c.train_prompts.shape[1:] == first.train_prompts.shape[1:] and sets(c) == sets(first)
        if not same or (c.reward_model is None) != (first.reward_model is None):
            raise ValueError("population: cells must share model, prompt and evaluation-set shapes and reward kind")


def trainable_leaves(modules: list[Models]) -> dict[str, list[torch.Tensor]]:
    """Each cell's own policy and value parameters (leaves): name -> B tensors. Adam steps them as separate
    tensors, exactly as ``train_ppo``'s optimiser does (a fused step over one stacked (B, ...) tensor rounds an
    element differently depending on its offset: vectorised body vs scalar tail)."""
    names = [n for n, _ in modules[0].named_parameters() if n.startswith(("policy.", "value."))]
    return {n: [m.get_parameter(n).detach().clone().requires_grad_(True) for m in modules] for n in names}


def stack_frozen(modules: list[Models], trainable) -> dict[str, torch.Tensor]:
    """Every other tensor of B ``Models`` (reference, buffers) stacked: name -> (B, ...), as
    ``torch.func.stack_module_state`` does."""
    dicts = [m.state_dict() for m in modules]
    return {n: torch.stack([d[n].detach() for d in dicts]) for n in dicts[0] if n not in trainable}  # (B, ...)


def cell_state(state: dict[str, torch.Tensor], i: int, prefix: str = "policy.") -> dict[str, torch.Tensor]:
    """Cell i's ``prefix`` module as a state_dict (detached copies)."""
    return {k.removeprefix(prefix): v[i].detach().clone() for k, v in state.items() if k.startswith(prefix)}


def cellwise(fn: Callable) -> Callable:
    """``torch.func.vmap(fn)`` over the leading (cell) dim of every tensor in the args and the result, which may
    also hold None and Python values (None fields of ``Trajectory`` and ``Batch``; vmap itself takes tensors only)."""

    def run(*args):
        leaves, tree = tree_flatten(args)
        is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        out_spec = {}

        def inner(*tensors):
            it = iter(tensors)
            out = fn(*tree_unflatten([next(it) if t else x for x, t in zip(leaves, is_tensor)], tree))
            out_leaves, out_spec["tree"] = tree_flatten(out)
            out_spec["tensor"] = [isinstance(x, torch.Tensor) for x in out_leaves]
            out_spec["leaves"] = out_leaves
            return [x for x in out_leaves if isinstance(x, torch.Tensor)]

        got = iter(vmap(inner)(*(x for x, t in zip(leaves, is_tensor) if t)))
        out = [next(got) if t else x for x, t in zip(out_spec["leaves"], out_spec["tensor"])]
        return tree_unflatten(out, out_spec["tree"])

    return run


class Population:
    """B cells' modules as one stacked state; ``call(fn)`` runs fn(models, *args) for every cell at once."""

    def __init__(self, cells: list[CellInputs]):
        check_cells(cells)
        self.cells, self.cfg = cells, cells[0].cfg
        critic = ALGORITHMS[self.cfg.algorithm].critic
        modules = []
        for c in cells:
            torch.manual_seed(c.cfg.seed)  # train_ppo's global seed: a verifier task's value head is drawn here
            value = None
            if critic:
                value = copy.deepcopy(c.reward_model) if c.reward_model is not None else init_reward_model(c.ref)
            policy = copy.deepcopy(c.ref if c.policy is None else c.policy)
            modules.append(Models(policy, c.ref, value, c.reward_model))
        self.template = modules[0]
        self.leaves = trainable_leaves(modules)
        self.frozen = stack_frozen(modules, self.leaves)
        self.opt = adam([x for xs in self.leaves.values() for x in xs], lr=self.cfg.lr, eps=self.cfg.adam_eps)
        self._state = None
        device = cells[0].train_prompts.device
        self.gens = [torch.Generator(device=device).manual_seed(c.cfg.seed) for c in cells]
        self.controllers = [K.controller(c.cfg.kl) for c in cells]
        self.kl = K.resolve(self.cfg.kl, self.cfg.pg_mode)  # the cells' shared structure, once per run
        self.critic = critic

    def call(self, fn: Callable) -> Callable:
        """fn(models, *args) vmapped over the cell dim of the state and of every tensor in args."""
        batched = cellwise(lambda state, *args: functional_call(self.template, state, (fn, *args)))
        return lambda *args: batched(self.state(), *args)

    def state(self) -> dict[str, torch.Tensor]:
        """name -> (B, ...): with grad enabled the trainable tensors are stacked anew (differentiable); without,
        a stacked copy cached until the next ``step``."""
        if torch.is_grad_enabled():
            return self.frozen | {n: torch.stack(xs) for n, xs in self.leaves.items()}
        if self._state is None:
            self._state = self.frozen | {n: torch.stack(xs).detach() for n, xs in self.leaves.items()}
        return self._state

    def step(self, losses: torch.Tensor) -> None:
        """One Adam step of every cell on the sum of their losses (B,) (each cell's gradient is its own loss's)."""
        self.opt.zero_grad()
        losses.sum().backward()
        self.opt.step()
        self._state = None

    def __len__(self) -> int:
        return len(self.cells)

    # ``rlhf.ppo.Cells``: the steps ``rlhf.ppo.train`` drives, for every cell at once
    def rollout(self, it: int) -> Trajectory:
        return rollout_cells(self)

    @torch.no_grad()
    def advantages(self, traj: Trajectory, coefs: list[float]) -> Batch:
        steps_4_6 = lambda tr, coef: rollout_batch(tr, coef, self.cfg, self.kl)
        return cellwise(steps_4_6)(traj, self.coef_tensor(coefs))

    def diagnose(self, traj, batch, coefs, it):
        raise ValueError(refused(self.cfg))  # refused when the population is made (``check_cells``)

    def update(self, traj: Trajectory, batch: Batch, coefs: list[float], it: int) -> tuple[list[dict], Batch]:
        return update_cells(self, traj, batch, self.coef_tensor(coefs), it), batch

    def sync_reference(self, it: int) -> None:
        """No moving reference in a population (``refused``)."""

    def per_cell(self, fn: Callable, x: torch.Tensor) -> list[float]:
        """fn reduced over each cell's own dims (vmap over the leading dim) -> B Python floats."""
        return vmap(fn)(x).tolist()

    def gold(self, traj: Trajectory) -> list[float]:
        return [c.task.gold(x, y).mean().item() for c, x, y in zip(self.cells, traj.prompts, traj.responses)]

    def evaluate(self, it: int) -> list[dict]:
        return evaluate_cells(self, it)

    def coef_tensor(self, coefs: list[float]) -> torch.Tensor:
        return torch.tensor(coefs, device=self.cells[0].train_prompts.device)  # (B,)


def policy_hidden(m: Models, x: torch.Tensor, cache=None, start: int = 0):
    """``m.policy.hidden`` with the KV cache as [(keys, values)] per layer, tensors that vmap carries in and out of
    a call (a TinyLM's own cache; an HFLM's ``transformers`` ``DynamicCache`` is rebuilt from them and taken apart)."""
    if not is_hf(m.policy):
        return m.policy.hidden(x, cache, start=start)
    from transformers import DynamicCache

    h, cache = m.policy.hidden(x, None if cache is None else DynamicCache(cache), start=start)
    return h, [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def generate_cells(pop: Population, prompts, max_new_tokens: int, temperature: float, gens) -> torch.Tensor:
    """``rlhf.model.generate`` for every cell: prompts (B, b, p) -> responses (B, b, T), the forward passes
    (KV cache (B, b, h, s, d/h) per layer) batched over cells, each cell's tokens drawn with its own generator."""
    B, b, p = prompts.shape
    h, cache = pop.call(lambda m, x: policy_hidden(m, x))(prompts)  # (B, b, p, d)
    head = pop.call(lambda m, x: m.policy.head(x[:, -1]))
    logits = head(h)  # (B, b, V)
    out = torch.empty(B, b, max_new_tokens, dtype=torch.long, device=prompts.device)
    done = torch.zeros(B, b, dtype=torch.bool, device=prompts.device)
    for t in range(max_new_tokens):
        probs = F.softmax(logits / temperature, dim=-1)  # (B, b, V)
        nxt = torch.stack([torch.multinomial(pr, 1, generator=g).squeeze(1) for pr, g in zip(probs, gens)])  # (B, b)
        nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)
        out[:, :, t] = nxt
        done |= nxt == EOS
        if t + 1 < max_new_tokens:
            step = lambda m, x, c, start=p + t: policy_hidden(m, x[:, None], c, start)
            h, cache = pop.call(step)(nxt, cache)
            logits = head(h)
    return out


@torch.no_grad()
def evaluate_cells(pop: Population, it: int) -> list[dict]:
    """``rlhf.evaluate.evaluate`` of every cell at iteration ``it`` (its keys and values), batched over cells."""
    cfg, out = pop.cfg, [{"iteration": it} for _ in pop.cells]
    for name in pop.cells[0].eval_sets:
        prompts = torch.stack([c.eval_sets[name] for c in pop.cells])  # (B, m, p)
        gens = [torch.Generator(device=prompts.device).manual_seed(c.cfg.eval_seed) for c in pop.cells]
        responses = generate_cells(pop, prompts, pop.cells[0].task.max_new_tokens, cfg.temperature, gens)
        both = lambda m, x, y: [response_logits(mod, x, y, cfg.temperature) for mod in (m.policy, m.ref)]
        with full_precision(pop.template.policy, pop.template.ref):  # fp32 under bf16 autocast, as ``evaluate``
            logits, ref_logits = pop.call(both)(prompts, responses)  # (B, m, T, V)
        proxy = (
            None
            if pop.cells[0].reward_model is None
            else pop.call(lambda m, x, y: score(m.rm, x, y))(prompts, responses)
        )
        for i, c in enumerate(pop.cells):
            mask = response_mask(responses[i])
            stats = response_stats(None, c.task, prompts[i], responses[i])  # the proxy is batched: ``proxy``
            row = {"gold": stats.pop("gold")} | ({} if proxy is None else {"proxy": proxy[i].mean().item()})
            row["kl"] = (K.full_kl(logits[i], ref_logits[i]) * mask).sum(1).mean().item()
            row["entropy"] = K.masked_mean(K.entropy(logits[i]), mask).item()
            out[i] |= {(f"{name}_{k}" if name else k): v for k, v in (row | stats).items()}
    return out


def step_3(pop: Population, prompts, responses) -> torch.Tensor:
    """``train_ppo``'s step 3 for every cell: (B, b) scores of the proxy reward model (batched, with the
    missing-EOS score) or of each cell's verifier (a loop: ``task.gold`` is per instance)."""
    if pop.cells[0].reward_model is not None:
        return pop.call(lambda m, x, y: scorer(m.rm, pop.cells[0].task, pop.cfg.missing_eos_score)(x, y))(
            prompts, responses
        )
    return torch.stack([c.task.gold(x, y) for c, x, y in zip(pop.cells, prompts, responses)])


@torch.no_grad()
def rollout_cells(pop: Population) -> Trajectory:
    """Steps 1-3 of ``rlhf.ppo.train`` for every cell: a scored Trajectory, each tensor with a leading B."""
    cfg, cells = pop.cfg, pop.cells
    prompts = torch.stack(
        [draw_prompts(c.train_prompts, cfg.batch_size, cfg.group_size, g) for c, g in zip(cells, pop.gens)]
    )
    responses = generate_cells(pop, prompts, cells[0].task.max_new_tokens, cfg.temperature, pop.gens)  # (B, b, T)
    traj = pop.call(lambda m, x, y: trajectory(m.policy, m.ref, m.ref, m.value, x, y, cfg.temperature))(
        prompts, responses
    )
    return traj._replace(scores=step_3(pop, prompts, responses))  # (B, b)


def update_cells(pop: Population, traj, batch, coefs, it: int) -> list[dict[str, float]]:
    """Step 7 of ``rlhf.ppo.train`` (``rlhf.ppo.update``) for every cell: each cell's means of the minibatch stats,
    accumulated in float64 tensors (B,) as ``update`` does in Python floats (``rlhf.ppo.accumulate``)."""
    cfg, kl = pop.cfg, pop.kl  # kl.loss_kl None: no loss side, the coefficient unused
    n_mb = cfg.batch_size // cfg.minibatch_size
    loss_fn = pop.call(lambda m, tr, bt, mb, lc: minibatch_loss(m.policy, m.value, tr, bt, mb, lc, cfg, kl))
    stats = update_stats(cfg, pop.critic)
    for _ in range(cfg.epochs):
        perms = torch.stack([torch.randperm(cfg.batch_size, generator=g, device=coefs.device) for g in pop.gens])
        for mb in perms.view(len(pop), n_mb, cfg.minibatch_size).unbind(1):  # (B, mb)
            losses, mb_stats = loss_fn(traj, batch, mb, coefs)  # (B,)
            check_finite("loss", losses, it)
            pop.step(losses)
            accumulate(stats, mb_stats, cfg.epochs * n_mb, lambda v: v.detach().double())
    lists = {k: v.tolist() if isinstance(v, torch.Tensor) else [v] * len(pop) for k, v in stats.items()}
    return [{k: v[i] for k, v in lists.items()} for i in range(len(pop))]


def train_population(cells: list[CellInputs], progress: Callable[[int], None] | None = None) -> list[dict]:
    """``rlhf.ppo.train_ppo`` for each of ``cells`` as one batched computation (``rlhf.ppo.train`` driving a
    ``Population``). Returns, per cell, train_ppo's {"history", "evals", "summary", "diagnostics" (empty)} plus
    "policy": the trained policy's state_dict. ``progress(iteration)`` after each iteration. A single cell runs as
    a population of 2 (itself twice): with a cell dim of size 1 the CPU kernels coalesce it away and reduce by
    another path (other last bits)."""
    n, cells = len(cells), (cells * 2 if len(cells) == 1 else cells)
    report = None if progress is None else lambda it, rows: progress(it)
    with attention(cells[0].train_prompts.device):
        pop = Population(cells)
        histories, evals, _ = train(pop, [c.initial_eval for c in cells], report)
        with torch.no_grad():
            final = pop.state()
    return [
        {"history": h, "evals": e, "summary": final_summary(e), "diagnostics": [], "policy": cell_state(final, i)}
        for i, (h, e) in enumerate(zip(histories[:n], evals[:n]))
    ]


def attention(device: torch.device):
    """On CUDA, SDPA's math path (matmuls and a softmax, which vmap batches over cells; torch.func may lack a
    batching rule for a fused attention kernel, then it loops over cells); elsewhere the default kernel (on CPU
    it runs cell by cell, which keeps a cell's numbers independent of B)."""
    return sdpa_kernel(SDPBackend.MATH) if device.type == "cuda" else contextlib.nullcontext()
