"""Stage of one cell, named as DVC names it (ablations/grid.py): one PPO run -> runs/<task>/<kind>/<key>/.

Writes summary.json (DVC metrics; ``config`` is the run's whole PPOConfig, nested, as the grid built it, which the
analysis reads back through the model), evals.csv and history.csv (DVC plots), all at once when the run ends.

    python -m pipelines.ppo grammar_design@100-loss_k3-tuned-0    # at the value protocol/grammar.json fixed
    python -m pipelines.ppo grammar_calibration@0-reward_k1-0.1-0
    python -m pipelines.ppo grammar_fixed@100-reward_k1-0.1-0
    python -m pipelines.ppo grammar_baseline@100-0          # the no-KL arm
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import sys
import time
from typing import NamedTuple

from tqdm import tqdm

from ablations.experiment import SUMMARY_ALWAYS, Experiment, ParamsError, load_experiment, spec_of
from ablations.grid import ROLE_CELL, Cell, ProtocolFileError, find_cell, protocol_path, read_protocol, resolve
from ablations.tasks import TASKS
from pipelines import tracking
from pipelines.common import atomic_dir, eval0_path, eval_sets, load_instance, setup, write_json
from pipelines.plots import save_run_figure
from rlhf.config import PPOConfig
from rlhf.ppo import train_ppo


def to_csv(rows: list[dict]) -> str:
    """Rows of dicts (the first row's keys are the columns) as CSV text."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


# the arm's flat fields every summary.json has had (ablations/experiment.py); any other option appears only when on,
# so a cell without it keeps its summary.json byte for byte (the whole config is the nested ``config`` beside them)
ALWAYS = SUMMARY_ALWAYS


def _on(v) -> bool:
    return v is not None and v is not False and v != "token"


def cell_axes(cell: Cell, cfg: PPOConfig) -> dict:
    """What identifies a cell in summary.json, runs.csv and MLflow tags: task, kind, instance, seed, arm, its
    strength (coef; kl_target for matched cells) and the arm's spec (ablations.experiment.spec_of) as flat fields."""
    spec = {k: v for k, v in spec_of(cfg).items() if k in ALWAYS or _on(v)}
    coef = cell.kl.coef if cell.arm != "none" else 0.0
    return {
        "task": cell.task,
        "kind": cell.result_kind,
        "role": cell.role,
        "instance": cell.instance,
        "seed": cell.seed,
        "arm": cell.arm,
        "coef": coef,
        "kl_target": cell.kl_target,
        **{k: ("-" if v is None else v) for k, v in spec.items()},
    }


def resolved(params: Experiment, cell: Cell) -> Cell:
    """``cell`` with its KL config: a design cell takes its role's value from the calibration (protocol/<task>.json,
    a dependency of its stage); a clear error if the calibration has not run."""
    if cell.kind not in ROLE_CELL:
        return cell
    path = protocol_path(cell.task)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the calibration first (dvc repro {cell.task}_calibrate)")
    return resolve(cell, params, read_protocol(path))


class Loaded(NamedTuple):
    """A cell's inputs on ``device``, as its stage loads them."""

    cell: Cell  # resolved (a design cell has its KL config)
    cfg: PPOConfig
    data: dict
    task: object
    ref: object
    reward_model: object
    initial_eval: dict | None  # the instance's iteration-0 evaluation (``initial_eval``)


def initial_eval(cell: Cell) -> dict | None:
    """The iteration-0 evaluation of the cell's instance (pipelines/eval0.py, a dependency of its stage), or None
    when the cell's config differs from what it was made with (one line says so; the cell measures it itself)."""
    path = eval0_path(cell.task, cell.instance)
    if not path.is_file():
        stage = f"{cell.task}_{cell.chain}eval0@{cell.instance}"
        raise FileNotFoundError(f"{path} not found: run its stage first (dvc repro {stage})")
    made = json.loads(path.read_text())
    ours = {k: getattr(cell.config, k) for k in made["made_with"]}
    if ours != made["made_with"]:
        print(f"{cell.stage}: {path} was made with {made['made_with']}, this cell has {ours}: it measures iteration 0")
        return None
    return made["eval"]


def load_cell(params: Experiment, cell: Cell, device) -> Loaded:
    """The resolved cell, its config, data, task, SFT reference, (learned-reward task) reward model and the
    instance's iteration-0 evaluation."""
    cell = resolved(params, cell)
    model, learned = getattr(params, cell.task).model, TASKS[cell.task].learned_reward
    data, task, ref, reward_model = load_instance(cell.task, cell.instance, model, learned, device)
    cfg = cell.config  # built once, in the grid
    return Loaded(cell, cfg, data, task, ref, reward_model, initial_eval(cell))


def diagnostic_metrics(rows: list[dict]) -> dict[str, list[dict]]:
    """Gradient-diagnostic rows (rlhf.diagnostics) grouped into MLflow metric prefixes: ``diagnostics/<regime>/``
    against the frozen reference, ``diagnostics/<regime>_own/`` against the arm's own target (the report's regimes,
    ablations.diagnostics.own_regimes); the labels ``regime`` and ``against`` are the prefix, not metrics."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        own = "_own" if r.get("against") == "own" else ""
        metrics = {k: v for k, v in r.items() if k not in ("regime", "against")}
        groups.setdefault(f"diagnostics/{r['regime']}{own}/", []).append(metrics)
    return groups


def write_outputs(cell: Cell, axes: dict, out: dict, wall_s: float, client, rid) -> dict:
    """Logs a finished cell's ``train_ppo`` output ``out`` to its MLflow run and writes its outputs atomically;
    returns its summary (summary.json's content)."""
    summary = {"stage": cell.stage, **axes, "config": cell.config.model_dump(mode="json"), **out["summary"]}
    tracking.log_metrics(client, rid, out["history"], prefix="train/")
    tracking.log_metrics(client, rid, out["evals"], prefix="eval/")
    for prefix, rows in diagnostic_metrics(out["diagnostics"]).items():  # gradient diagnostics, if any
        tracking.log_metrics(client, rid, rows, prefix=prefix)
    final = {k: v for k, v in summary.items() if k.startswith(("final_", "peak_"))}
    tracking.log_final(client, rid, {**final, "wall_s": wall_s})
    with atomic_dir(cell.out_dir) as tmp:
        write_json(tmp / "summary.json", summary)
        (tmp / "evals.csv").write_text(to_csv(out["evals"]))
        (tmp / "history.csv").write_text(to_csv(out["history"]))
        diagnostics = to_csv(out["diagnostics"]) if out["diagnostics"] else "iteration,regime\n"  # none: a header
        (tmp / "diagnostics.csv").write_text(diagnostics)
        save_run_figure(out["evals"], cell.stage, tmp / "curves.png")
        client.log_artifact(rid, str(tmp / "curves.png"))
    return summary


def run_cell(params: Experiment, cell: Cell) -> dict:
    """Trains one cell and writes its outputs atomically. Returns its summary plus ``wall_s`` (seconds; not in
    summary.json, which must be the same on every rerun)."""
    device = setup()
    c = load_cell(params, cell, device)
    cell, cfg = c.cell, c.cfg
    axes = cell_axes(cell, cfg)
    with tracking.stage_run(cell.stage, params.mlflow.experiment, cfg.model_dump(), tags=axes) as (client, rid):
        start = time.perf_counter()
        with tqdm(total=cfg.iterations, desc=cell.stage, leave=False) as bar:
            out = train_ppo(
                copy.deepcopy(c.ref),
                c.ref,
                c.reward_model,
                c.task,
                c.data["train_prompts"].to(device),
                eval_sets(c.data, device),
                cfg,
                progress=lambda row: bar.update(),
                initial_eval=c.initial_eval,
            )
        wall_s = time.perf_counter() - start  # MLflow and the caller only: summary.json must be reproducible
        summary = write_outputs(cell, axes, out, wall_s, client, rid)
    return {**summary, "wall_s": wall_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", help="the cell's DVC stage name, e.g. grammar_fixed@0-reward_k1-0.1-0")
    args = ap.parse_args(argv)
    try:
        params = load_experiment()  # what to run (the runner has checked the whole file)
        cell = find_cell(params, args.stage)
    except (ParamsError, KeyError) as e:
        sys.exit(f"error: {e.args[0] if isinstance(e, KeyError) else e}")
    try:
        summary = run_cell(params, cell)
    except ProtocolFileError as e:
        sys.exit(f"error: {e}")
    shown = {k: summary[f"final_{k}"] for k in ("gold", "proxy", "ood_gold", "kl") if f"final_{k}" in summary}
    print(f"{summary['stage']}: " + " ".join(f"{k} {v:.3f}" for k, v in shown.items()), f"({summary['wall_s']:.1f}s)")


if __name__ == "__main__":
    main()
