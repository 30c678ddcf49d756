"""The containers the analysis fills and the report reads (no logic: kept apart so that analysis.py imports
report.py and report.py imports only this module, never the other way round)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ablations.config import AnalysisParams
from ablations.lock import LockStatus


@dataclass
class TaskResults:
    """Everything one task's report is made of (ablations/analysis.py analyse_task fills it).

    runs / evals: every run (summary.json fields) and every eval row. comparisons: Q2-Q4 rows incl. positive
    controls; restraint: Q1 rows; families: one record per family (positive control, exact floor); steering: Q3 hit
    rates; tuning: Q4 cross-fitting selections; collapse: collapse rate per cell; cells: cell summaries with the
    bimodality flag; factorial: placement x estimator tests; secondary: length and empty share; answers: one row per
    (question, metric) with the full-data answer, its split-half status and the reported answer; agreement: every
    verdict on the full data and on each half. diagnostics: gradient diagnostics per (arm, regime, instance);
    diagnostic_table: their aggregate per (arm, regime); diagnostic_coverage: the runs and checkpoints pooled
    (ablations/diagnostics.py; all empty when no run has diagnostics)."""

    task: str
    scope: str
    runs: pd.DataFrame
    evals: pd.DataFrame
    comparisons: pd.DataFrame
    restraint: pd.DataFrame
    families: pd.DataFrame
    steering: pd.DataFrame
    tuning: pd.DataFrame
    collapse: pd.DataFrame
    cells: pd.DataFrame
    factorial: pd.DataFrame
    crossed: str
    secondary: pd.DataFrame
    answers: pd.DataFrame
    agreement: pd.DataFrame
    halves: tuple[list, list]
    headline: str
    diagnostics: pd.DataFrame = field(default_factory=pd.DataFrame)
    diagnostic_table: pd.DataFrame = field(default_factory=pd.DataFrame)
    diagnostic_coverage: dict = field(default_factory=dict)


@dataclass
class Results:
    protocol: AnalysisParams
    tasks: dict[str, TaskResults] = field(default_factory=dict)
    lock: LockStatus | None = None
