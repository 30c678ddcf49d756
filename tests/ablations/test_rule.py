"""ablations/rule.py: protocol v4's schedule (alpha spent only on reachable looks), the looks of a comparison, the
rules on equivalence (control detected, penalty acts) and the sequential decision, by hand and against
signtest.outcome on every prefix."""

import numpy as np
import pytest

from ablations import rule as R
from ablations import signtest as T

ALPHA9 = 0.05 / 9


# ---------------------------------------------------------------- the schedule


def test_schedule_by_hand():
    """alpha_q = 0.05/9, batch 4. Cap 24 (6 looks): split over 6 or 5 looks a/2 reaches 2^-12 but not 2^-8, so only
    n >= 12 (4 looks) qualify. Look n = 12 gets alpha/4 = 0.001389: k1 = rank(12, 0.000694) = 1 (F(0) = 2^-12),
    k2 = rank(12, 0.001389) = 1, so it attains max(2 / 4096, 1 / 4096) = 0.000488; the rest carries forward: n = 16
    gets (alpha - 0.000488) / 3, and so on, the last look all that is left. Cap 4 at 0.01: 2^-4 > 0.005, nothing is
    decidable. Catches: alpha spent on looks that cannot decide, nominal levels counted instead of attained ones
    (the unattained budget lost), attained costs that exceed alpha_q."""
    s = R.Schedule(4, 24, ALPHA9)
    lv, c = s.levels(), s.costs()
    assert lv[:2].tolist() == [0, 0] and lv[2] == pytest.approx(ALPHA9 / 4)
    assert c[2] == pytest.approx(2 / 4096)
    assert lv[3] == pytest.approx((ALPHA9 - 2 / 4096) / 3)
    assert lv[5] == pytest.approx(ALPHA9 - c[2:5].sum())  # the last look: the whole remainder
    assert all(c <= lv + 1e-18) and c.sum() <= ALPHA9 + 1e-15
    assert [s.reachable(j) for j in range(1, 7)] == [False, False, True, True, True, True]
    assert s.decidable
    np.testing.assert_array_equal(s.looks(), [4, 8, 12, 16, 20, 24])
    assert not R.Schedule(4, 4, 0.01).decidable and R.Schedule(4, 4, 0.01).levels().sum() == 0
    assert R.Schedule(4, 4, 0.125).levels().tolist() == [0.125]  # 2^-4 = 0.0625 <= 0.125/2 exactly
    with pytest.raises(ValueError):
        R.Schedule(4, 2, 0.01)


def test_cost_is_what_the_exact_test_attains():
    """At n = 10, a = 0.05: k1 = rank(10, 0.025) = 2 (F(1) = 11/1024 <= 0.025 < F(2) = 56/1024), k2 = rank(10, 0.05)
    = 2 (F(2) > 0.05): cost = max(2 x 11/1024, 11/1024)."""
    assert R.cost(10, 0.05) == pytest.approx(22 / 1024)
    assert R.cost(10, 0.0) == 0.0
    for n in (4, 12, 24, 48):
        for a in (1e-4, 0.001, 0.01, 0.05):
            assert R.cost(n, a) <= a + 1e-15


def _reference_reachable(batch, cap, alpha):
    """Independent slow fixed point: the largest r such that the r LAST looks are all reachable at alpha / r."""
    looks = [batch * j for j in range(1, cap // batch + 1)]
    for r in range(len(looks), 0, -1):
        if all(2.0**-n <= alpha / r / 2 for n in looks[-r:]):
            return r
    return 0


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8])
def test_schedule_fixed_point_properties(batch):
    """Over many caps and budgets: the spending looks are the independent fixed point's; their attained costs sum to
    at most alpha (all of it carried to the last look); every spending look is reachable at its level and none is
    spent on an unreachable one; the levels never decrease (what one look leaves, the next gets). Catches: spending
    by the reachability at alpha / J, a non-suffix set, attained costs above alpha."""
    for cap in range(batch, 64 + 1, batch):
        for alpha in (0.05 / 9, 0.05 / 5, 0.0125, 0.05, 1e-4):
            s = R.Schedule(batch, cap, alpha)
            lv, c = s.levels(), s.costs()
            r = _reference_reachable(batch, cap, alpha)
            assert int((lv > 0).sum()) == r
            assert c.sum() <= alpha * (1 + 1e-12)
            spent = lv > 0
            assert all(s.reachable(j) == spent[j - 1] for j in range(1, s.J + 1))
            assert all(np.diff(lv[spent]) >= -1e-15)


# ---------------------------------------------------------------- looks


def test_path_equals_outcome_on_every_prefix():
    """Each look equals signtest.outcome at a_j on the first n_j instances (verdict, CIs, median) and the checks
    equal signtest.detected / acts there; ci=False gives the same verdicts; the vectorised path equals the
    row-by-row one. Catches: a look on the wrong prefix, the cumulative counts off by one, the control tested at
    alpha instead of a_j, checks at the two-sided rank."""
    rng = np.random.default_rng(31)
    s = R.Schedule(4, 24, 0.05)
    d = np.round(rng.normal(rng.uniform(-2, 2, (50, 1)), 0.3, (50, 20)), 1)  # ties; some rows settle
    c = np.round(rng.normal(0.8, 1.0, (50, 20)), 1)
    e = np.round(rng.normal(-1.5, 1.0, (50, 20)), 1)
    kw = {"control": c, "control_direction": 1, "nokl": e, "nokl_direction": -1, "nokl_margin": 0.5}
    looks = R.path(d, 0.5, s, **kw)
    fast = R.path(d, 0.5, s, ci=False, **kw)
    assert [look["n"] for look in looks] == [4, 8, 12, 16, 20]  # up to the data, below the cap of 24
    for look, quick in zip(looks, fast):
        n, a = look["n"], look["a_j"]
        ref = T.outcome(d[:, :n], 0.5, a)
        for key in ("verdict", "nonzero", "side", "lo", "hi", "lo90", "hi90", "estimate"):
            np.testing.assert_array_equal(look[key], ref[key])
        np.testing.assert_array_equal(look["control_detected"], T.detected(c[:, :n], a, 1))
        np.testing.assert_array_equal(look["acts"], T.acts(e[:, :n], a, -1, 0.5))
        np.testing.assert_array_equal(quick["verdict"], look["verdict"])
        assert quick["lo"] is None and not look["final"]
    verdicts = np.concatenate([look["verdict"] for look in looks])
    assert {T.MATERIAL, T.EQUIVALENT, T.INCONCLUSIVE} <= set(verdicts)
    for r in (0, 17):
        one = R.path(d[r], 0.5, s, **{**kw, "control": c[r], "nokl": e[r]})
        assert [o["verdict"] for o in one] == [look["verdict"][r] for look in looks]
    with pytest.raises(ValueError):
        R.path(rng.normal(size=25), 0.5, s)
    with pytest.raises(ValueError):
        R.path(d, 0.5, s, control=c[:, :10])
    with pytest.raises(ValueError):
        R.path(d, 0.5, s, nokl=e)  # the no-KL check needs its own margin


def test_unreachable_looks_spend_nothing_and_stay_inconclusive():
    """At alpha_q = 0.05/9 and batch 4 the looks at n = 4 and 8 spend 0: infinite CIs, inconclusive, checks never
    pass, even for data far beyond the margin; the look at 12 decides. Catches: a look with a_j = 0 that decides
    (rank(n, 0) must be 0)."""
    s = R.Schedule(4, 24, ALPHA9)
    d = np.full(12, 5.0)
    looks = R.path(d, 1.0, s, control=d, nokl=d, nokl_margin=1.0)
    for look in looks[:2]:
        assert (look["a_j"], look["reachable"], look["verdict"]) == (0.0, False, T.INCONCLUSIVE)
        assert look["lo"] == -np.inf and not look["control_detected"] and not look["acts"]
    assert looks[2]["verdict"] == T.MATERIAL and looks[2]["reachable"]


# ---------------------------------------------------------------- rules on equivalence, decisions


def _look(j, verdict, final=False, control=None, acts=None, nonzero=False):
    return {"j": j, "n": 4 * j, "a_j": 0.001, "estimate": float(j), "lo": 0.0, "hi": 1.0, "lo90": 0.1, "hi90": 0.9,
            "nonzero": nonzero, "side": 0, "verdict": verdict, "final": final, "control_detected": control,
            "acts": acts}  # fmt: skip


@pytest.mark.parametrize(
    "verdict, control, acts, effective",
    [
        (T.EQUIVALENT, True, True, T.EQUIVALENT),
        (T.EQUIVALENT, None, None, T.EQUIVALENT),  # a comparison without checks
        (T.EQUIVALENT, False, True, T.INSENSITIVE),
        (T.EQUIVALENT, True, False, T.INERT),
        (T.EQUIVALENT, False, False, T.INSENSITIVE),  # insensitive first
        (T.EQUIVALENT, None, False, T.INERT),
        (T.MATERIAL, False, False, T.MATERIAL),  # a material difference needs neither check
        (T.NONZERO, False, False, T.NONZERO),
    ],
)
def test_effective_verdict(verdict, control, acts, effective):
    """Catches: a material verdict withheld by a check, a missing check treated as failed, the precedence."""
    assert R.effective_verdict(_look(1, verdict, control=control, acts=acts)) == effective


def test_decide_takes_the_first_settling_look():
    """Settles at the FIRST material or effective equivalent; "non-zero" and "inert" do not settle; unsettled keeps
    the last look's verdict, "open" before the cap, "unsettled at cap" after. Catches: the last or best look
    taken, "non-zero" stopping the comparison, an inert equivalence settling it."""
    d = R.decide([_look(1, T.NONZERO), _look(2, T.EQUIVALENT, acts=False), _look(3, T.EQUIVALENT, acts=True),
                  _look(4, T.MATERIAL)])  # fmt: skip
    assert (d["verdict"], d["settled"], d["j"], d["n"], d["estimate"], d["status"]) == (
        T.EQUIVALENT, True, 3, 12, 3.0, "settled")  # fmt: skip
    d = R.decide([_look(1, T.NONZERO), _look(2, T.EQUIVALENT, acts=False, nonzero=True)])
    assert (d["verdict"], d["settled"], d["open"], d["status"], d["nonzero"]) == (T.INERT, False, True, "open", True)
    assert T.label(d["verdict"], d["nonzero"]) == (
        "the penalty is inert here: placement is not testable at this β; non-zero (the CI excludes 0)"
    )
    assert T.label(T.INSENSITIVE) == "insensitive: the margin-sized positive control was not detected"
    d = R.decide([_look(1, T.INCONCLUSIVE), _look(2, T.NONZERO, final=True)])
    assert (d["verdict"], d["settled"], d["open"], d["cap_reached"], d["status"]) == (
        T.NONZERO, False, False, True, "unsettled at cap")  # fmt: skip
    assert R.decide([])["status"] == "open"


def test_checks_in_the_rule_on_data():
    """Cap 12 at 0.05/9: only n = 12 spends (all of alpha_q: k1 = 1, k2 = rank(12, 0.0056) = 2, F(1) = 13/4096). d
    is equivalent there; it settles only when the control is detected and the penalty acts, each one-sided at rank
    k2 in its calibrated direction; a calibrated direction of 0 never passes. Catches: checks ignored, direction
    ignored, direction 0 treated as passing, the acts check against 0 or non-strict at its margin."""
    s = R.Schedule(4, 12, ALPHA9)
    assert s.levels().tolist() == [0, 0, ALPHA9] and (T.rank(12, ALPHA9 / 2), T.rank(12, ALPHA9)) == (1, 2)
    d = np.linspace(-0.2, 0.2, 12)
    strong, weak = np.linspace(1.0, 2.0, 12), np.linspace(-1.0, 2.0, 12)
    edge = np.r_[0.5, 1.0, np.linspace(1.5, 3.0, 10)]  # x_(2) = 1.0: not beyond a margin of 1
    verdict = lambda **kw: R.decide(R.path(d, 1.0, s, **kw))["verdict"]
    assert verdict() == T.EQUIVALENT
    assert verdict(control=strong) == T.EQUIVALENT
    assert verdict(control=weak) == T.INSENSITIVE
    assert verdict(control=-strong, control_direction=-1) == T.EQUIVALENT
    assert verdict(control=strong, control_direction=-1) == T.INSENSITIVE
    assert verdict(control=strong, control_direction=0) == T.INSENSITIVE
    assert verdict(nokl=edge + 0.01, nokl_margin=1.0) == T.EQUIVALENT
    assert verdict(nokl=edge, nokl_margin=1.0) == T.INERT
    assert verdict(nokl=-edge - 0.01, nokl_margin=1.0, nokl_direction=-1) == T.EQUIVALENT
    assert verdict(nokl=edge + 0.01, nokl_margin=1.0, nokl_direction=0) == T.INERT
    assert verdict(control=weak, nokl=edge, nokl_margin=1.0) == T.INSENSITIVE
