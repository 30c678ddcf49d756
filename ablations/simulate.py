"""The level and power of a comparison's whole sequential rule on its own data, by resampling its instances; and the
sample-size plan (the cap at which the rule has the power to settle a 2-margin difference).

Design (the same for the tests, the plan and benchmarks/skew_simulation.py). A comparison's calibration or past
per-instance rows -- its difference d_i, its margin-sized positive control c_i and its no-KL contrast e_i (either
check may be absent) -- are resampled as whole INSTANCES, with replacement (the nonparametric bootstrap of
instances, Efron & Tibshirani 1993, ch. 6), so the skew of d, its ties, and the correlation between d, c and e are
kept. d is shifted so that the population's median is exactly Δ: d - median(d) + Δ (for even n the middle two
values straddle Δ symmetrically, so P(D < Δ) = P(D > Δ) = 1/2 with distinct middle values: the worst case of the
sign test, not a median chosen to favour it); c and e keep their own values (the controls as observed). Each trial
draws ``cap`` instances and runs ablations/rule.path and decide with the controls in the rule; trials share their
draws across Δ (common random numbers), so rates at different Δ are comparable. The rates, with their Monte Carlo
SE sqrt(p (1 - p) / n_sims), are:

* false material: P(settled "material difference") at Δ = 0 and ±m (every |Δ| <= m is a non-material truth);
* false equivalent: P(settled "equivalent") at Δ = ±m and just beyond (±``beyond`` · m);
* false material or equivalent: at Δ = ±m both claims are wrong (the union bound allows 1.5 alpha_q there);
* false non-zero: at Δ = 0, the result claims a non-zero median (material, "non-zero", or the non-zero flag);
* power material: P(settled material on the right side) at ±2m; power equivalent: P(settled equivalent) at Δ = 0.

The v3 rule (the symmetric sign-flip test of the MEAN, ablations/sequential.py) is simulated the same way with d
shifted to mean Δ, its own estimand (``signflip_table``), to show what the sign test fixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ablations import rule as R
from ablations import sequential as V3
from ablations import signtest as T

QUANTITIES = ("false material", "false equivalent", "false material or equivalent", "false non-zero",
              "power material", "power equivalent")  # fmt: skip


@dataclass(frozen=True)
class Comparison:
    """One comparison's per-instance rows and calibrated checks: d (n,) its differences with margin ``margin``;
    ``control`` (n,) its margin-sized positive control with ``control_direction``; ``nokl`` (n,) its no-KL contrast
    with ``nokl_direction`` and ``nokl_margin`` (the contrast's own margin); None where the comparison has none."""

    d: np.ndarray
    margin: float
    control: np.ndarray | None = None
    control_direction: int = 1
    nokl: np.ndarray | None = None
    nokl_direction: int = 1
    nokl_margin: float | None = None

    def __post_init__(self):
        n = len(self.d)
        for name in ("control", "nokl"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"{name} has {len(v)} rows, d has {n}")
        if not self.margin > 0:
            raise ValueError(f"margin must be > 0 (got {self.margin})")


def shift_median(d, delta: float) -> np.ndarray:
    """d - median(d) + delta: the population (the rows as an empirical distribution) with median exactly delta."""
    d = np.asarray(d, dtype=float)
    return d - np.median(d) + delta


def draws(n_rows: int, n_sims: int, size: int, seed: int) -> np.ndarray:
    """Instance indices (n_sims, size), with replacement, seeded. Drawn instance by instance, so a trial's first
    instances are the same whatever ``size``: a cap of 24 sees the first 24 instances of the trials of a cap of 48."""
    return np.random.default_rng(seed).integers(0, n_rows, size=(size, n_sims)).T


def _rate(hits: np.ndarray) -> dict:
    p, n = float(np.mean(hits)), hits.size
    return {"rate": p, "se": math.sqrt(p * (1 - p) / n), "n_sims": n}


def rates(decided: dict[float, dict], margin: float) -> list[dict]:
    """The rates of the module docstring from decide() results keyed by Δ (in data units): records with
    ``quantity``, ``delta`` (in margins), ``rate``, ``se``, ``n_sims``."""
    out = []
    for delta, dec in decided.items():
        v, side = np.asarray(dec["verdict"]), np.asarray(dec["side"])
        material, equivalent = v == T.MATERIAL, v == T.EQUIVALENT
        units = delta / margin
        found = []
        if abs(units) <= 1 + 1e-12:
            found.append(("false material", material))
        if abs(units) >= 1 - 1e-12:
            found.append(("false equivalent", equivalent))
        if abs(abs(units) - 1) <= 1e-12:
            found.append(("false material or equivalent", material | equivalent))
        if units == 0:
            found.append(("false non-zero", np.isin(v, (T.MATERIAL, T.NONZERO)) | np.asarray(dec["nonzero"])))
            found.append(("power equivalent", equivalent))
        if abs(abs(units) - 2) <= 1e-12:
            found.append(("power material", material & (side == np.sign(units))))
        out += [{"quantity": q, "delta": units, **_rate(h)} for q, h in found]
    return out


def resample(comp: Comparison, idx: np.ndarray) -> dict:
    """The trials' rows from instance indices idx (n_sims, size): ``d`` (shifted to median 0), ``control``,
    ``nokl`` (n_sims, size) or None -- each trial's columns from the same instances."""
    take = lambda v: None if v is None else np.asarray(v, dtype=float)[idx]
    return {"d": shift_median(comp.d, 0.0)[idx], "control": take(comp.control), "nokl": take(comp.nokl)}


def run_rule(comp: Comparison, schedule: R.Schedule, rows: dict, delta: float) -> dict:
    """decide() over the trials of ``rows`` (from the resampled instances) with d shifted by ``delta``."""
    checks = {"control": rows["control"], "control_direction": comp.control_direction, "nokl": rows["nokl"]}
    checks |= {"nokl_direction": comp.nokl_direction, "nokl_margin": comp.nokl_margin}
    return R.decide(R.path(rows["d"] + delta, comp.margin, schedule, ci=False, **checks))


def deltas(margin: float, beyond: float = 1.1) -> list[float]:
    """Δ = 0, ±m, ±beyond·m, ±2m (data units)."""
    return [s * f * margin for f in (0.0, 1.0, beyond, 2.0) for s in ((1,) if f == 0 else (1, -1))]


def error_table(comp: Comparison, schedule: R.Schedule, *, n_sims: int = 4000, seed: int = 0, beyond: float = 1.1):
    """The rates of the whole rule (controls in) at Δ = 0, ±m, ±beyond·m, ±2m on resampled instances (records,
    see rates())."""
    rows = resample(comp, draws(len(comp.d), n_sims, schedule.cap, seed))
    return rates({dl: run_rule(comp, schedule, rows, dl) for dl in deltas(comp.margin, beyond)}, comp.margin)


def _v3_decided(comp: Comparison, schedule: V3.Schedule, d: np.ndarray, control: np.ndarray | None) -> dict:
    """v3's decision (ablations/sequential.py) on trials d (t, cap), in v4's vocabulary: "difference" -> "non-zero";
    ``side`` from its (1 - a_j) CI. As v3's primary.py did, a control of calibrated direction 0 is never
    detected."""
    looks = V3.path(d, comp.margin, schedule, control=control, control_direction=comp.control_direction or 1)
    if control is not None and comp.control_direction == 0:
        for look in looks:
            look["control_detected"] = np.zeros(d.shape[:-1], dtype=bool)
    dec = V3.decide(looks)
    v = np.asarray(dec["verdict"]).astype(T._WIDTH)
    v[v == V3.DIFFERENCE] = T.NONZERO
    side = np.where(dec["lo"] > 0, 1, np.where(dec["hi"] < 0, -1, 0))
    return {"verdict": v, "nonzero": np.asarray(dec["nonzero"]), "side": side}


def signflip_table(
    comp: Comparison,
    batch_size: int,
    cap: int,
    alpha: float,
    *,
    n_sims: int = 2000,
    seed: int = 0,
    max_bits: int = 11,
    beyond: float = 1.1,
    at: list[float] | None = None,
    chunk: int = 1000,
) -> list[dict]:
    """The v3 rule (sign-flip CIs of the MEAN, alpha spent evenly over all looks, the margin-sized control in the
    rule, no no-KL check) on the same resampled instances with d shifted to MEAN Δ, its estimand. ``at``: the Δ
    (in margins) to run (default as error_table). max_bits 11 (a 2048-element flip subgroup from n = 12; exact
    under symmetry all the same) keeps it fast; ``chunk`` trials at a time bound the memory."""
    sch = V3.Schedule(batch_size=batch_size, cap=cap, alpha=alpha, rho=1.0, max_bits=max_bits)
    idx = draws(len(comp.d), n_sims, cap, seed)
    d = np.asarray(comp.d, dtype=float)
    base = (d - d.mean())[idx]
    control = None if comp.control is None else np.asarray(comp.control, dtype=float)[idx]
    decided = {}
    for u in deltas(1.0, beyond) if at is None else at:
        parts = [
            _v3_decided(
                comp, sch, base[s : s + chunk] + u * comp.margin, None if control is None else control[s : s + chunk]
            )
            for s in range(0, n_sims, chunk)
        ]
        decided[u * comp.margin] = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return rates(decided, comp.margin)


def plan_cap(
    comp: Comparison,
    alpha: float,
    *,
    power: float = 0.8,
    batch_size: int = 4,
    max_cap: int = 200,
    n_sims: int = 2000,
    seed: int = 0,
    multiple: float = 2.0,
) -> dict:
    """The sample-size plan: the smallest cap (a multiple of ``batch_size``, <= ``max_cap``) at which the whole rule
    (controls in) with alpha_q = ``alpha`` settles "material difference" on the right side at Δ = +multiple·m AND
    at -multiple·m with probability >= ``power`` each; every cap is scanned on the same resampled instances (the
    power need not rise monotonically with the cap: more looks split alpha finer). Returns ``cap`` (None when no cap
    up to ``max_cap`` reaches the power), ``at`` (the cap the powers are for: ``cap``, or the last cap scanned),
    ``power_pos`` / ``power_neg`` and their SEs, ``power_equivalent`` (settling "equivalent" at Δ = 0) and
    ``n_sims``."""
    if max_cap < batch_size:
        raise ValueError(f"max_cap {max_cap} is below the batch size {batch_size}")
    rows = resample(comp, draws(len(comp.d), n_sims, max_cap, seed))
    delta = multiple * comp.margin
    out = {"cap": None, "at": max_cap, "power_pos": 0.0, "power_pos_se": 0.0, "power_neg": 0.0, "power_neg_se": 0.0}
    last = None
    for cap in range(batch_size, max_cap + 1, batch_size):
        sch = R.Schedule(batch_size, cap, alpha)
        if not sch.decidable:
            continue
        head = {k: None if v is None else v[:, :cap] for k, v in rows.items()}
        for s, name in ((1, "power_pos"), (-1, "power_neg")):
            dec = run_rule(comp, sch, head, s * delta)
            r = _rate((dec["verdict"] == T.MATERIAL) & (dec["side"] == s))
            out |= {name: r["rate"], f"{name}_se": r["se"]}
        out["at"], last = cap, (sch, head)
        if min(out["power_pos"], out["power_neg"]) >= power:
            out["cap"] = cap
            break
    eq = 0.0 if last is None else float(np.mean(run_rule(comp, *last, 0.0)["verdict"] == T.EQUIVALENT))
    return {**out, "power_equivalent": eq, "n_sims": n_sims}
