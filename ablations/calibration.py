"""Calibration: everything the protocol tunes is fixed on the calibration instances, before any evaluation cell runs.

The stage ``<task>_calibrate`` (pipelines/calibrate.py) reads only the calibration cells (their own task seeds,
disjoint from the evaluation instances: ablations/config.py refuses an overlap) and writes protocol/<task>.json,
the file every evaluation design cell depends on (dvc.yaml). Its rules are written in params.yaml
(``<task>.calibration``) before the calibration runs; given the cells, every value is a deterministic function:

* gain = mean over calibration instances of (G_i - SFT gold_i), G_i the no-KL run's ``gain`` gold: its peak over
  the held-out evaluations (evaluated every ``ppo.eval_every`` iterations) or its final gold. Instances average
  their PPO seeds first.
* margin(m) = ``margin_fraction`` x gain, for every compared metric m (the accuracy metrics of a task share units).
* KL target = ``target.fraction`` x the median over the no-KL runs of their exact KL at the gold peak (``at: peak``,
  the first evaluation with the run's highest gold) or at the end (``at: final``).
* best[arm] = the calibration coefficient with the highest mean final gold over the calibration instances (ties:
  the smaller coefficient), for every calibration arm. ``coef`` = best[reference arm]: the coefficient of Q1/Q2.
* the margin-sized positive control: among the other calibration coefficients, the one whose mean final gold
  differs from the reference arm's at ``coef`` by the amount closest to one margin (ties: the smaller
  coefficient). Its calibration effect and sign are recorded: the evaluation must detect it in that direction
  (reference arm at ``coef`` minus at ``control_coef``), also on log KL for Q1.
* the no-KL control's expected direction per primary metric (gold, log KL): sign of (no KL - reference arm at
  ``coef``) on calibration.

Pure functions of DataFrames (ablations/load.py load_runs output): no I/O here.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ablations.config import CalibrationParams


def _instance_mean(df: pd.DataFrame, col: str) -> pd.Series:
    """Per instance: the mean of ``col`` over the instance's PPO seeds."""
    return df.groupby("instance")[col].mean()


def no_kl_points(runs: pd.DataFrame, evals: pd.DataFrame) -> pd.DataFrame:
    """One row per calibration no-KL run: instance, seed, SFT gold, final gold and exact KL, and the peak (the first
    evaluation with the run's highest gold) with the exact KL there."""
    base = runs[runs.kind == "calibration_baseline"]
    rows = []
    for r in base.itertuples():
        ev = evals[(evals.kind == "calibration_baseline") & (evals.instance == r.instance) & (evals.seed == r.seed)]
        ev = ev.sort_values("iteration")
        k = int(np.argmax(ev.gold.to_numpy()))
        rows.append(dict(instance=r.instance, seed=r.seed, sft_gold=r.sft_gold, final_gold=r.final_gold,
                         final_kl=r.final_kl, peak_gold=float(ev.gold.iloc[k]), peak_kl=float(ev.kl.iloc[k]),
                         peak_iteration=int(ev.iteration.iloc[k])))  # fmt: skip
    return pd.DataFrame(rows)


def coef_table(runs: pd.DataFrame, column: str) -> pd.DataFrame:
    """arm x coefficient: the mean over calibration instances of ``column`` (instances average their seeds)."""
    cal = runs[runs.kind == "calibration"]
    per = cal.groupby(["arm", "level", "instance"])[column].mean()
    return per.groupby(["arm", "level"]).mean().unstack("level")


def best_coef(row: pd.Series) -> float:
    """The coefficient with the highest value (ties: the smaller coefficient)."""
    row = row.dropna()
    return float(row[row == row.max()].index.min())


def choose_control(gold: pd.Series, coef: float, margin: float) -> float:
    """Among the coefficients of ``gold`` (coef -> mean final gold of the reference arm) other than ``coef``, the
    one whose gold differs from gold[coef] by the amount closest to ``margin`` (ties: the smaller coefficient)."""
    others = gold.drop(coef).dropna()
    if others.empty:
        raise ValueError("the positive control needs a second calibration coefficient with results")
    dist = ((gold[coef] - others).abs() - margin).abs()
    return float(dist[dist == dist.min()].index.min())


def _sign(x: float) -> int:
    return 1 if x > 0 else -1 if x < 0 else 0


def calibrate(
    runs: pd.DataFrame,
    evals: pd.DataFrame,
    *,
    task: str,
    rules: CalibrationParams,
    reference_arm: str,
    arms: list[str],
    metrics: list[str],
) -> dict:
    """The protocol values of ``task`` from its calibration runs (module docstring). Returns a JSON-able dict."""
    pts = no_kl_points(runs, evals)
    if pts.empty:
        raise ValueError(f"task {task}: no calibration no-KL runs")
    inst = pts.groupby("instance").mean(numeric_only=True)
    gain = float((inst[f"{rules.gain}_gold"] - inst.sft_gold).mean())
    if not gain > 0:
        raise ValueError(f"task {task}: the no-KL runs gain no gold on calibration ({gain:.3g}): no margin scale")
    margin = rules.margin_fraction * gain
    kl_at = pts[f"{rules.target.at}_kl"]
    target = float(rules.target.fraction * kl_at.median())
    gold = coef_table(runs, "final_gold")
    missing = [a for a in arms if a not in gold.index]
    if missing:
        raise ValueError(f"task {task}: no calibration runs of arm(s) {', '.join(missing)}")
    best = {a: best_coef(gold.loc[a]) for a in arms}
    coef = best[reference_arm]
    control = choose_control(gold.loc[reference_arm], coef, margin)
    log_kl = coef_table(runs.assign(log_kl=np.log(runs.final_kl.clip(lower=1e-12))), "log_kl")
    ref_gold, ref_log_kl = gold.loc[reference_arm], log_kl.loc[reference_arm]
    base = runs[runs.kind == "calibration_baseline"]
    none_gold = float(_instance_mean(base, "final_gold").mean())
    none_log_kl = float(_instance_mean(base.assign(log_kl=np.log(base.final_kl.clip(lower=1e-12))), "log_kl").mean())
    control_effect = {"gold": float(ref_gold[coef] - ref_gold[control]),
                      "log_kl": float(ref_log_kl[coef] - ref_log_kl[control])}  # fmt: skip
    return {
        "task": task,
        "calibration_instances": sorted(int(i) for i in pts.instance.unique()),
        "rules": rules.model_dump(),
        "no_kl": {
            "sft_gold": float(inst.sft_gold.mean()),
            "peak_gold": float(inst.peak_gold.mean()),
            "final_gold": float(inst.final_gold.mean()),
            "peak_kl": [float(x) for x in pts.peak_kl],
            "final_kl": [float(x) for x in pts.final_kl],
            "peak_iteration": [int(x) for x in pts.peak_iteration],
            "gain": gain,
        },
        "margins": {m: margin for m in metrics},
        "kl_target": target,
        "coef": coef,
        "tuned": best,
        "control_coef": control,
        "control_effect": control_effect,
        "control_direction": {k: _sign(v) for k, v in control_effect.items()},
        "no_kl_direction": {
            "gold": _sign(none_gold - float(ref_gold[coef])),
            "log_kl": _sign(none_log_kl - float(ref_log_kl[coef])),
        },
        "calibration_gold": {a: {f"{c:g}": _num(v) for c, v in gold.loc[a].items()} for a in arms},
        "calibration_log_kl": {a: {f"{c:g}": _num(v) for c, v in log_kl.loc[a].items()} for a in arms},
    }


def _num(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)
