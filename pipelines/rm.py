"""Stage `<task>_rm@<instance>`: pairs of SFT samples labelled by gold, Bradley-Terry proxy -> models/<task>/<i>/rm.pt.

python -m pipelines.rm grammar 0
"""

from __future__ import annotations

import sys

import torch
from scipy import stats
from tqdm import tqdm

from ablations.tasks import TASKS, GrammarParams
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
    write_json,
)
from rlhf import reward_model as R
from rlhf.model import TinyLM, generate
from rlhf.task import EOS, Grammar, gold_ordered, gold_reward, illegal_fraction, preference_pairs, sample_prompts


def fit(section: GrammarParams, seed: int, grammar: Grammar, sft: TinyLM, device: torch.device):
    """The proxy reward model of task instance ``seed``. Returns (reward model, metrics, per-step losses)."""
    p = section.rm
    seed = derived_seed(seed, "rm")  # a stream of its own, not the data stage's prompts again
    # 1. pairs of SFT samples for fresh prompts, labelled by a Bradley-Terry draw on gold
    g = torch.Generator(device).manual_seed(seed)
    prompts = sample_prompts(grammar, p.n_pairs + p.n_heldout_pairs, torch.Generator().manual_seed(seed))
    prompts = prompts.to(device)
    a = generate(sft, prompts, grammar.max_new_tokens, 1.0, g, EOS)
    b = generate(sft, prompts, grammar.max_new_tokens, 1.0, g, EOS)
    chosen, rejected, agrees = preference_pairs(grammar, prompts, a, b, p.label_noise, g)
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
    ga = gold_reward(grammar, vp, va)
    with torch.no_grad():
        proxy = R.score(rm, vp, va).cpu().numpy()
    metrics = {
        "heldout_accuracy": R.pairwise_accuracy(rm, *gold_ordered(grammar, vp, va, b[n:])),
        "label_agreement": agrees[:n].float().mean().item(),
        "pearson_gold": float(stats.pearsonr(proxy, ga.cpu().numpy()).statistic),
        "spearman_gold": float(stats.spearmanr(proxy, ga.cpu().numpy()).statistic),
        "train_illegal_fraction": illegal_fraction(grammar, prompts[:n], a[:n]).mean().item(),
        "train_loss_last": losses[-1],
    }
    return rm, metrics, losses


def main(argv: list[str] | None = None) -> None:
    params, task, section, instance = upstream_stage_args(argv, "rm")
    if not TASKS[task].learned_reward:
        sys.exit(f"error: task {task!r} scores with its verifier; it has no reward-model stage")
    device = setup()
    grammar = load_task(load_checkpoint(data_path(task, instance)))
    sft_path = model_path(task, instance, "sft")
    sft = load_lm(sft_path, device)
    set_precision(section.model, sft)
    tags = {"task": task, "instance": instance, "kind": "rm"}
    config = {"rm": section.rm.model_dump()}
    cal = "_calibration" if instance in section.calibration.instances else ""  # DVC's name: {task}_calibration_rm@0
    stage = f"{task}{cal}_rm@{instance}"
    with tracking.stage_run(stage, params.mlflow.experiment, config, tags=tags) as (client, rid):
        rm, metrics, losses = fit(section, instance, grammar, sft, device)
        tracking.log_metrics(client, rid, [{"step": i, "train_loss": v} for i, v in enumerate(losses)], step_key="step")
        tracking.log_final(client, rid, metrics)
        arch = load_checkpoint(sft_path)["arch"]
        save_checkpoint(model_path(task, instance, "rm"), {"arch": arch, "state_dict": rm.state_dict()})
        write_json(metrics_path(task, instance, "rm"), metrics)
    print("RM " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
