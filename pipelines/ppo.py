"""Stage `ppo@<arm>-<coef>-<seed>` / `baseline@<seed>`: one PPO run -> runs/<group>/<cell>/.

Writes summary.json (DVC metrics), evals.csv and history.csv (DVC plots), all at once when the run ends.

    python -m pipelines.ppo --arm reward_k1 --coef 0.1 --seed 0
    python -m pipelines.ppo --arm none --seed 0          # the no-KL baseline
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import os
import time

from tqdm import tqdm

from ablations.config import Params, load_params
from ablations.grid import Cell, find_cell
from pipelines import tracking
from pipelines.common import (
    DATA,
    RM_MODEL,
    SFT_MODEL,
    atomic_dir,
    load_checkpoint,
    load_grammar,
    load_lm,
    load_reward_model,
    setup,
    write_json,
)
from pipelines.plots import run_figure
from rlhf.ppo import train_ppo


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def run_cell(params: Params, cell: Cell) -> dict:
    """Trains one cell and writes its outputs atomically. Returns its summary plus ``wall_s`` (seconds; not in
    summary.json, which must be the same on every rerun)."""
    device = setup()
    task = load_checkpoint(DATA)
    grammar = load_grammar(task)
    ref = load_lm(SFT_MODEL, device)
    reward_model = load_reward_model(RM_MODEL, device)
    cfg = params.ppo_config(cell.kl, cell.seed)
    axes = {"arm": cell.arm, "coef": cell.coef, "seed": cell.seed, **cell.kl.model_dump(exclude={"coef"})}
    with tracking.stage_run(cell.stage, params.mlflow.experiment, cfg.model_dump(), tags=axes) as (client, rid):
        start = time.perf_counter()
        with tqdm(total=cfg.iterations, desc=cell.stage, leave=False) as bar:
            out = train_ppo(
                copy.deepcopy(ref),
                ref,
                reward_model,
                grammar,
                task["train_prompts"].to(device),
                task["eval_prompts"].to(device),
                cfg,
                progress=lambda row: bar.update(),
            )
        wall_s = time.perf_counter() - start  # MLflow and the caller only: summary.json must be reproducible
        summary = {"stage": cell.stage, **axes, **out["summary"]}
        tracking.log_metrics(client, rid, out["history"], prefix="train/")
        tracking.log_metrics(client, rid, out["evals"], prefix="eval/")
        final = {k: v for k, v in summary.items() if k.startswith(("final_", "peak_"))}
        tracking.log_final(client, rid, {**final, "wall_s": wall_s})
        with atomic_dir(cell.out_dir) as tmp:
            write_json(tmp / "summary.json", summary)
            (tmp / "evals.csv").write_text(to_csv(out["evals"]))
            (tmp / "history.csv").write_text(to_csv(out["history"]))
            run_figure(out["evals"], cell.stage).savefig(tmp / "curves.png", dpi=90)
            client.log_artifact(rid, str(tmp / "curves.png"))
    return {**summary, "wall_s": wall_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", required=True, help="an arm of grid.arms, or 'none' for the no-KL baseline")
    ap.add_argument("--coef", type=float, default=0.0)
    ap.add_argument("--seed", type=int, required=True)
    args = ap.parse_args(argv)
    params = load_params()
    summary = run_cell(params, find_cell(params, args.arm, args.coef, args.seed))
    print(
        f"{summary['stage']}: gold {summary['final_gold']:.3f} proxy {summary['final_proxy']:.3f} "
        f"KL {summary['final_kl']:.2f} ({summary['wall_s']:.1f}s, pid {os.getpid()})"
    )


if __name__ == "__main__":
    main()
