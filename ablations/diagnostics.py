"""The gradient-diagnostic table of a task: each arm's KL-gradient estimate against the true sequence-KL gradient.

Input: the rows of every run's diagnostics.csv (ablations.load.load_diagnostics), one per run, checkpoint iteration
and regime (``on_policy``; ``off_policy`` after the arm's own epochs x minibatches - 1 updates), with the metrics of
rlhf/diagnostics.py (its docstring defines them): cosine (of the mean estimate: the bias-only cosine, read beside
its noise floor cosine_noise_floor) and cosine_minibatch (mean over
single minibatches) with the true gradient g*, scale <g-hat, g*>/|g*|^2, rel_bias |g-hat - g*|/|g*| with its
noise floor rel_bias_noise and the excess over it rel_bias_excess, and rel_var tr Var(g_m)/|g*|^2.

Aggregation, per arm and regime. The unit is the task instance, as everywhere in the analysis: the rows of one
instance (every run of the arm with diagnostics, whatever its kind, level or seed, at every checkpoint) are averaged
into one value per metric, leaving out NaN (the cosine is NaN when the estimate is exactly 0, e.g. a KL to the old
policy on-policy); then over instances: mean, SD, two-sided t CI at 1 - alpha, and n = instances with a finite
value. Pooling levels is sound because every metric is per unit coefficient; the level still moves the checkpoint
policy, which is why the report names the runs and checkpoints pooled. The no-KL arm is left out (it has no KL term:
its estimate is 0 by construction).

Order: by algorithm, target, estimator (k1, k2, k3, full; the straight-through k1+/k3+ right after k1/k3), placement
(reward, loss, both), then each option off before on (ablations.experiment.SPEC_OPTIONS: IS weight, aggregation,
both_split, return-to-go, clamp, moving reference, then the policy-loss options), then arm name; on-policy before
off-policy. So each estimator's placements sit together: reward-side k1
(the exact on-policy KL gradient through the returns) first, the loss-side k1 (a mean-zero gradient) right after it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ablations import stats as S
from ablations.experiment import SPEC_FIELDS, SPEC_OPTIONS, option_on
from ablations.load import BASELINE, spec_of
from rlhf.config import ALGORITHMS, ESTIMATORS, TARGETS

METRICS = (
    "cosine",
    "cosine_noise_floor",
    "cosine_minibatch",
    "scale",
    "rel_bias",
    "rel_bias_noise",
    "rel_bias_excess",
    "rel_var",
)
REGIMES = ("on_policy", "off_policy", "on_policy_own", "off_policy_own")
SPEC = SPEC_FIELDS  # the fields of an arm's spec (ablations.load.spec_of) the table shows and orders by
PLACEMENT_ORDER = ("reward", "loss", "both")


def is_off(field: str, v) -> bool:
    """A switched-off option of a typed spec: at its default (``option_on``); a field every arm sets is never off."""
    return field in SPEC_OPTIONS and not option_on(field, v)


def arm_spec(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per KL arm (first appearance order) with its SPEC fields, read from its runs' configs."""
    kl = runs[runs.arm != BASELINE].drop_duplicates("arm")
    rows = [{"arm": r["arm"], **{k: spec_of(r)[k] for k in SPEC}} for r in kl.to_dict("records")]
    return pd.DataFrame(rows, columns=["arm", *SPEC])


def own_regimes(diag: pd.DataFrame) -> pd.DataFrame:
    """Rows judged against the arm's own target (``against`` 'own': moving reference, old policy) get the regime
    '<regime>_own'; rows against the frozen reference (and rows written before ``against`` existed) keep theirs."""
    if "against" not in diag.columns or diag.empty:
        return diag
    own = diag.against.astype(str) == "own"
    return diag.assign(regime=diag.regime.where(~own, diag.regime.astype(str) + "_own"))


def instance_values(diag: pd.DataFrame) -> pd.DataFrame:
    """Per (arm, regime, instance): the NaN-ignoring mean of each metric over the instance's rows, the number of rows
    and of runs, and the off-policy updates."""
    diag = own_regimes(diag)
    d = diag[diag.arm != BASELINE]
    missing = [m for m in METRICS if m not in d.columns]  # rows written before a metric existed
    d = d.assign(**dict.fromkeys(missing, np.nan))
    if d.empty:
        return pd.DataFrame(columns=["arm", "regime", "instance", *METRICS, "rows", "runs", "updates"])
    g = d.groupby(["arm", "regime", "instance"], sort=False)
    out = g[list(METRICS)].mean()  # pandas' mean skips NaN
    out["rows"] = g.size()
    out["runs"] = g.stage.nunique()
    out["updates"] = g.updates.max()
    return out.reset_index()


def _rank(seq: tuple, v) -> int:
    return seq.index(v) if v in seq else len(seq)


def _order(spec: dict, arm: str, regime: str) -> tuple:
    """The sort key of the module docstring."""
    est = str(spec.get("estimator"))
    return (
        _rank(ALGORITHMS, spec.get("algorithm")),
        _rank(TARGETS, spec.get("target")),
        _rank(ESTIMATORS, est.rstrip("+")),
        est.endswith("+"),
        _rank(PLACEMENT_ORDER, spec.get("placement")),
        tuple(not is_off(k, spec.get(k)) for k in SPEC_OPTIONS),
        arm,
        _rank(REGIMES, regime),
    )


def table(diag: pd.DataFrame, runs: pd.DataFrame, level: float) -> pd.DataFrame:
    """One row per arm x regime with diagnostics: the arm's SPEC, regime, updates, instances, runs, rows, the
    checkpoints pooled, and per metric <m>_mean, <m>_sd, <m>_lo, <m>_hi (t CI at ``level``) and <m>_n; sorted."""
    iv = instance_values(diag)
    if iv.empty:
        return pd.DataFrame()
    diag = own_regimes(diag)
    specs = {r["arm"]: r for r in arm_spec(runs).to_dict("records")}
    d = diag[diag.arm != BASELINE]
    rows = []
    for (arm, regime), g in iv.groupby(["arm", "regime"], sort=False):
        raw = d[(d.arm == arm) & (d.regime == regime)]
        row = {**specs.get(arm, {"arm": arm}), "regime": regime, "updates": int(g.updates.max())}
        row |= {"instances": g.instance.nunique(), "runs": int(g.runs.sum()), "rows": int(g.rows.sum())}
        row["checkpoints"] = sorted(int(i) for i in raw.iteration.unique())
        for m in METRICS:
            v = g[m].to_numpy(float)
            v = v[np.isfinite(v)]
            lo, hi = S.ci(v, level) if len(v) else (np.nan, np.nan)
            row |= {f"{m}_mean": v.mean() if len(v) else np.nan, f"{m}_sd": v.std(ddof=1) if len(v) > 1 else np.nan}
            row |= {f"{m}_lo": float(lo), f"{m}_hi": float(hi), f"{m}_n": len(v)}
        rows.append(row)
    rows.sort(key=lambda r: _order(specs.get(r["arm"], {}), r["arm"], r["regime"]))
    return pd.DataFrame(rows)


def coverage(diag: pd.DataFrame, runs: pd.DataFrame) -> dict:
    """Which runs the table pools: KL-arm runs with and without diagnostics, the cells (kind, level) and seeds with
    diagnostics, and the checkpoint iterations."""
    kl_runs = runs[runs.arm != BASELINE]
    d = diag[diag.arm != BASELINE]
    cells = d.drop_duplicates(["kind", "level"])[["kind", "level"]].sort_values(["kind", "level"])
    return {
        "runs_with": int(d.stage.nunique()),
        "runs_total": len(kl_runs),
        "instances": sorted(int(i) for i in d.instance.unique()),
        "cells": [(k, None if pd.isna(lv) else float(lv)) for k, lv in cells.itertuples(index=False)],
        "checkpoints": sorted(int(i) for i in d.iteration.unique()),
    }
