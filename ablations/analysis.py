"""The analysis stage: does it matter where the KL penalty goes? Protocol v2 (params.yaml ``analysis``).

Every task is analysed separately with the same protocol (ablations/questions.py: Q1 restraint, Q2 matched
coefficient, Q3 matched KL by construction, Q4 cross-fitted tuning, each with positive controls), then every question
is answered again on each half of the instances (ablations/answers.py), and the report is written per task
(ablations/report.py, ablations/plots.py), with the gradient-diagnostic table and figure of the runs that have
diagnostics (ablations/diagnostics.py; descriptive, outside the protocol). The run directories come from the grid, as
a list of ExpectedRun; nothing else is read, and a missing run stops the analysis naming its stage.

Entry points: analyse(protocol, expected, root, lock) -> Results; write_outputs(results, out_dir) -> list[Path]
(every task) or write_task(results, task, out_dir) (one task's folder); run(..., task=None) does both. ``lock`` is
ablations.lock.protocol_lock(...) or None (then the report says it was not checked).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ablations import answers as A
from ablations import descriptive as D
from ablations import diagnostics as G
from ablations import report
from ablations.config import AnalysisParams
from ablations.load import BASELINE, ExpectedRun, MissingResultsError, load_diagnostics, load_runs
from ablations.lock import LockStatus
from ablations.questions import answer_questions, collapse_table
from ablations.results import Results, TaskResults

__all__ = ["ExpectedRun", "MissingResultsError", "analyse", "output_paths", "run", "write_outputs", "write_task"]

FIGURES = ("gold_vs_kl.png", "learning_curves.png", "forest.png", "restraint.png")
TASK_OUTPUTS = ("stats.json", "comparisons.csv", "runs.csv", *(f"figures/{f}" for f in FIGURES), "report.md")
DIAGNOSTICS_FIGURE = "figures/diagnostics.png"  # written only when some run of the task has gradient diagnostics


def task_outputs(tr: TaskResults) -> list[str]:
    """The files write_task() writes for ``tr``: TASK_OUTPUTS, with DIAGNOSTICS_FIGURE before report.md when the task
    has gradient diagnostics (it lies in figures/, which the analysis stage declares as one DVC out)."""
    extra = [DIAGNOSTICS_FIGURE] if len(tr.diagnostic_table) else []
    return [*TASK_OUTPUTS[:-1], *extra, TASK_OUTPUTS[-1]]


def output_paths(tasks: Sequence[str]) -> list[str]:
    """The files write_outputs() always writes, relative to the output folder: <task>/... per task, then the index
    report.md and stats.json (the DVC outs and metrics of the analysis stage). A task with gradient diagnostics also
    gets <task>/figures/diagnostics.png (task_outputs)."""
    return [f"{t}/{f}" for t in tasks for f in TASK_OUTPUTS] + ["stats.json", "report.md"]


def scope(runs: pd.DataFrame, task: str) -> str:
    """Which task, how many instances and seeds, which SFT/reward: written next to every claim."""
    inst = sorted(runs.instance.unique())
    seeds = runs[runs.arm == BASELINE].groupby("instance").seed.nunique()
    s = f"{seeds.min()}" if seeds.min() == seeds.max() else f"{seeds.min()}–{seeds.max()}"
    learned = "final_proxy" in runs and runs.final_proxy.notna().any()
    reward = "a learned proxy reward model" if learned else "an exact verifier reward"
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
        for m in tp.margins:
            for col in (f"final_{m}", f"sft_{m}"):
                if col not in r or r[col].isna().any():
                    raise ValueError(f"task {task}: metric {m!r} has a margin but some summary.json lacks {col}")
        if protocol.reference_arm not in set(r.arm):
            raise ValueError(f"task {task}: the reference arm {protocol.reference_arm} has no runs")


def analyse_task(
    runs: pd.DataFrame,
    evals: pd.DataFrame,
    task: str,
    protocol: AnalysisParams,
    diagnostics: pd.DataFrame | None = None,
) -> TaskResults:
    """Every question, the split-half check and the descriptive tables of one task; the gradient-diagnostic table
    from ``diagnostics`` (load_diagnostics rows of this task's runs; None or empty: the task has none)."""
    tp = protocol.tasks[task]
    res = answer_questions(runs, task, protocol)
    full = A.answers(res, protocol, task)
    agreement, stability, halves = A.split_half(runs, task, protocol, res, full)
    answers = A.final_answers(full, stability).merge(
        stability[["question", "metric", "half_a", "half_b"]], on=["question", "metric"]
    )
    cells = D.cell_table(runs, task, protocol)
    return TaskResults(
        task=task,
        scope=scope(runs, task),
        runs=runs,
        evals=evals,
        comparisons=res["comparisons"],
        restraint=res["restraint"],
        families=res["families"],
        steering=res["steering"],
        tuning=res["tuning"],
        collapse=collapse_table(runs, tp, 1 - protocol.alpha),
        cells=cells,
        factorial=D.factorial(runs, res, cells, protocol),
        crossed=D.crossed_set(runs, protocol.reference_arm)[1],
        secondary=D.secondary(runs, protocol),
        answers=answers,
        agreement=agreement,
        halves=halves,
        headline=A.headline(answers),
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
    protocol: AnalysisParams, expected: Sequence[ExpectedRun], root: Path | str = ".", lock: LockStatus | None = None
) -> Results:
    """Loads the expected runs under ``root`` and analyses each task they belong to (no files written). The grid
    decides which tasks: all of them for one analysis stage, one task's runs for a per-task stage."""
    runs, evals = load_runs(expected, root)
    _check(runs, protocol)
    diag = load_diagnostics(runs, root)
    out = Results(protocol=protocol, lock=lock)
    for task in dict.fromkeys(runs.task):
        sel = runs.task == task
        out.tasks[task] = analyse_task(
            runs[sel].reset_index(drop=True),
            evals[evals.task == task].reset_index(drop=True),
            task,
            protocol,
            diag[diag.task == task].reset_index(drop=True),
        )
    return out


def write_task(res: Results, task: str, out_dir: Path | str) -> list[Path]:
    """Writes one task's task_outputs() into ``out_dir`` (its report.md last); returns them in that order."""
    from ablations import plots  # matplotlib only when writing

    tr, d = res.tasks[task], Path(out_dir)
    (d / "figures").mkdir(parents=True, exist_ok=True)
    images = plots.all_figures(tr, res.protocol, d / "figures")
    tr.comparisons.to_csv(d / "comparisons.csv", index=False)
    tr.runs.to_csv(d / "runs.csv", index=False)
    (d / "stats.json").write_text(json.dumps(report.task_stats(tr, res), indent=2) + "\n")
    (d / "report.md").write_text(report.render_task(tr, res, {k: v.relative_to(d).as_posix() for k, v in images}))
    return [d / f for f in task_outputs(tr)]


def write_outputs(res: Results, out_dir: Path | str) -> list[Path]:
    """Writes every task into <task>/ (write_task), then the index report.md and stats.json into ``out_dir``.
    Returns the paths in output_paths() order (plus each task's diagnostics figure, if any, in its place)."""
    out = Path(out_dir)
    written = [p for task in res.tasks for p in write_task(res, task, out / task)]
    (out / "stats.json").write_text(json.dumps(report.index_stats(res), indent=2) + "\n")
    (out / "report.md").write_text(report.render_index(res))
    return [*written, out / "stats.json", out / "report.md"]


def run(
    protocol: AnalysisParams,
    expected: Sequence[ExpectedRun],
    out_dir: Path | str,
    root: Path | str = ".",
    lock: LockStatus | None = None,
    task: str | None = None,
) -> list[Path]:
    """analyse() then write the outputs: with ``task`` (a per-task stage; ``expected`` holds that task's runs) its
    task_outputs() straight into ``out_dir``; without, write_outputs() (every task in a sub-folder, plus an index)."""
    res = analyse(protocol, expected, root, lock)
    if task is None:
        return write_outputs(res, out_dir)
    if list(res.tasks) != [task]:
        raise ValueError(f"run(task={task!r}) needs exactly that task's runs; got runs of {list(res.tasks)}")
    return write_task(res, task, out_dir)
