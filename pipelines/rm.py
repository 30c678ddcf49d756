"""Stage `<task>_rm@<instance>`: pairs of SFT samples labelled by gold, Bradley-Terry proxy -> models/<task>/<i>/rm.pt.

    python -m pipelines.rm grammar 0

Any task whose ``reward`` is "learned" (``rlhf.task.LearnedRewardTask``: it draws the pairs' prompts and has a gold
reward) has this stage; nothing here knows which task it is. metrics/<task>/<i>/rm.json holds the held-out accuracy
against noiseless gold labels, the labels' agreement with them, the proxy's Pearson and Spearman correlation with
gold on held-out SFT samples, the mean of each of the task's metrics on the training samples
(``train_<metric>_fraction``: each is a per-response share) and the last training loss.

The two correlations are computed exactly rounded (``correlation``: float64 products, ``math.fsum``), not with
numpy's BLAS: BLAS picks its kernel from the CPU (or ``OPENBLAS_CORETYPE``), and scipy's float32 path gave the same
models a ``pearson_gold`` one float32 step apart on two machines (issue 30); every other number comes from torch on
the pinned code path (pipelines/cpu.py).
"""

from __future__ import annotations

import math
import sys

import torch
from tqdm import tqdm

from ablations.section import TaskSection
from ablations.tasks import TASKS
from pipelines import tracking
from pipelines.common import (
    data_path,
    derived_seed,
    load_checkpoint,
    load_lm,
    load_task,
    metrics_path,
    model_path,
    save_checkpoint,
    set_precision,
    setup,
    upstream_stage_args,
    upstream_stage_name,
    write_json,
)
from rlhf import reward_model as R
from rlhf.model import TinyLM, generate
from rlhf.task import EOS, LearnedRewardTask, gold_ordered, preference_pairs


def correlation(x: list[float], y: list[float]) -> float:
    """Pearson's r of two equally long samples, exactly rounded at each step (float64 deviations and products,
    ``math.fsum`` for every sum), so that it is the same number on every machine; nan when a sample is constant."""
    n = len(x)
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    dx, dy = [v - mx for v in x], [v - my for v in y]
    sxy = math.fsum(a * b for a, b in zip(dx, dy))
    sxx, syy = math.fsum(a * a for a in dx), math.fsum(b * b for b in dy)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def ranks(x: list[float]) -> list[float]:
    """Average ranks (1-based; ties share the mean of their ranks), as scipy.stats.rankdata."""
    order = sorted(range(len(x)), key=x.__getitem__)
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def fit(section: TaskSection, seed: int, task: LearnedRewardTask, sft: TinyLM, device: torch.device):
    """The proxy reward model of task instance ``seed``. Returns (reward model, metrics, per-step losses)."""
    p = section.rm
    seed = derived_seed(seed, "rm")  # a stream of its own, not the data stage's prompts again
    # 1. pairs of SFT samples for fresh prompts, labelled by a Bradley-Terry draw on gold
    g = torch.Generator(device).manual_seed(seed)
    prompts = task.preference_prompts(p.n_pairs + p.n_heldout_pairs, torch.Generator().manual_seed(seed))
    prompts = prompts.to(device)
    a = generate(sft, prompts, task.max_new_tokens, 1.0, g, EOS)
    b = generate(sft, prompts, task.max_new_tokens, 1.0, g, EOS)
    chosen, rejected, agrees = preference_pairs(task, prompts, a, b, p.label_noise, g)
    n = p.n_pairs
    # 2. Bradley-Terry training from the SFT backbone, then normalisation on SFT samples
    torch.manual_seed(seed)
    rm = R.init_reward_model(sft).train()
    with tqdm(total=p.steps, desc="rm", leave=False) as bar:
        losses = R.train_reward_model(
            rm, prompts[:n], chosen[:n], rejected[:n], p.steps, p.batch_size, p.lr, g, bar.update, adam_eps=p.adam_eps
        )
    rm.eval()
    R.normalize(rm, prompts[:n], a[:n])
    # 3. held-out: accuracy against noiseless gold labels, correlation with gold on SFT samples
    vp, va = prompts[n:], a[n:]
    gold = task.gold(vp, va).cpu().tolist()
    with torch.no_grad():
        proxy = R.score(rm, vp, va).cpu().tolist()
    train = {f"train_{k}_fraction": v.mean().item() for k, v in task.metrics(prompts[:n], a[:n]).items()}
    metrics = {
        "heldout_accuracy": R.pairwise_accuracy(rm, *gold_ordered(task, vp, va, b[n:])),
        "label_agreement": agrees[:n].float().mean().item(),
        "pearson_gold": correlation(proxy, gold),
        "spearman_gold": correlation(ranks(proxy), ranks(gold)),
        **train,
        "train_loss_last": losses[-1],
    }
    return rm, metrics, losses


def main(argv: list[str] | None = None) -> None:
    params, task, section, instance = upstream_stage_args(argv, "rm")
    if not TASKS[task].learned_reward:
        sys.exit(f"error: task {task!r} scores with its verifier; it has no reward-model stage")
    device = setup()
    learned = load_task(load_checkpoint(data_path(task, instance)))
    sft_path = model_path(task, instance, "sft")
    sft = load_lm(sft_path, device)
    set_precision(section.model, sft)
    tags = {"task": task, "instance": instance, "kind": "rm"}
    config = {"rm": section.rm.model_dump()}
    stage = upstream_stage_name(task, section, "rm", instance)
    with tracking.stage_run(stage, params.mlflow.experiment, config, tags=tags) as (client, rid):
        rm, metrics, losses = fit(section, instance, learned, sft, device)
        tracking.log_metrics(client, rid, [{"step": i, "train_loss": v} for i, v in enumerate(losses)], step_key="step")
        tracking.log_final(client, rid, metrics)
        arch = load_checkpoint(sft_path)["arch"]
        save_checkpoint(model_path(task, instance, "rm"), {"arch": arch, "state_dict": rm.state_dict()})
        write_json(metrics_path(task, instance, "rm"), metrics)
    print("RM " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
