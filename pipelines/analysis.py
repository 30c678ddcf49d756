"""DVC stage `<task>_analysis`: reads the task's evaluation runs (runs/<task>/...) of the params.yaml grid and its
calibrated protocol (protocol/<task>.json, with the commit git has held it since), writes reports/<task>/.

    python -m pipelines.analysis grammar

Outputs in reports/<task>/: report.md, answer.md (the README's answer block, pipelines/readme.py), stats.json
(everything the report states), comparisons.csv, runs.csv and figures/ (ablations.analysis.TASK_OUTPUTS); and the
views (ablations/plots.py write_views, METRICS): metrics.json, the task's only DVC metrics (the headline, each primary
question's verdict, estimate, CI and n, what calibration fixed: flat, identifier-safe keys, so `dvc metrics show`,
`dvc metrics diff` and `dvc exp show` stay readable), plots/*.json (DVC's top-level plots: gold by arm, the gold-KL
frontier, the paired differences) and their figures. Everything is written to a temporary sibling folder first and
moved into place only when complete, so an interrupted run leaves the previous report (or none), never half of one.
The MLflow run gets every output as an artifact and metrics.json as metrics and tags; the task's group run and the
sweep's run get metrics.json too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ablations import analysis
from ablations.config import PARAMS_FILE, ParamsError, load_params
from ablations.grid import ProtocolFileError, evaluation_cells, plan_path, protocol_path, read_protocol
from ablations.load import ExpectedRun
from ablations.lock import protocol_lock, watched_keys
from pipelines import tracking

REPORTS_DIR = Path("reports")
METRICS = "metrics.json"  # reports/<task>/metrics.json: the task's only DVC metrics
CALIBRATED = {"coef": "beta", "control_coef": "control_beta"}  # protocol key -> metric
QUESTION_FIELDS = ("verdict", "label", "estimate", "lo", "hi", "n", "cap")  # per comparison: <comparison>_<field>
SWEEP = ("_estimate", "n_instances")  # the numbers of metrics.json the sweep's MLflow run gets (a chart each)


def identifier(text: str) -> str:
    """``text`` as a metric key DVC, MLflow and a shell all take as is: letters, digits and underscores."""
    return re.sub(r"\W+", "_", str(text), flags=re.ASCII).strip("_") or "_"


def headline_metrics(primary: list[dict], headline: str, budget: dict, n_instances: int, protocol: dict) -> dict:
    """metrics.json: the headline, each primary comparison's verdict, label, estimate, CI (lo, hi, at the level its
    look spent), n and planned cap, the number of instances, the error budget's alpha, and what calibration fixed (the
    reference arm's β where the penalty acts, the control's β, the frontier's KL levels, each margin, each tuned
    arm's β). Flat keys, the same in every task's file
    (`dvc metrics show` lines the tasks up, one row each; `dvc exp show` names a column ``<file>:<key>``), generic
    over the questions ``analyse`` returned. A number that is not finite is left out (a question not yet decided
    has no CI)."""
    out: dict = {"headline": headline}
    for row in primary:
        q = identifier(row["comparison"])
        for f in QUESTION_FIELDS:
            out[f"{q}_{f}"] = row.get(f)
    out |= {"n_instances": int(n_instances), "alpha": budget.get("alpha")}
    out |= {name: protocol.get(key) for key, name in CALIBRATED.items()}
    out |= {f"kl_level_{k}": v for k, v in enumerate(protocol.get("levels") or [], 1)}
    out |= {f"margin_{identifier(m)}": v for m, v in (protocol.get("margins") or {}).items()}
    out |= {f"beta_{identifier(arm)}": v for arm, v in (protocol.get("tuned") or {}).items()}
    keep = lambda v: isinstance(v, str) or (isinstance(v, int | float) and math.isfinite(v))
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in out.items() if v is not None and keep(v)}


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
        **read_protocol(root / path),
        "frozen": frozen(root, path),
        "plan": read_protocol(root / plan),
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
            order = {task: params.tasks()[task].instances}
            res = analysis.analyse(params.analysis, expected, root, lock, {task: calibrated}, order)
            if list(res.tasks) != [task]:
                raise ValueError(f"analysis of {task} got runs of {list(res.tasks)}")
            views = write_views(res.tasks[task], calibrated, Path(tmp))
            written = views + analysis.write_task(res, task, tmp)  # report.md last
            produced = [f.relative_to(tmp) for f in written]
            for rel in produced:  # same file system: each move is atomic; report.md comes last
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(Path(tmp) / rel, out / rel)
        written = [out / rel for rel in produced]
        log_to_mlflow(client, run_id, out, written)
    return written


def write_views(tr, calibrated: dict, folder: Path) -> list[Path]:
    """metrics.json and the plots' data and figures (ablations/plots.py write_views) of one task into ``folder``."""
    from ablations import plots

    metrics = headline_metrics(tr.primary, tr.headline, tr.budget, tr.runs.instance.nunique(), calibrated)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METRICS).write_text(json.dumps(metrics, indent=2, ensure_ascii=False) + "\n")
    return [folder / METRICS, *plots.write_views(tr, folder)]


def log_headline(client, run_id: str, metrics: dict) -> None:
    """metrics.json on a run: its numbers as metrics, its strings (headline, verdicts) as tags. The keys have no
    "/", so the UI files the metrics under "Model metrics", after the curves."""
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in metrics.items() if isinstance(v, str)])
    tracking.log_final(client, run_id, {k: v for k, v in metrics.items() if not isinstance(v, str | bool)})


def log_to_mlflow(client, run_id: str, out: Path, written: list[Path]) -> None:
    """Mirrors the report into the analysis run: every output as an artifact, the comparisons as a table
    (``comparisons.json``), metrics.json (headline and verdicts as tags, numbers as metrics: a few per question, not
    one per comparison, or the chart view would open on a bar chart of each). The same metrics go on the task's group
    run, and on the sweep's run (keys prefixed ``<task>_``), with a link to the report. MLflow is only a mirror: the run
    directories were the input, reports/ is the output. The sweep's run gets the headline, verdicts and estimates
    only: the runs page's default chart view, which shows the sweep with its runs folded, draws one chart per
    metric."""
    metrics = json.loads((out / METRICS).read_text()) if (out / METRICS).is_file() else {}
    log_headline(client, run_id, metrics)
    tracking.log_csv_table(client, run_id, out / "comparisons.csv", "comparisons.json", first=("label", "verdict"))
    for path in written:
        sub = path.parent.relative_to(out)
        client.log_artifact(run_id, str(path), artifact_path=None if sub == Path(".") else str(sub))
    run = client.get_run(run_id)
    task, group = run.data.tags.get("task"), run.data.tags.get(tracking.PARENT_TAG)
    if group and client.get_run(group).data.tags.get(tracking.TASK_GROUP_TAG):
        log_headline(client, group, metrics)
    sweep = os.environ.get(tracking.PARENT_ENV)
    if sweep and task:  # the answer only, keys prefixed with the task: headline and verdicts, each estimate
        t = identifier(task)
        answer = {f"{t}_{k}": v for k, v in metrics.items() if isinstance(v, str) or k.endswith(SWEEP)}
        log_headline(client, sweep, answer)
        link = f"#/experiments/{run.info.experiment_id}/runs/{run_id}/artifacts/report.md"
        client.set_tag(sweep, f"{t}_report", f"reports/{task}/report.md")
        note = client.get_run(sweep).data.tags.get(tracking.RUN_NOTE_TAG, "")
        line = f"- `{task}`: **{metrics.get('headline', '?')}**: [report]({link}) (`reports/{task}/report.md`)"
        if line not in note:
            head = note or "Each task's answer (metrics `<task>_*`; its analysis run holds the report and figures):"
            client.set_tag(sweep, tracking.RUN_NOTE_TAG, f"{head}\n{line}")


if __name__ == "__main__":
    try:
        written = main(*sys.argv[1:2])
    except (ParamsError, analysis.MissingResultsError, ProtocolFileError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(map(str, written)))
