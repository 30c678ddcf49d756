"""The analysis stage: does it matter where the KL penalty goes? Protocol v3 (params.yaml ``analysis``).

Every task is analysed separately. Its protocol was fixed on calibration instances by the ``<task>_calibrate`` stage
(protocol/<task>.json: margins, KL target, coefficients, the margin-sized control); the evaluation runs are judged
by it: the pre-registered primary questions by exact sequential tests (ablations/primary.py), which alone carry the
headline, then every other comparison the runs allow as exploratory families (ablations/questions.py), descriptive
tables (ablations/descriptive.py) and the gradient-diagnostic table (ablations/diagnostics.py). The run directories
come from the grid, as a list of ExpectedRun; nothing else is read, and a missing run stops the analysis naming its
stage.

Entry points: analyse(protocol, expected, root, lock, calibrated, order) -> Results; write_task(results, task,
out_dir) -> list[Path]; run(..., task) does both. ``lock`` is ablations.lock.protocol_lock(...) or None (then the
report says it was not checked); ``calibrated`` maps each task to its protocol/<task>.json document (with a
``frozen`` record: path, sha256, commit) and ``order`` each task to its evaluation instances in pre-registered order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ablations import descriptive as D
from ablations import diagnostics as G
from ablations import primary as P
from ablations import report
from ablations.config import AnalysisParams
from ablations.load import BASELINE, ExpectedRun, MissingResultsError, load_diagnostics, load_runs
from ablations.lock import LockStatus
from ablations.questions import answer_questions, collapse_table
from ablations.results import Results, TaskResults
from ablations.tasks import TASKS

__all__ = ["ExpectedRun", "MissingResultsError", "analyse", "run", "write_task"]

FIGURES = ("sequential.png", "gold_vs_kl.png", "learning_curves.png", "forest.png", "restraint.png")
TASK_OUTPUTS = ("stats.json", "comparisons.csv", "runs.csv", *(f"figures/{f}" for f in FIGURES), "answer.md",
                "report.md")  # fmt: skip
DIAGNOSTICS_FIGURE = "figures/diagnostics.png"  # written only when some run of the task has gradient diagnostics


def task_outputs(tr: TaskResults) -> list[str]:
    """The files write_task() writes for ``tr``: TASK_OUTPUTS, with DIAGNOSTICS_FIGURE before report.md when the task
    has gradient diagnostics (it lies in figures/, which the analysis stage declares as one DVC out)."""
    extra = [DIAGNOSTICS_FIGURE] if len(tr.diagnostic_table) else []
    return [*TASK_OUTPUTS[:-1], *extra, TASK_OUTPUTS[-1]]


def scope(runs: pd.DataFrame, task: str) -> str:
    """Which task, how many instances and seeds, which SFT/reward: written next to every claim."""
    inst = sorted(runs.instance.unique())
    seeds = runs[runs.arm == BASELINE].groupby("instance").seed.nunique()
    s = f"{seeds.min()}" if seeds.min() == seeds.max() else f"{seeds.min()}–{seeds.max()}"
    reward = "a learned proxy reward model" if TASKS[task].learned_reward else "an exact verifier reward"
    return (
        f"task {task}, {len(inst)} independent instances (task seeds {', '.join(map(str, inst))}: each its own data, "
        f"SFT policy and {reward}) × {s} PPO seed(s) each"
    )


def _check(runs: pd.DataFrame, protocol: AnalysisParams) -> None:
    """Every task of the runs must have a protocol, and every compared metric must be in every summary."""
    unknown = set(runs.task) - set(protocol.tasks)
    if unknown:
        raise ValueError(f"no analysis.tasks entry for task(s) {sorted(unknown)} (has {sorted(protocol.tasks)})")
    for task in dict.fromkeys(runs.task):
        tp, r = protocol.tasks[task], runs[runs.task == task]
        for m in tp.metrics:
            for col in (f"final_{m}", f"sft_{m}"):
                if col not in r or r[col].isna().any():
                    raise ValueError(f"task {task}: metric {m!r} is compared but some summary.json lacks {col}")
        if protocol.reference_arm not in set(r.arm):
            raise ValueError(f"task {task}: the reference arm {protocol.reference_arm} has no runs")


def judged(protocol: AnalysisParams, task: str, calibrated: dict) -> AnalysisParams:
    """``protocol`` with ``task``'s section replaced by its judged form (config.Judged: the calibrated margins)."""
    return protocol.model_copy(update={"tasks": {**protocol.tasks, task: protocol.judged(task, calibrated["margins"])}})


def analyse_task(
    runs: pd.DataFrame,
    evals: pd.DataFrame,
    task: str,
    protocol: AnalysisParams,
    calibrated: dict,
    order: Sequence[int],
    diagnostics: pd.DataFrame | None = None,
) -> TaskResults:
    """The primary questions, the exploratory families and the descriptive tables of one task; the
    gradient-diagnostic table from ``diagnostics`` (load_diagnostics rows of this task's runs; None or empty: the
    task has none). ``protocol`` is judged (``judged``)."""
    tp = protocol.tasks[task]
    runs = runs.assign(log_kl=np.log(runs.final_kl.where(runs.final_kl > 0)))
    prim = P.analyse(runs, evals, task, protocol, calibrated, calibrated["plan"], list(order))
    res = answer_questions(runs, task, protocol, tp)
    cells = D.cell_table(runs, task, protocol)
    return TaskResults(
        task=task,
        scope=scope(runs, task),
        runs=runs,
        evals=evals,
        protocol=calibrated,
        primary=prim["primary"],
        budget=prim["budget"],
        headline=prim["headline"],
        carried_by=prim["carried_by"],
        comparisons=res["comparisons"],
        restraint=res["restraint"],
        families=res["families"],
        steering=res["steering"],
        collapse=collapse_table(runs, tp, 1 - protocol.alpha),
        cells=cells,
        factorial=D.factorial(runs, cells, protocol),
        crossed=D.crossed_set(runs, protocol.reference_arm)[1],
        secondary=D.secondary(runs, protocol),
        **_diagnostics(runs, diagnostics, protocol),
    )


def _diagnostics(runs: pd.DataFrame, diag: pd.DataFrame | None, protocol: AnalysisParams) -> dict:
    """TaskResults' diagnostics fields (ablations/diagnostics.py); empty when no run has diagnostics."""
    if diag is None or diag.empty:
        return {}
    return dict(
        diagnostics=G.instance_values(diag),
        diagnostic_table=G.table(diag, runs, 1 - protocol.alpha),
        diagnostic_coverage=G.coverage(diag, runs),
    )


def analyse(
    protocol: AnalysisParams,
    expected: Sequence[ExpectedRun],
    root: Path | str = ".",
    lock: LockStatus | None = None,
    calibrated: dict | None = None,
    order: dict | None = None,
) -> Results:
    """Loads the expected runs under ``root`` and analyses each task they belong to (no files written), each with
    its calibrated protocol ``calibrated[task]`` and its evaluation instances in order ``order[task]``."""
    runs, evals = load_runs(expected, root)
    _check(runs, protocol)
    diag = load_diagnostics(runs, root)
    out = Results(protocol=protocol, lock=lock)
    for task in dict.fromkeys(runs.task):
        sel = runs.task == task
        proto = judged(protocol, task, calibrated[task])
        out.tasks[task] = analyse_task(
            runs[sel].reset_index(drop=True),
            evals[evals.task == task].reset_index(drop=True),
            task,
            proto,
            calibrated[task],
            order[task],
            diag[diag.task == task].reset_index(drop=True),
        )
        out.judged[task] = proto
        out.tasks[task].amendments = amendments(lock, out.tasks[task])
    return out


def amendments(lock: LockStatus | None, tr: TaskResults) -> list[dict]:
    """One row per (amendment, primary question): the verdict in the report before the amendment (from git) and
    now. Empty without a lock or amendments."""
    if lock is None or not lock.available or not lock.amendments or not lock.before:
        return []
    said = lambda r: f"{r.get('verdict')} ({r['status']})" if r.get("status") else r.get("verdict")
    extract = lambda doc: {q: said(r) for q, r in (doc.get("primary") or {}).items()}
    now = {r["comparison"]: said(r) for r in tr.primary}  # stats.json keys its rows by comparison
    return [
        {"commit": r.commit, "date": r.date, "keys": ", ".join(r.keys), "question": r.question, "before": r.before,
         "now": now.get(r.question) if r.question else None}
        for r in lock.amendment_rows(extract, now)
    ]  # fmt: skip


def write_task(res: Results, task: str, out_dir: Path | str) -> list[Path]:
    """Writes one task's task_outputs() into ``out_dir`` (its report.md last); returns them in that order."""
    from ablations import plots  # matplotlib only when writing

    tr, d = res.tasks[task], Path(out_dir)
    proto = res.judged.get(task, res.protocol)
    (d / "figures").mkdir(parents=True, exist_ok=True)
    images = plots.all_figures(tr, proto, d / "figures")
    tr.comparisons.to_csv(d / "comparisons.csv", index=False)
    tr.runs.drop(columns="config").to_csv(d / "runs.csv", index=False)  # the flat axes; configs: summary.json
    (d / "stats.json").write_text(json.dumps(report.task_stats(tr, res), indent=2) + "\n")
    (d / "answer.md").write_text(report.answer_block(tr, proto))
    (d / "report.md").write_text(report.render_task(tr, res, {k: v.relative_to(d).as_posix() for k, v in images}))
    return [d / f for f in task_outputs(tr)]


def run(
    protocol: AnalysisParams,
    expected: Sequence[ExpectedRun],
    out_dir: Path | str,
    root: Path | str = ".",
    lock: LockStatus | None = None,
    *,
    task: str,
    calibrated: dict,
    order: dict,
) -> list[Path]:
    """analyse() then write ``task``'s task_outputs() straight into ``out_dir`` (``expected`` holds that task's
    runs)."""
    res = analyse(protocol, expected, root, lock, calibrated, order)
    if list(res.tasks) != [task]:
        raise ValueError(f"run(task={task!r}) needs exactly that task's runs; got runs of {list(res.tasks)}")
    return write_task(res, task, out_dir)
