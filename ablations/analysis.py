"""The analysis stage: does it matter where the KL penalty goes? Protocol v2 (params.yaml ``analysis``).

Every task is analysed separately with the same protocol (ablations/questions.py: Q1 restraint, Q2 matched
coefficient, Q3 matched KL by construction, Q4 cross-fitted tuning, each with positive controls), then every question
is answered again on each half of the instances (ablations/answers.py), and the report is written per task
(ablations/report.py, ablations/plots.py). The run directories come from the grid, as a list of ExpectedRun; nothing
else is read, and a missing run stops the analysis naming its stage.

Entry points: analyse(protocol, expected, root, lock) -> Results; write_outputs(results, out_dir) -> list[Path];
run(...) does both. ``lock`` is ablations.lock.protocol_lock(...) or None (then the report says it was not checked).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ablations import answers as A
from ablations import descriptive as D
from ablations import report
from ablations.config import AnalysisParams
from ablations.load import BASELINE, ExpectedRun, MissingResultsError, load_runs
from ablations.lock import LockStatus
from ablations.questions import answer_questions, collapse_table
from ablations.results import Results, TaskResults

__all__ = ["ExpectedRun", "MissingResultsError", "analyse", "output_paths", "run", "write_outputs"]

FIGURES = ("gold_vs_kl.png", "learning_curves.png", "forest.png", "restraint.png")
TASK_OUTPUTS = ("stats.json", "comparisons.csv", "runs.csv", *(f"figures/{f}" for f in FIGURES), "report.md")


def output_paths(tasks: Sequence[str]) -> list[str]:
    """Every file write_outputs() writes, relative to the output folder: <task>/... per task, then the index
    report.md and stats.json (the DVC outs and metrics of the analysis stage)."""
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
    """The protocol and the runs must name the same tasks, and every compared metric must be in every summary."""
    have, want = set(runs.task), set(protocol.tasks)
    if have != want:
        raise ValueError(f"analysis.tasks names {sorted(want)} but the expected runs are of tasks {sorted(have)}")
    for task, tp in protocol.tasks.items():
        r = runs[runs.task == task]
        for m in tp.margins:
            for col in (f"final_{m}", f"sft_{m}"):
                if col not in r or r[col].isna().any():
                    raise ValueError(f"task {task}: metric {m!r} has a margin but some summary.json lacks {col}")
        if protocol.reference_arm not in set(r.arm):
            raise ValueError(f"task {task}: the reference arm {protocol.reference_arm} has no runs")


def analyse_task(runs: pd.DataFrame, evals: pd.DataFrame, task: str, protocol: AnalysisParams) -> TaskResults:
    """Every question, the split-half check and the descriptive tables of one task."""
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
    )


def analyse(
    protocol: AnalysisParams, expected: Sequence[ExpectedRun], root: Path | str = ".", lock: LockStatus | None = None
) -> Results:
    """Loads the expected runs under ``root`` and analyses every task of the protocol (no files written)."""
    runs, evals = load_runs(expected, root)
    _check(runs, protocol)
    out = Results(protocol=protocol, lock=lock)
    for task in protocol.tasks:
        sel = runs.task == task
        out.tasks[task] = analyse_task(
            runs[sel].reset_index(drop=True), evals[evals.task == task].reset_index(drop=True), task, protocol
        )
    return out


def write_outputs(res: Results, out_dir: Path | str) -> list[Path]:
    """Writes output_paths() into ``out_dir``; each task's report.md is written after its tables and figures, the
    index last. Returns the paths in output_paths() order."""
    from ablations import plots  # matplotlib only when writing

    out = Path(out_dir)
    for task, tr in res.tasks.items():
        d = out / task
        (d / "figures").mkdir(parents=True, exist_ok=True)
        images = plots.all_figures(tr, res.protocol, d / "figures")
        tr.comparisons.to_csv(d / "comparisons.csv", index=False)
        tr.runs.to_csv(d / "runs.csv", index=False)
        (d / "stats.json").write_text(json.dumps(report.task_stats(tr, res), indent=2) + "\n")
        (d / "report.md").write_text(report.render_task(tr, res, {k: v.relative_to(d).as_posix() for k, v in images}))
    (out / "stats.json").write_text(json.dumps(report.index_stats(res), indent=2) + "\n")
    (out / "report.md").write_text(report.render_index(res))
    return [out / p for p in output_paths(list(res.tasks))]


def run(
    protocol: AnalysisParams,
    expected: Sequence[ExpectedRun],
    out_dir: Path | str,
    root: Path | str = ".",
    lock: LockStatus | None = None,
) -> list[Path]:
    """analyse() then write_outputs()."""
    return write_outputs(analyse(protocol, expected, root, lock), out_dir)
