"""DVC stage `<task>_analysis`: reads the task's evaluation runs (runs/<task>/...) of the params.yaml grid and its
calibrated protocol (protocol/<task>.json, with the commit git has held it since), writes reports/<task>/.

    python -m pipelines.analysis grammar

Outputs (ablations.analysis.TASK_OUTPUTS) in reports/<task>/: report.md, answer.md (the README's answer block,
pipelines/readme.py), stats.json (DVC metrics), comparisons.csv, runs.csv and figures/. Everything is written to a
temporary sibling folder first and moved into place only when complete, so an interrupted run leaves the previous
report (or none), never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ablations import analysis
from ablations.config import PARAMS_FILE, ParamsError, load_params
from ablations.grid import evaluation_cells, plan_path, protocol_path
from ablations.load import ExpectedRun
from ablations.lock import protocol_lock, watched_keys
from pipelines import tracking

REPORTS_DIR = Path("reports")
# the code that decides (protocol v4): a change to it after results exist is an amendment, like a params change
DECIDING_CODE = tuple(
    f"ablations/{m}.py" for m in ("calibration", "comparisons", "plan", "primary", "protocol_params", "rule",
                                  "signtest", "simulate")
)  # fmt: skip


def frozen(root: Path, path: Path) -> dict:
    """The record of a protocol file: its path, sha256, and the commit from which git has held its current
    content (first-parent history; None when uncommitted or outside git)."""
    data = (root / path).read_bytes()
    rec = {"path": path.as_posix(), "sha256": hashlib.sha256(data).hexdigest(), "commit": None}
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, check=True).stdout
    try:
        commits = git("log", "--first-parent", "--format=%H", "--", path.as_posix()).decode().split()
        for h in commits:  # newest first: walk back while the content is unchanged
            if git("show", f"{h}:{path.as_posix()}") != data:
                break
            rec["commit"] = h
    except (OSError, subprocess.CalledProcessError):
        pass
    return rec


def main(
    task: str, params_file: Path | str = PARAMS_FILE, out_dir: Path | str | None = None, root: Path | str = "."
) -> list[Path]:
    """Runs the analysis of ``task``'s evaluation runs under ``root`` and moves its outputs into ``out_dir``
    (default reports/<task>); returns their paths."""
    params = load_params(params_file)
    root = Path(root)
    out = Path(out_dir) if out_dir is not None else REPORTS_DIR / task
    out.parent.mkdir(parents=True, exist_ok=True)
    path = protocol_path(task)
    if not (root / path).is_file():
        raise analysis.MissingResultsError(f"{path} not found: the calibration stage {task}_calibrate has not run")
    plan = plan_path(task)
    if not (root / plan).is_file():
        raise analysis.MissingResultsError(f"{plan} not found: the planning stage {task}_planning has not run")
    calibrated = {
        **json.loads((root / path).read_text()),
        "frozen": frozen(root, path),
        "plan": json.loads((root / plan).read_text()),
        "plan_frozen": frozen(root, plan),
    }
    config = {"analysis": params.analysis.model_dump(), "grid": params.grid.model_dump()}
    with tracking.stage_run(f"{task}_analysis", params.mlflow.experiment, config, tags={"task": task}) as (
        client,
        run_id,
    ):
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-tmp-") as tmp:
            task_cells = [c for c in evaluation_cells(params) if c.task == task]
            expected = [ExpectedRun(c.stage, c.out_dir) for c in task_cells]
            # every evaluation result must postdate the protocol; the calibration cells are what fixed it
            judged = {c.stage for c in task_cells}
            # every param a stage of the task declares, except its evaluation instances and their allocation to
            # design groups: appending the next batch (make settle) is the pre-registered sequential design, not a
            # change of protocol
            settled = (f"{task}.instances", f"{task}.allocation")
            watched = [k for k in watched_keys(root / "dvc.yaml", [f"{task}_"]) if not k.startswith(settled)]
            lock = protocol_lock(
                root,
                watched,
                judged,
                watched_files=[path.as_posix(), plan.as_posix(), *DECIDING_CODE],
                report_path=(REPORTS_DIR / task / "stats.json").as_posix(),
            )
            written = analysis.run(
                params.analysis,
                expected,
                tmp,
                root,
                lock,
                task=task,
                calibrated={task: calibrated},
                order={task: params.tasks()[task].instances},
            )
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
    (instances, runs) as metrics. Not one metric per comparison: the chart view would open on
    a bar chart of each. The counts' keys have no "/", so the UI files them under "Model metrics", after the curves.
    MLflow is only a mirror: the run directories were the input, reports/ is the output."""
    from mlflow.entities import RunTag

    stats = json.loads((out / "stats.json").read_text())
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in stats.items() if isinstance(v, str)])
    counts = {k: stats[k] for k in ("n_instances", "n_runs") if k in stats}
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
