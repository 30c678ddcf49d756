"""Reads the run directories the grid expects (and only those) into tables for the analysis.

Layout (one directory per run, each with summary.json, evals.csv and history.csv):

    runs/<task>/baseline/<instance>-<seed>/               the no-KL arm (arm "none")
    runs/<task>/design/<instance>-<arm>-<role>-<seed>/    a KL arm at a calibrated role (kind fixed, or matched)
    runs/<task>/fixed/<instance>-<arm>-<coef>-<seed>/     a KL arm at a fixed coefficient
    runs/<task>/matched/<instance>-<arm>-<target>-<seed>/ a KL arm steered by the adaptive controller to a KL target
    runs/<task>/calibration_baseline/<instance>-<seed>/   the calibration instances' no-KL arm
    runs/<task>/calibration/<instance>-<arm>-<coef>-<seed>/  a calibration arm at a calibration coefficient
    runs/<task>/plan_baseline/<instance>-<seed>/          the planning instances' no-KL arm
    runs/<task>/plan/<instance>-<arm>-<role>-<seed>/      a design entry on a planning instance

The caller (the grid) supplies the expected runs as ExpectedRun(stage, path); a stale directory that is not
expected is never read. A missing, unreadable or mislabelled run raises MissingResultsError naming every such stage.
A run's diagnostics.csv (gradient diagnostics) is optional: load_diagnostics reads it when present.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ablations.experiment import BASELINE
from ablations.experiment import spec_of as arm_spec
from rlhf.config import PPOConfig

KINDS = ("baseline", "fixed", "matched", "calibration_baseline", "calibration", "plan_baseline")
BASELINE_KINDS = ("baseline", "calibration_baseline", "plan_baseline")
REQUIRED = ("task", "kind", "instance", "seed", "arm", "coef", "kl_target", "config", "final_gold", "final_kl")
EVAL_COLUMNS = ("iteration", "gold", "kl")


class MissingResultsError(FileNotFoundError):
    """Expected runs have no (or unreadable, or someone else's) results; the message names every such stage."""


@dataclass(frozen=True)
class ExpectedRun:
    """One run the grid expects: its DVC stage name (named in errors) and its directory relative to the root."""

    stage: str
    path: Path


def level_of(summary: dict) -> float | None:
    """The run's level: the coefficient (fixed), the KL target (matched), None for the baseline."""
    kind = summary["kind"]
    if kind in ("fixed", "calibration"):
        return float(summary["coef"])
    if kind == "matched":
        return float(summary["kl_target"])
    return None


def _check_layout(path: Path, s: dict) -> str | None:
    """None if ``path`` is runs/<task>/<kind>/<name> for the run ``s`` describes, else what does not match."""
    if s["kind"] not in KINDS:
        return f"kind {s['kind']!r} is not one of {KINDS}"
    parts = path.name.split("-")
    expect = 2 if s["kind"] in BASELINE_KINDS else 4
    role = s.get("role")
    try:
        ok = (
            (path.parent.name in ("design", "plan") if role else path.parent.name == s["kind"])
            and path.parent.parent.name == s["task"]
            and len(parts) == expect
            and int(parts[0]) == int(s["instance"])
            and int(parts[-1]) == int(s["seed"])
            and (s["arm"] == BASELINE if expect == 2 else parts[1] == s["arm"])
            and (expect == 2 or (parts[2] == role if role else math.isclose(float(parts[2]), level_of(s))))
        )
    except ValueError:
        ok = False
    if ok:
        return None
    return (
        f"holds task={s['task']} kind={s['kind']} instance={s['instance']} arm={s['arm']} "
        f"level={level_of(s)} seed={s['seed']}"
    )


def _read(run: ExpectedRun, root: Path) -> tuple[dict, pd.DataFrame]:
    """summary.json and evals.csv (sorted by iteration) of one run; MissingResultsError naming its stage."""
    d = root / run.path
    sp, ep = d / "summary.json", d / "evals.csv"
    for p in (sp, ep, d / "history.csv"):
        if not p.is_file():
            raise MissingResultsError(f"stage {run.stage}: {p} not found")
    try:
        summary = json.loads(sp.read_text())
        evals = pd.read_csv(ep)
        if "config" in summary:  # the run's whole config, typed again (pipelines/ppo.py wrote it)
            summary["config"] = PPOConfig.model_validate(summary["config"])
    except (OSError, ValueError) as e:
        raise MissingResultsError(f"stage {run.stage}: cannot read {d}: {e}") from None
    lacking = [k for k in REQUIRED if k not in summary] + [c for c in EVAL_COLUMNS if c not in evals.columns]
    first = evals[evals.iteration == 0] if "iteration" in evals else evals.iloc[:0]
    for c in evals.columns.drop("iteration", errors="ignore"):  # sft_<m>: the iteration-0 eval is the SFT policy
        if f"sft_{c}" not in summary and len(first):
            summary[f"sft_{c}"] = float(first[c].iloc[0])
    if "sft_gold" not in summary:
        lacking.append("sft_gold (or an iteration-0 row in evals.csv)")
    if lacking:
        raise MissingResultsError(f"stage {run.stage}: {d} lacks {', '.join(lacking)}")
    wrong = _check_layout(Path(run.path), summary)
    if wrong:
        raise MissingResultsError(f"stage {run.stage}: {sp} {wrong}; rerun the stage")
    if evals.empty:
        raise MissingResultsError(f"stage {run.stage}: {ep} has no rows")
    return summary, evals.sort_values("iteration").reset_index(drop=True)


def load_runs(expected: Sequence[ExpectedRun], root: Path | str = ".") -> tuple[pd.DataFrame, pd.DataFrame]:
    """Reads every expected run under ``root``. Returns (runs, evals): one row per run with every summary.json field
    plus ``stage``, ``path`` and ``level``; every eval row tagged with task, kind, instance, seed, arm and level.
    ``config`` is the run's PPOConfig (typed). Raises MissingResultsError naming every stage without usable results, or
    ValueError if an arm's spec differs between its runs of one kind."""
    root = Path(root)
    rows, evals, problems = [], [], []
    for run in expected:
        try:
            s, ev = _read(run, root)
        except MissingResultsError as e:
            problems.append((run.stage, str(e)))
            continue
        key = dict(task=s["task"], kind=s["kind"], instance=int(s["instance"]), seed=int(s["seed"]), arm=s["arm"])
        rows.append({**s, **key, "stage": run.stage, "path": str(run.path), "level": level_of(s)})
        evals.append(ev)
    if problems:
        details = "\n  ".join(p for _, p in problems[:12]) + ("\n  ..." if len(problems) > 12 else "")
        raise MissingResultsError(
            f"analysis needs every expected run; {len(problems)} stage(s) have no usable results "
            f"(run `dvc repro` for them): {', '.join(s for s, _ in problems)}\n  {details}"
        )
    if not rows:
        raise MissingResultsError("analysis needs at least one run; none was expected")
    runs = pd.DataFrame(rows)
    for (task, kind, arm), g in runs.groupby(["task", "kind", "arm"]):
        specs = {tuple(sorted(spec_of(r).items())) for r in g.to_dict("records")}
        if len(specs) > 1:
            raise ValueError(f"task {task}: {kind} runs of arm {arm} have different specs: {sorted(specs)}")
    tags = runs[["task", "kind", "instance", "seed", "arm", "level"]].to_numpy()
    ev = pd.concat(evals, ignore_index=True)
    rep = np.repeat(np.arange(len(runs)), [len(e) for e in evals])
    for j, c in enumerate(("task", "kind", "instance", "seed", "arm", "level")):
        ev[c] = tags[rep, j]
    return runs, ev.astype({"instance": int, "seed": int, "level": float})


def spec_of(row: dict) -> dict:
    """The arm's spec of a run (a load_runs row): its config's KL without the strength, and the PPO values an arm
    may replace (ablations.config.spec_of), typed."""
    return arm_spec(row["config"])


# ---------------------------------------------------------------- gradient diagnostics

DIAGNOSTICS_FILE = "diagnostics.csv"
# what rlhf/diagnostics.py writes per row (pipelines/ppo.py: one row per checkpoint iteration and regime)
DIAGNOSTIC_COLUMNS = (
    "iteration", "regime", "updates", "strength", "against", "cosine", "cosine_noise_floor", "cosine_minibatch",
    "scale", "rel_bias", "rel_bias_noise", "rel_bias_excess", "rel_var", "true_norm", "true_rel_se",
)  # fmt: skip
RUN_TAGS = ("task", "kind", "instance", "seed", "arm", "level", "stage")


def load_diagnostics(runs: pd.DataFrame, root: Path | str = ".") -> pd.DataFrame:
    """The gradient-diagnostic rows of every run in ``runs`` (load_runs' table, which has each run's ``path``): one
    row per run, checkpoint iteration and regime with DIAGNOSTIC_COLUMNS, tagged with RUN_TAGS.

    A run contributes no rows when its diagnostics.csv is header-only ("iteration,regime": the cell ran with
    diagnostics off) or ABSENT. Absent is read as "no diagnostics", not as a missing result, because cells written
    before diagnostics.csv existed (before commit 950ad8a) lack it, and load_runs has already checked that the run
    itself is complete (a cell's files are written together, atomically). A file that exists but cannot be parsed,
    or has rows but lacks a column, raises MissingResultsError naming every such stage."""
    root = Path(root)
    frames, problems = [], []
    for r in runs.to_dict("records"):
        p = root / r["path"] / DIAGNOSTICS_FILE
        if not p.is_file():
            continue
        try:
            d = pd.read_csv(p)
        except (OSError, ValueError) as e:
            problems.append(f"stage {r['stage']}: cannot read {p}: {e}")
            continue
        if d.empty:
            continue
        lacking = [c for c in DIAGNOSTIC_COLUMNS if c not in d.columns]
        if lacking:
            problems.append(f"stage {r['stage']}: {p} lacks {', '.join(lacking)}")
            continue
        frames.append(d[list(DIAGNOSTIC_COLUMNS)].assign(**{k: r[k] for k in RUN_TAGS}))
    if problems:
        raise MissingResultsError(
            f"{len(problems)} run(s) have an unusable {DIAGNOSTICS_FILE} (rerun the stage):\n  " + "\n  ".join(problems)
        )
    if not frames:
        return pd.DataFrame(columns=[*RUN_TAGS, *DIAGNOSTIC_COLUMNS])
    out = pd.concat(frames, ignore_index=True)
    return out[[*RUN_TAGS, *DIAGNOSTIC_COLUMNS]].astype({"instance": int, "seed": int, "iteration": int})
