"""DVC stage `<task>_analysis`: reads the task's runs (runs/<task>/...) of the params.yaml grid, writes reports/<task>/.

    python -m pipelines.analysis grammar

Outputs (ablations.analysis.TASK_OUTPUTS) in reports/<task>/: report.md, stats.json (DVC metrics), comparisons.csv,
runs.csv and figures/. Everything is written to a temporary sibling folder first and moved into place only when
complete, so an interrupted run leaves the previous report (or none), never half of one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ablations import analysis
from ablations.config import PARAMS_FILE, ParamsError, load_params
from ablations.grid import cells
from ablations.load import ExpectedRun
from ablations.lock import protocol_lock
from pipelines import tracking

REPORTS_DIR = Path("reports")


def protocol_keys(task: str) -> list[str]:
    """The params.yaml keys of the pre-registered protocol the lock watches: the analysis section and the design
    values it judges (coefficients, KL targets, and the controller that steers the matched-KL cells)."""
    return ["analysis", f"{task}.coefs", f"{task}.kl_targets", "grid.matched"]


def main(
    task: str, params_file: Path | str = PARAMS_FILE, out_dir: Path | str | None = None, root: Path | str = "."
) -> list[Path]:
    """Runs the analysis of ``task``'s runs under ``root`` and moves its outputs into ``out_dir`` (default
    reports/<task>); returns their paths."""
    params = load_params(params_file)
    out = Path(out_dir) if out_dir is not None else REPORTS_DIR / task
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"analysis": params.analysis.model_dump(), "grid": params.grid.model_dump()}
    with tracking.stage_run(f"{task}_analysis", params.mlflow.experiment, config, tags={"task": task}) as (
        client,
        run_id,
    ):
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-tmp-") as tmp:
            task_cells = [c for c in cells(params) if c.task == task]
            expected = [ExpectedRun(c.stage, c.out_dir) for c in task_cells]
            # the KL targets are chosen from the no-KL runs, so only the KL arms' results must postdate the protocol
            judged = {c.stage for c in task_cells if c.kind != "baseline"}
            lock = protocol_lock(root, protocol_keys(task), judged)
            written = analysis.run(params.analysis, expected, tmp, root, lock, task=task)
            produced = [f.relative_to(tmp) for f in written]
            for rel in produced:  # same file system: each move is atomic; report.md comes last
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(Path(tmp) / rel, out / rel)
        written = [out / rel for rel in produced]
        log_to_mlflow(client, run_id, out, written)
    return written


def log_to_mlflow(client, run_id: str, out: Path, written: list[Path]) -> None:
    """Mirrors the report into the analysis run: every output as an artifact, the comparisons as a table
    (``comparisons.json``), stats.json's top-level strings (the headline answer) as tags, and a few counts
    (instances, runs, split-half agreement) as metrics. Not one metric per comparison: the chart view would open on
    a bar chart of each. The counts' keys have no "/", so the UI files them under "Model metrics", after the curves.
    MLflow is only a mirror: the run directories were the input, reports/ is the output."""
    from mlflow.entities import RunTag

    stats = json.loads((out / "stats.json").read_text())
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in stats.items() if isinstance(v, str)])
    counts = {k: stats[k] for k in ("n_instances", "n_runs", "split_half") if k in stats}
    tracking.log_final(client, run_id, tracking.flatten_numbers(counts))
    tracking.log_csv_table(client, run_id, out / "comparisons.csv", "comparisons.json", first=("label", "verdict"))
    for path in written:
        sub = path.parent.relative_to(out)
        client.log_artifact(run_id, str(path), artifact_path=None if sub == Path(".") else str(sub))


if __name__ == "__main__":
    try:
        written = main(*sys.argv[1:2])
    except (ParamsError, analysis.MissingResultsError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(map(str, written)))
