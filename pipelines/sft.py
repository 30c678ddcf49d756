"""Stage `<task>_sft@<instance>`: next-token training on the demonstrations -> models/<task>/<i>/sft.pt + metrics.

python -m pipelines.sft grammar 0
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ablations.section import TaskSection
from pipelines import tracking
from pipelines.common import (
    build_lm,
    data_path,
    load_checkpoint,
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
from rlhf.model import TinyLM
from rlhf.sft import response_nll, train_sft


def fit(section: TaskSection, seed: int, data: dict, device: torch.device) -> tuple[TinyLM, dict, dict, list]:
    """SFT of task instance ``seed`` (the instance seeds the initialisation and the batches).
    Returns (model, arch, metrics, per-step losses)."""
    p = section.sft
    task = load_task(data)
    prompts, responses = data["demo_prompts"].to(device), data["demo_responses"].to(device)
    torch.manual_seed(seed)
    model, arch = build_lm(section.model, task.vocab_size, task.prompt_len + task.max_new_tokens)
    model = model.to(device)
    set_precision(section.model, model)
    n = p.n_heldout  # the last demonstrations are held out for the NLL
    (tp, tr), (vp, vr) = (prompts[:-n], responses[:-n]), (prompts[-n:], responses[-n:])
    with torch.no_grad():
        nll_before = response_nll(model, vp, vr).item()
    g = torch.Generator(device).manual_seed(seed)
    with tqdm(total=p.steps, desc="sft", leave=False) as bar:
        losses = train_sft(model, tp, tr, p.steps, p.batch_size, p.lr, g, bar.update, adam_eps=p.adam_eps)
    with torch.no_grad():
        metrics = {
            "heldout_nll_before": nll_before,
            "heldout_nll": response_nll(model, vp, vr).item(),
            "train_loss_last": losses[-1],
        }
    return model.eval(), arch, metrics, losses


def main(argv: list[str] | None = None) -> None:
    params, task, section, instance = upstream_stage_args(argv, "sft")
    device = setup()
    data = load_checkpoint(data_path(task, instance))
    config = {"sft": section.sft.model_dump(), "model": section.model.model_dump()}
    tags = {"task": task, "instance": instance, "kind": "sft"}
    stage = upstream_stage_name(task, section, "sft", instance)
    with tracking.stage_run(stage, params.mlflow.experiment, config, tags=tags) as (client, rid):
        model, arch, metrics, losses = fit(section, instance, data, device)
        tracking.log_metrics(client, rid, [{"step": i, "train_loss": v} for i, v in enumerate(losses)], step_key="step")
        tracking.log_final(client, rid, metrics)
        save_checkpoint(model_path(task, instance, "sft"), {"arch": arch, "state_dict": model.state_dict()})
        write_json(metrics_path(task, instance, "sft"), metrics)
    print(f"SFT held-out NLL {metrics['heldout_nll_before']:.3f} -> {metrics['heldout_nll']:.3f} nats/token")


if __name__ == "__main__":
    main()
