"""Stage `sft`: next-token training on the demonstrations -> models/sft.pt, metrics/sft.json."""

from __future__ import annotations

import torch
from tqdm import tqdm

from ablations.config import Params, load_params
from pipelines import tracking
from pipelines.common import (
    DATA,
    METRICS,
    SFT_MODEL,
    load_checkpoint,
    load_grammar,
    new_lm,
    save_checkpoint,
    setup,
    write_json,
)
from rlhf.model import TinyLM
from rlhf.sft import response_nll, train_sft


def fit(params: Params, task: dict, device: torch.device) -> tuple[TinyLM, dict, dict, list[float]]:
    """Returns (model, arch, metrics, per-step losses)."""
    p = params.sft
    grammar = load_grammar(task)
    prompts, responses = task["demo_prompts"].to(device), task["demo_responses"].to(device)
    arch = {
        "vocab_size": grammar.vocab_size,
        "max_len": grammar.prompt_len + grammar.max_new_tokens,
        **params.model.model_dump(),
    }
    torch.manual_seed(p.seed)
    model = new_lm(arch).to(device)
    n = p.n_heldout  # the last demonstrations are held out for the NLL
    (tp, tr), (vp, vr) = (prompts[:-n], responses[:-n]), (prompts[-n:], responses[-n:])
    with torch.no_grad():
        nll_before = response_nll(model, vp, vr).item()
    with tqdm(total=p.steps, desc="sft", leave=False) as bar:
        losses = train_sft(
            model, tp, tr, p.steps, p.batch_size, p.lr, torch.Generator(device).manual_seed(p.seed), bar.update
        )
    with torch.no_grad():
        metrics = {
            "heldout_nll_before": nll_before,
            "heldout_nll": response_nll(model, vp, vr).item(),
            "train_loss_last": losses[-1],
        }
    return model.eval(), arch, metrics, losses


def main() -> None:
    params = load_params()
    device = setup()
    task = load_checkpoint(DATA)
    with tracking.stage_run(
        "sft", params.mlflow.experiment, {"sft": params.sft.model_dump(), "model": params.model.model_dump()}
    ) as (client, rid):
        model, arch, metrics, losses = fit(params, task, device)
        tracking.log_metrics(client, rid, [{"step": i, "train_loss": v} for i, v in enumerate(losses)], step_key="step")
        tracking.log_final(client, rid, metrics)
        save_checkpoint(SFT_MODEL, {"arch": arch, "state_dict": model.state_dict()})
        write_json(METRICS / "sft.json", metrics)
    print(f"SFT held-out NLL {metrics['heldout_nll_before']:.3f} -> {metrics['heldout_nll']:.3f} nats/token")


if __name__ == "__main__":
    main()
