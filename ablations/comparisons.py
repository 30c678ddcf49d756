"""The per-instance data of every pre-registered comparison (protocol v4): what the planning stage measures the noise
of (ablations/plan.py) and what the sequential decision reads (ablations/primary.py). Pure functions of the runs
and evals tables (ablations/load.py) and the calibrated protocol (protocol/<task>.json): no I/O.

A question of ``analysis.primary`` (or ``analysis.checks``) is ``arm`` minus ``other``, each at ``role``; a
``levels`` question is one comparison per frontier KL level. Per instance (in the pre-registered order; PPO seeds
averaged first) a comparison has

    d        arm - other on the metric (final gold, or log final exact KL); ``other: none`` at a level is the no-KL
             run's own trajectory read at that KL (below)
    control  the margin-sized positive control on the same metric: the reference arm at ``act`` minus at ``control``
             (calibrated effect about one margin, direction ``control_direction``)
    acts     the no-KL contrast (no KL minus ``other``'s cell): the penalty must be shown to act, beyond its margin in
             its calibrated direction, before the comparison may be called equivalent. Coefficient roles: on the
             comparison's metric, direction = the sign calibration saw for the reference arm at that coefficient
             (0 when it saw none: never detected). Level roles: on log KL (no KL ends above the level when the
             controller holds the arm there), direction +1, the log-KL margin. ``other: none``: no check (the
             question is whether the penalty helps at all).
    hit_arm, hit_other   level roles: whether the steered run ended within ±kl_tolerance of its level (the no-KL
             trajectory: whether it reached the level at all)

The no-KL trajectory at KL level L (Gao et al. 2022, sec. 3.6: gold as a function of KL along training): the run's
held-out evaluations (iteration, gold, exact KL) in order; the first evaluation j with KL_j >= L; gold linear in KL
between evaluations j-1 and j: g_{j-1} + (L - KL_{j-1}) / (KL_j - KL_{j-1}) (g_j - g_{j-1}) (j = 0: g_0). A run
that never reaches L gives its last evaluation's gold and hit_other False (the report counts it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ablations.protocol_params import NO_KL, AnalysisParams, Primary

COLUMN = {"gold": "final_gold", "log_kl": "log_kl", "ood_gold": "final_ood_gold"}


@dataclass(frozen=True)
class Comparison:
    """One pre-registered comparison: question ``question`` at ``role`` (a level question: one per level)."""

    question: str
    spec: Primary
    role: str  # act | tuned | level<k>

    @property
    def name(self) -> str:
        """Identifier-safe: the question, and for a level question '_level<k>'."""
        return self.question if self.spec.role != "levels" else f"{self.question}_{self.role}"

    @property
    def level(self) -> int | None:
        return int(self.role[5:]) if self.role.startswith("level") else None

    def cells(self) -> list[tuple[str, str]]:
        """The design cells (arm, role) the comparison reads, besides the baseline and the controls."""
        return [(x, self.role) for x in (self.spec.arm, self.spec.other) if x != NO_KL]


def comparisons(questions: dict[str, Primary], n_levels: int) -> list[Comparison]:
    """Every comparison of ``questions`` in order, a levels question expanded over its ``n_levels`` levels."""
    out = []
    for q, spec in questions.items():
        roles = [f"level{k}" for k in range(1, n_levels + 1)] if spec.role == "levels" else [spec.role]
        out += [Comparison(q, spec, role) for role in roles]
    return out


def primary_comparisons(proto: AnalysisParams, n_levels: int) -> list[Comparison]:
    return comparisons(proto.primary, n_levels)


def _per_instance(runs: pd.DataFrame, arm: str, role: str | None, column: str) -> pd.Series:
    """Per instance, the mean over its PPO seeds of ``column`` for ``arm`` at ``role`` (the baseline: role None)."""
    sel = runs[(runs.arm == arm) & (runs.role.isna() if role is None else runs.role == role)]
    return sel.groupby("instance")[column].mean()


def trajectory_at(ev: pd.DataFrame, level: float) -> tuple[float, bool]:
    """(gold, reached) of one run's evaluations ``ev`` (sorted by iteration) at exact KL ``level`` (module doc)."""
    kl, gold = ev.kl.to_numpy(float), ev.gold.to_numpy(float)
    above = np.flatnonzero(kl >= level)
    if not len(above):
        return float(gold[-1]), False
    j = int(above[0])
    if j == 0 or kl[j] == kl[j - 1]:
        return float(gold[j]), True
    t = (level - kl[j - 1]) / (kl[j] - kl[j - 1])
    return float(gold[j - 1] + t * (gold[j] - gold[j - 1])), True


def no_kl_trajectory(runs: pd.DataFrame, evals: pd.DataFrame, level: float) -> pd.DataFrame:
    """Per instance: the no-KL runs' gold at KL ``level`` along their trajectories (seeds averaged) and whether
    every seed reached it."""
    base = runs[runs.arm == NO_KL]
    rows = []
    for r in base.itertuples():
        ev = evals[(evals.arm == NO_KL) & (evals.instance == r.instance) & (evals.seed == r.seed)]
        gold, reached = trajectory_at(ev.sort_values("iteration"), level)
        rows.append({"instance": r.instance, "gold": gold, "reached": reached})
    t = pd.DataFrame(rows, columns=["instance", "gold", "reached"])
    return t.groupby("instance").agg(gold=("gold", "mean"), reached=("reached", "all"))


def with_log_kl(runs: pd.DataFrame) -> pd.DataFrame:
    return runs.assign(log_kl=np.log(runs.final_kl.clip(lower=1e-12)))


def _direction(sign) -> int:
    return int(np.sign(sign)) if sign is not None and math.isfinite(sign) else 0


def table(
    runs: pd.DataFrame, evals: pd.DataFrame, c: Comparison, protocol: dict, reference: str, kl_tolerance: float
) -> tuple[pd.DataFrame, dict]:
    """The comparison's per-instance table (instances having every cell it reads, sorted) with columns d, arm and
    other (the two sides, d = arm - other), control, acts (NaN where it has no such check), hit_arm, hit_other (level
    roles), and its meta: margin, acts_margin, control_direction, acts_direction, level value."""
    runs = with_log_kl(runs)
    metric = c.spec.metric
    col = COLUMN[metric]
    margin = float(protocol["margins"][metric])
    level = None if c.level is None else float(protocol["levels"][c.level - 1])
    arm = _per_instance(runs, c.spec.arm, c.role, col)
    if c.spec.other == NO_KL:
        traj = no_kl_trajectory(runs, evals, level)
        other, hit_other = traj.gold, traj.reached
    else:
        other = _per_instance(runs, c.spec.other, c.role, col)
        hit_other = None
    ctrl_role = "act"
    control = _per_instance(runs, reference, ctrl_role, col) - _per_instance(runs, reference, "control", col)
    none = _per_instance(runs, NO_KL, None, col)
    meta = {"margin": margin, "level": level, "control_direction": int(protocol["control_direction"][metric])}
    if level is not None:  # acts: no KL ends above the level (log KL), the controller holds the arm there
        lk = lambda arm_: _per_instance(runs, arm_, c.role, "log_kl")
        acts = None if c.spec.other == NO_KL else _per_instance(runs, NO_KL, None, "log_kl") - lk(c.spec.other)
        meta |= {"acts_margin": float(protocol["margins"]["log_kl"]), "acts_direction": 1}
    else:
        acts = none - other
        coef = float(protocol["coef"]) if c.role == "act" else float(protocol["tuned"].get(c.spec.other, math.nan))
        if c.role == "act":
            sign = protocol["no_kl_direction"][metric]
        else:  # tuned: the calibrated no-KL contrast of the reference arm at the other arm's tuned coefficient
            sign = protocol.get("no_kl_contrast", {}).get(f"{coef:g}") if metric != "log_kl" else None
        meta |= {"acts_margin": margin, "acts_direction": _direction(sign)}
    t = pd.DataFrame({"d": arm - other, "arm": arm, "other": other, "control": control})
    t["acts"] = np.nan if acts is None else acts
    if level is not None:
        final_kl = lambda arm_: _per_instance(runs, arm_, c.role, "final_kl")
        t["hit_arm"] = (final_kl(c.spec.arm) / level - 1).abs() <= kl_tolerance
        t["hit_other"] = (
            hit_other.astype(bool) if hit_other is not None
            else (final_kl(c.spec.other) / level - 1).abs() <= kl_tolerance
        )  # fmt: skip
    t = t.dropna(subset=["d", "control"]).sort_index()
    t.index.name = "instance"
    return t, meta
