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

    runs / evals: every evaluation run (summary.json fields) and every eval row. protocol: the calibrated
    protocol (protocol/<task>.json) with its ``frozen`` record (file, sha256, commit). primary: one dict per primary
    question (ablations/primary.py: verdict, status, the look that decided it, controls, the t-test beside, the
    path of looks); budget: the error budget; headline: from the primary questions alone. Exploratory:
    comparisons (Q2, Q3 rows incl. positive controls), restraint (Q1 rows), families (one record per family),
    steering (Q3 hit rates), collapse (per cell), cells (cell summaries with the bimodality flag), factorial
    (placement x estimator tests), secondary (length and empty share). diagnostics: gradient diagnostics per
    (arm, regime, instance); diagnostic_table: their aggregate per (arm, regime); diagnostic_coverage: the runs and
    checkpoints pooled (ablations/diagnostics.py; all empty when no run has diagnostics)."""

    task: str
    scope: str
    runs: pd.DataFrame
    evals: pd.DataFrame
    protocol: dict
    primary: list[dict]
    budget: dict
    headline: str
    carried_by: list[str]
    comparisons: pd.DataFrame
    restraint: pd.DataFrame
    families: pd.DataFrame
    steering: pd.DataFrame
    collapse: pd.DataFrame
    cells: pd.DataFrame
    factorial: pd.DataFrame
    crossed: str
    secondary: pd.DataFrame
    diagnostics: pd.DataFrame = field(default_factory=pd.DataFrame)
    diagnostic_table: pd.DataFrame = field(default_factory=pd.DataFrame)
    diagnostic_coverage: dict = field(default_factory=dict)
    amendments: list[dict] = field(default_factory=list)


@dataclass
class Results:
    protocol: AnalysisParams
    tasks: dict[str, TaskResults] = field(default_factory=dict)
    lock: LockStatus | None = None
    judged: dict[str, AnalysisParams] = field(default_factory=dict)  # per task: the protocol with its margins
