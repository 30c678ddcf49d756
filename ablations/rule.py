"""Protocol v4's sequential decision rule for one comparison: looks after every batch, exact sign tests of the median
paired difference (ablations/signtest.py), alpha spent only where a decision is reachable, controls in the rule.

Vectorised over leading axes like the rest of the statistics (d of shape (..., L)), so that ablations/simulate.py
runs thousands of sequential trials through exactly this code.

Schedule. Looks at n_j = batch_size · j, j = 1..J, J = cap // batch_size; the cap is the comparison's own (its
sample-size plan). The comparison's share alpha_q is spent only on looks where a decision is reachable: look j can
reach "material" at level a only if the two-sided test at n_j can reach a/2 on one side, 2^-n_j <= a/2. The set of
reachable looks depends on the level, so it is a fixed point: with f(r) the number of looks reachable at
alpha_q / r, the reachable set is the last r* looks, r* = max{r : f(r) >= r} (f is non-increasing and the reachable
looks are always the last ones, larger n). Every other look spends 0 and can only be "inconclusive" (it is shown,
with its level 0). No reachable look: the comparison can never be decided (``Schedule.decidable`` False).

What a look costs is what its exact test ATTAINS, not its nominal level: the sign test's levels are discrete, so at
nominal a the bounds attain c_j = max(2 F_n(k1 - 1), F_n(k2 - 1)) <= a (k1 = rank(n_j, a/2), k2 = rank(n_j, a),
F_n the Binomial(n_j, 1/2) CDF; the first term bounds a wrong material or non-zero claim, the second a wrong
equivalence). The reachable looks are taken in order and each gets an equal share of what is left: a_j = B_j / R_j,
B_j the budget left (alpha_q minus the costs of the earlier reachable looks), R_j the reachable looks from j on;
then B_{j+1} = B_j - c_j(a_j). The unattained part of a look's share carries forward to the later looks (the last
look gets the whole remainder), so sum_j c_j <= alpha_q, and the union bound below holds with c_j in place of a_j.
The levels depend only on n_j and alpha_q, never on the data: they are fixed before any look.

A look (signtest.outcome at a_j): "material difference", "equivalent" (with ``nonzero``), "non-zero, materiality
undetermined" or "inconclusive". Rules on equivalence, at the same look and a_j, each check optional (None when the
comparison has none):
* the margin-sized positive control must be ``detected`` (its one-sided (1 - a_j) bound excludes 0 in its
  calibrated direction), else the look's verdict is "insensitive";
* the penalty must ``act`` (the no-KL contrast's one-sided (1 - a_j) bound lies beyond its own margin in its
  calibrated direction), else "inert" ("the penalty is inert here: placement is not testable at this β").
A calibrated direction of 0 never passes. When both fail the verdict is "insensitive": a rule that cannot detect a
margin-sized effect cannot show that the penalty does nothing either. A material difference needs neither check.
The comparison settles at the FIRST look that is "material difference" or (effective) "equivalent"; otherwise it
keeps the last look's effective verdict, "open" while the data stop before the cap, "unsettled at cap" after it.
The estimate at the settling look is the sample median (not corrected for the selection of the stopping look; the
CIs are the inferential statement).

Error control under any stopping (union bound over looks). Let θ be the true median difference and L_j(a), U_j(a)
the one-sided (1 - a) bounds at look j (signtest: P(L_j(a) > θ) <= a and P(U_j(a) < θ) <= a for any independent
d_i with median θ). Every wrong claim needs some look's bound on the wrong side of θ:
* "material" when |θ| <= m: some look has L_j(a_j/2) > m >= θ or U_j(a_j/2) < -m <= θ; probability
  <= Σ_j 2 F(k1_j - 1) <= Σ_j c_j <= alpha_q (the bounds attain F(k1_j - 1) each, Schedule).
* "equivalent" when θ >= m: some look has U_j(a_j) < m <= θ; probability <= Σ_j F(k2_j - 1) <= Σ_j c_j <= alpha_q
  (θ <= -m: L_j(a_j) > -m >= θ, the same).
* "non-zero" (a material difference, a non-zero verdict, or an equivalence flagged non-zero) when θ = 0: some look
  has L_j(a_j/2) > 0 or U_j(a_j/2) < 0; probability <= alpha_q.
Every claim of any kind, at any θ: for |θ| < m the wrong claims (material either way, non-zero on the wrong side)
all lie in ∪_j {L_j(a_j/2) > θ or U_j(a_j/2) < θ}, probability <= alpha_q; for θ > m (θ < -m mirrored) they all
lie in ∪_j {U_j(a_j) < θ} (a wrong-way material or non-zero claim needs U_j(a_j/2) < 0 < θ, and U_j(a_j) <=
U_j(a_j/2)), probability <= alpha_q. Only at θ = ±m exactly are both "material" and "equivalent" wrong, and the
union bound for "either" is then alpha_q/2 + alpha_q (ablations/simulate.py reports that combined rate too; one
look cannot make both claims, since x_(k1) <= x_(n+1-k2)). The events are defined on the whole sequence up to the
cap, so the bounds hold for any stopping rule (stopping only removes claims), any dependence between looks, and
whatever the controls do (they only withhold equivalences). Across K comparisons sharing alpha (alpha_q = alpha / K),
Bonferroni carries each bound to the family. Conservative: the union bound ignores the looks' correlation
(Lan-DeMets boundaries would not), and the sign test is conservative with ties.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ablations import signtest as T


@dataclass(frozen=True)
class Schedule:
    """One comparison's looks n_j = batch_size · j (j = 1..J, J = cap // batch_size) and levels a_j: alpha (this
    comparison's share alpha_q) spent on the looks where a decision is reachable, each an equal share of what the
    earlier looks left unattained (module docstring), 0 elsewhere."""

    batch_size: int
    cap: int
    alpha: float

    def __post_init__(self):
        if self.batch_size < 1 or self.cap < self.batch_size:
            raise ValueError(f"need 1 <= batch_size <= cap (got {self.batch_size}, {self.cap})")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1) (got {self.alpha})")

    @property
    def J(self) -> int:
        """Number of looks."""
        return self.cap // self.batch_size

    def looks(self) -> np.ndarray:
        """n_j, j = 1..J."""
        return self.batch_size * np.arange(1, self.J + 1)

    @functools.cached_property
    def _reachable_count(self) -> int:
        """r*: the largest r whose equal split alpha / r reaches r looks (they are the last r)."""
        n = self.looks()
        for r in range(self.J, 0, -1):
            if sum(T.reachable(int(nj), self.alpha / r / 2) for nj in n) >= r:
                return r
        return 0

    @functools.cached_property
    def _levels(self) -> np.ndarray:
        out, r = np.zeros(self.J), self._reachable_count
        budget = self.alpha
        for i, j in enumerate(range(self.J - r, self.J)):
            out[j] = budget / (r - i)
            budget -= cost(int(self.looks()[j]), float(out[j]))
        out.setflags(write=False)
        return out

    def levels(self) -> np.ndarray:
        """a_j, j = 1..J: the nominal level of each look (0 on the unreachable ones)."""
        return self._levels.copy()

    def costs(self) -> np.ndarray:
        """c_j, j = 1..J: the level each look's exact test attains at a_j (``cost``); their sum is <= alpha."""
        return np.array([cost(int(n), float(a)) for n, a in zip(self.looks(), self._levels)])

    def reachable(self, j: int) -> bool:
        """Whether look j (1-based) can reach a decision at its level: a_j > 0 and 2^-n_j <= a_j / 2."""
        return T.reachable(self.batch_size * j, float(self._levels[j - 1]) / 2)

    @property
    def decidable(self) -> bool:
        """Whether any look can reach a decision."""
        return bool(self._levels.any())


def cost(n: int, a: float) -> float:
    """The most a look at n instances and nominal level a can err with: max(2 F_n(k1 - 1), F_n(k2 - 1)) (material
    or non-zero: both one-sided (1 - a/2) bounds; equivalence: one (1 - a) bound), k1 = rank(n, a/2), k2 =
    rank(n, a); 0 for a = 0."""
    if a <= 0:
        return 0.0
    return max(2 * T.attained(n, T.rank(n, a / 2)), T.attained(n, T.rank(n, a)))


def _prefixes(x, length: int, name: str) -> np.ndarray | None:
    if x is None:
        return None
    x = T.as_data(x)
    if x.shape[-1] != length:
        raise ValueError(f"{name} has {x.shape[-1]} instances, the comparison {length}")
    return x


def path(
    d,
    margin: float,
    schedule: Schedule,
    *,
    control=None,
    control_direction: int = +1,
    nokl=None,
    nokl_direction: int = +1,
    nokl_margin: float | None = None,
    ci: bool = True,
) -> list[dict]:
    """Every look of one comparison. d (..., L): per-instance differences in the pre-registered order (L <= cap; a
    look at every n_j <= L); ``control`` / ``nokl``: the same instances' positive-control and no-KL differences
    (same shape) or None, with their calibrated directions (+1, -1 or 0) and the no-KL contrast's own margin.
    Returns per-look dicts: ``j``, ``n``, ``a_j``, ``reachable``, ``final`` (j = J), ``verdict``, ``nonzero``,
    ``side`` (signtest.classify), ``k1``/``k2``, ``estimate``/``lo``/``hi``/``lo90``/``hi90`` (sample median and
    order-statistic CIs; None when ``ci`` is False, as the simulation runs), ``control_detected`` and ``acts``
    (None without that check). Verdicts come from prefix counts (comparisons only), identical to signtest.outcome."""
    if not margin > 0:
        raise ValueError(f"margin must be > 0 (got {margin})")
    d = T.as_data(d)
    length = d.shape[-1]
    if length > schedule.cap:
        raise ValueError(f"{length} instances exceed the cap of {schedule.cap}")
    control, nokl = _prefixes(control, length, "control"), _prefixes(nokl, length, "nokl")
    for direction in (control_direction, nokl_direction):
        T._check_direction(direction)
    if nokl is not None and not (nokl_margin is not None and nokl_margin > 0):
        raise ValueError(f"the no-KL check needs its margin > 0 (got {nokl_margin})")
    counts = T.margin_counts(d, margin, cumulative=True)
    c_counts = None if control is None else T.side_counts(control, 0.0, cumulative=True)
    e_counts = None if nokl is None else T.side_counts(nokl, nokl_margin, cumulative=True)
    levels = schedule.levels()
    looks = []
    for j in range(1, schedule.J + 1):
        n = schedule.batch_size * j
        if n > length:
            break
        a_j = float(levels[j - 1])
        k1, k2 = T.rank(n, a_j / 2), T.rank(n, a_j)
        look = {"j": j, "n": n, "a_j": a_j, "reachable": schedule.reachable(j), "final": j == schedule.J}
        look |= {"k1": k1, "k2": k2}
        look |= T.classify({key: v[..., n - 1] for key, v in counts.items()}, k1, k2)
        if ci:
            xs = np.sort(d[..., :n], axis=-1)
            (lo, hi), (lo90, hi90) = T.order_bounds(xs, k1), T.order_bounds(xs, k2)
            look |= {"estimate": T.sorted_median(xs), "lo": lo, "hi": hi, "lo90": lo90, "hi90": hi90}
        else:
            look |= dict.fromkeys(("estimate", "lo", "hi", "lo90", "hi90"))
        look["control_detected"] = (
            None if c_counts is None else T.beyond_counts(*(c[..., n - 1] for c in c_counts), k2, control_direction)
        )
        look["acts"] = (
            None if e_counts is None else T.beyond_counts(*(e[..., n - 1] for e in e_counts), k2, nokl_direction)
        )
        looks.append({key: T.scalar(v) for key, v in look.items()})
    return looks


def effective_verdict(look: dict):
    """A look's verdict after the rules on equivalence: "equivalent" whose control was not detected is "insensitive";
    one whose penalty was not shown to act is "inert" (insensitive first)."""
    v = np.asarray(look["verdict"])
    equivalent = v == T.EQUIVALENT
    blind = np.zeros(v.shape, bool) if look.get("control_detected") is None else ~np.asarray(look["control_detected"])
    inert = np.zeros(v.shape, bool) if look.get("acts") is None else ~np.asarray(look["acts"])
    out = np.where(equivalent & blind, T.INSENSITIVE, np.where(equivalent & inert, T.INERT, v))
    return T.scalar(out.astype(T._WIDTH))


_DECIDED = ("j", "n", "a_j", "nonzero", "side", "estimate", "lo", "hi", "lo90", "hi90", "control_detected", "acts")


def decide(looks: list[dict]) -> dict:
    """The comparison's result from path(): the FIRST look whose effective verdict is "material difference" or
    "equivalent" (``settled`` True, that look's values); else the last look's (``settled`` False). Also
    ``cap_reached``, ``open`` (unsettled and the data stopped before the cap), ``status`` ("settled", "open",
    "unsettled at cap") and ``looks`` (how many were taken). Arrays over the leading axes; scalars for one trial."""
    if not looks:
        return {"verdict": T.INCONCLUSIVE, "settled": False, "cap_reached": False, "open": True, "status": "open",
                "looks": 0, "j": 0, "n": 0}  # fmt: skip
    verdicts = np.stack([np.asarray(effective_verdict(look)) for look in looks])  # (J', ...)
    shape = verdicts.shape[1:]
    settle = np.isin(verdicts, T.SETTLING)
    settled = settle.any(axis=0)
    idx = np.where(settled, settle.argmax(axis=0), len(looks) - 1)

    def pick(values):
        stacked = np.stack([np.broadcast_to(np.asarray(v), shape) for v in values])
        return np.take_along_axis(stacked, idx[None], axis=0)[0]

    cap_reached = bool(looks[-1]["final"])
    out = {"verdict": pick(verdicts), "settled": settled}
    for key in _DECIDED:
        vals = [look.get(key) for look in looks]  # v3 looks (ablations/sequential.py) have no side or acts
        out[key] = None if any(v is None for v in vals) else pick(vals)
    out["cap_reached"] = cap_reached
    out["open"] = ~settled & (not cap_reached)
    out["status"] = np.where(settled, "settled", "unsettled at cap" if cap_reached else "open")
    out["looks"] = len(looks)
    return {key: T.scalar(v) for key, v in out.items()}
