"""Stage `rm`: preference pairs of SFT samples labelled by gold, Bradley-Terry proxy -> models/rm.pt + metrics."""

from __future__ import annotations

import torch
from scipy import stats
from tqdm import tqdm

from ablations.config import Params, load_params
from pipelines import tracking
from pipelines.common import (
    DATA,
    METRICS,
    RM_MODEL,
    SFT_MODEL,
    load_checkpoint,
    load_grammar,
    load_lm,
    save_checkpoint,
    setup,
    write_json,
)
from rlhf import reward_model as R
from rlhf.model import TinyLM, generate
from rlhf.task import EOS, Grammar, gold_ordered, gold_reward, illegal_fraction, preference_pairs, sample_prompts


def fit(params: Params, grammar: Grammar, sft: TinyLM, device: torch.device):
    """Returns (reward model, metrics, per-step losses)."""
    p = params.rm
    # 1. pairs of SFT samples for fresh prompts, labelled by a Bradley-Terry draw on gold
    g = torch.Generator(device).manual_seed(p.seed)
    prompts = sample_prompts(grammar, p.n_pairs + p.n_heldout_pairs, torch.Generator().manual_seed(p.seed))
    prompts = prompts.to(device)
    a = generate(sft, prompts, grammar.max_new_tokens, 1.0, g, EOS)
    b = generate(sft, prompts, grammar.max_new_tokens, 1.0, g, EOS)
    chosen, rejected, agrees = preference_pairs(grammar, prompts, a, b, p.label_noise, g)
    n = p.n_pairs
    # 2. Bradley-Terry training from the SFT backbone, then normalisation on SFT samples
    torch.manual_seed(p.seed)
    rm = R.init_reward_model(sft).train()
    with tqdm(total=p.steps, desc="rm", leave=False) as bar:
        losses = R.train_reward_model(
            rm, prompts[:n], chosen[:n], rejected[:n], p.steps, p.batch_size, p.lr, g, bar.update
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


def main() -> None:
    params = load_params()
    device = setup()
    grammar = load_grammar(load_checkpoint(DATA))
    sft = load_lm(SFT_MODEL, device)
    with tracking.stage_run("rm", params.mlflow.experiment, {"rm": params.rm.model_dump()}) as (client, rid):
        rm, metrics, losses = fit(params, grammar, sft, device)
        tracking.log_metrics(client, rid, [{"step": i, "train_loss": v} for i, v in enumerate(losses)], step_key="step")
        tracking.log_final(client, rid, metrics)
        save_checkpoint(RM_MODEL, {"arch": load_checkpoint(SFT_MODEL)["arch"], "state_dict": rm.state_dict()})
        write_json(METRICS / "rm.json", metrics)
    print("RM " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
