"""The sample-size plan of protocol v4: each primary comparison's cap, from its own noise on the planning instances.

The planning instances (``<task>.calibration.plan_instances``, disjoint from the calibration and the evaluation
instances) run every design cell once, at the values the calibration fixed. Per comparison, their per-instance rows
-- its difference d_i, its margin-sized control c_i and its no-KL contrast e_i (ablations/comparisons.py) -- are
resampled as whole instances (skew, ties and the correlation of d, c and e kept) and the WHOLE sequential rule
(ablations/rule.py: sign test of the median, controls in the rule, alpha/K spent over the reachable looks) is run on
them (ablations/simulate.py ``plan_cap``). The comparison's cap is the fewest instances (whole batches, at most
``analysis.sequential.max_cap``) at which the rule settles a true difference of ``effect`` margins, of either sign,
with probability >= ``power``; where even ``max_cap`` does not reach it, the cap is ``max_cap`` and the plan says
so (``reached`` false, with the power it has there). A comparison stops getting instances when it is settled or
reaches its cap (``make settle``: per-question allocation). The plan is fixed, with the calibration, before any
evaluation cell runs; it depends only on the planning instances.

Pure functions: the stage pipelines/plan.py reads the runs and writes protocol/<task>.plan.json.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from ablations import signtest as ST
from ablations import simulate as S
from ablations.comparisons import Comparison, comparisons, primary_comparisons, table
from ablations.config import AnalysisParams


def _rows(t: pd.DataFrame, meta: dict) -> S.Comparison:
    acts = None if t.acts.isna().all() else t.acts.to_numpy(float)
    return S.Comparison(
        d=t.d.to_numpy(float), margin=meta["margin"], control=t.control.to_numpy(float),
        control_direction=meta["control_direction"], nokl=acts, nokl_direction=meta.get("acts_direction", 0),
        nokl_margin=meta.get("acts_margin"),
    )  # fmt: skip


def noise(t: pd.DataFrame, margin: float) -> dict:
    """Descriptive noise of a comparison's planning differences, in its own units and in margins."""
    d = t.d.to_numpy(float)
    sd = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    return {
        "n_plan": len(d),
        "median": float(np.median(d)) if len(d) else float("nan"),
        "sd": sd,
        "sd_margins": sd / margin,
        "skewness": float(stats.skew(d)) if len(d) > 2 else float("nan"),
        "hit_rate_arm": float(t.hit_arm.mean()) if "hit_arm" in t else None,
        "hit_rate_other": float(t.hit_other.mean()) if "hit_other" in t else None,
    }


def plan_comparison(t: pd.DataFrame, meta: dict, proto: AnalysisParams, n_comparisons: int, seed: int) -> dict:
    """One comparison's plan from its planning table ``t``: cap, the power at it, and its noise."""
    s = proto.sequential
    got = S.plan_cap(
        _rows(t, meta), proto.alpha / n_comparisons, power=s.power, batch_size=s.batch_size, max_cap=s.max_cap,
        n_sims=s.simulations, seed=seed, multiple=s.effect,
    )  # fmt: skip
    reached = got["cap"] is not None
    return {
        "cap": int(got["cap"] if reached else s.max_cap),
        "reached": reached,
        "power_pos": float(got["power_pos"]),
        "power_neg": float(got["power_neg"]),
        "power_equivalent": float(got.get("power_equivalent", 0.0)),
        "margin": meta["margin"],
        "level": meta["level"],
        **noise(t, meta["margin"]),
    }


def check(t: pd.DataFrame, meta: dict, alpha: float) -> dict:
    """One sanity check of the contract (``analysis.checks``) on the planning instances: the median difference,
    its exact sign-test CI at 1 - ``alpha`` (signtest.median_ci, valid under skew) and two-sided p (signtest.sign_p,
    H0: median 0), and whether the CI lies beyond the margin, inside it, or neither. Descriptive: no error budget,
    no sequential looks, never part of a headline."""
    d = t.d.to_numpy(float)
    margin = meta["margin"]
    lo, hi = ST.median_ci(d, 1 - alpha)  # infinite where n is too small for the level
    where = (
        "beyond the margin"
        if lo > margin or hi < -margin
        else "inside the margin"
        if -margin < lo and hi < margin
        else "neither"
    )
    return {
        "n": len(d), "median": float(np.median(d)), "lo": float(lo), "hi": float(hi), "level": 1 - alpha,
        "p_sign": float(ST.sign_p(d)), "margin": margin, "ci": where,
    }  # fmt: skip


def plan(runs: pd.DataFrame, evals: pd.DataFrame, task: str, proto: AnalysisParams, protocol: dict) -> dict:
    """Every primary comparison's plan (``runs``/``evals``: the task's planning runs). Returns a JSON-able dict:
    ``comparisons`` name -> plan_comparison(), ``checks`` name -> check() (``analysis.checks``, descriptive), and
    the rule's constants."""
    tp = proto.tasks[task]
    comps: list[Comparison] = primary_comparisons(proto, len(protocol["levels"]))
    out = {}
    for k, c in enumerate(comps):
        t, meta = table(runs, evals, c, protocol, proto.reference_arm, tp.kl_tolerance)
        if len(t) < 2:
            raise ValueError(f"task {task}: comparison {c.name} has {len(t)} planning instance(s); it needs 2 or more")
        out[c.name] = plan_comparison(t, meta, proto, len(comps), seed=k)
    checks = {}
    for c in comparisons(proto.checks, len(protocol["levels"])):
        t, meta = table(runs, evals, c, protocol, proto.reference_arm, tp.kl_tolerance)
        checks[c.name] = check(t, meta, proto.alpha)
    s = proto.sequential
    return {
        "task": task,
        "plan_instances": sorted(int(i) for i in runs.instance.unique()),
        "rule": {
            "test": "sign test of the median",
            "alpha": proto.alpha,
            "comparisons": len(comps),
            "alpha_per_comparison": proto.alpha / len(comps),
            "batch_size": s.batch_size,
            "max_cap": s.max_cap,
            "power": s.power,
            "effect_margins": s.effect,
            "simulations": s.simulations,
        },
        "comparisons": out,
        "checks": checks,
    }
