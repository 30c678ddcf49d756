"""ablations/simulate.py: protocol v4's whole sequential rule holds its budget on each v3 primary question's OWN
per-instance differences (skew and ties kept, the margin-sized control and the no-KL check in the rule), where v3's
rule (sign-flip test of the mean) does not; and the sample-size plan.

The residuals: tests/ablations/data/v3_differences.csv (how it was made: v3_differences.md beside it). Budget
alpha_q = 0.05/9 (K = 9 comparisons), batch 4, caps 24 and 48; 4,000 trials per Δ; a false rate passes when it is
<= alpha_q + 3 Monte Carlo SEs at the budget, sqrt(alpha_q (1 - alpha_q) / 4000) = 0.0012 (bound 0.0091).
Observed (seed 0): every false rate <= 0.0025 (the sign test is conservative: ties and discrete levels); the full
table at 20,000 trials is the slow test below and benchmarks/skew_simulation.py."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from ablations import rule as R
from ablations import signtest as T
from ablations import simulate as S

FIXTURE = Path(__file__).parent / "data" / "v3_differences.csv"
ALPHA_Q, SIMS = 0.05 / 9, 4000
QUESTIONS = [f"{t} {q}" for t in ("grammar", "arithmetic") for q in ("Q2", "Q3", "Q4")]


def bound(alpha: float, n: int) -> float:
    return alpha + 3 * math.sqrt(alpha * (1 - alpha) / n)


@pytest.fixture(scope="module")
def v3() -> pd.DataFrame:
    return pd.read_csv(FIXTURE)


def comparison(frame: pd.DataFrame, name: str, checks: bool = True) -> S.Comparison:
    task, q = name.split()
    g = frame[(frame.task == task) & (frame.question == q)].sort_values("instance")
    m = float(g.margin.iloc[0])
    if not checks:
        return S.Comparison(g.d.to_numpy(), m)
    return S.Comparison(
        g.d.to_numpy(), m, control=g.c.to_numpy(), control_direction=int(g.c_direction.iloc[0]),
        nokl=g.e.to_numpy(), nokl_direction=int(g.e_direction.iloc[0]), nokl_margin=m,
    )  # fmt: skip


def by(records, quantity):
    return {r["delta"]: r for r in records if r["quantity"] == quantity}


# ---------------------------------------------------------------- the design


def test_fixture_is_the_v3_residuals(v3):
    """24 instances (100-123) per question; the skewness the audit reported (scipy.stats.skew): arithmetic Q3 -1.97,
    Q4 -1.79, grammar Q4 -1.22; arithmetic's no-KL direction 0 and grammar's -1 (protocol/<task>.json at v3)."""
    assert len(v3) == 144
    skew = {f"{t} {q}": stats.skew(g.d) for (t, q), g in v3.groupby(["task", "question"])}
    assert skew["arithmetic Q3"] == pytest.approx(-1.968, abs=1e-3)
    assert skew["arithmetic Q4"] == pytest.approx(-1.789, abs=1e-3)
    assert skew["grammar Q4"] == pytest.approx(-1.218, abs=1e-3)
    for (_, _), g in v3.groupby(["task", "question"]):
        assert sorted(g.instance) == list(range(100, 124))
    assert set(v3[v3.task == "arithmetic"].e_direction) == {0} and set(v3[v3.task == "grammar"].e_direction) == {-1}


def test_shift_and_joint_resampling():
    """The shifted population has median exactly Δ for even n, with half the rows on each side (the sign test's worst
    case); resampling keeps a trial's d, control and no-KL columns from the same instances, and a trial's first
    instances do not depend on the cap. Catches: resampling the columns independently (the correlation lost), a
    shift to the mean, a median that is a data value for even n."""
    d = np.array([5.0, -1.0, 2.0, 0.0, 9.0, 1.0])
    pop = S.shift_median(d, 0.3)
    assert np.median(pop) == pytest.approx(0.3) and (pop < 0.3).sum() == (pop > 0.3).sum() == 3
    comp = S.Comparison(d, 1.0, control=10 * d, nokl=100 * d, nokl_margin=1.0)
    idx = S.draws(6, 50, 8, seed=1)
    rows = S.resample(comp, idx)
    np.testing.assert_allclose(rows["control"], 10 * (rows["d"] + np.median(d)))
    np.testing.assert_allclose(rows["nokl"], 100 * (rows["d"] + np.median(d)))
    np.testing.assert_array_equal(S.draws(6, 50, 16, seed=1)[:, :8], idx)
    with pytest.raises(ValueError):
        S.Comparison(d, 1.0, control=d[:3])


# ---------------------------------------------------------------- the level on the v3 residuals


@pytest.mark.parametrize("cap", [24, 48])
@pytest.mark.parametrize("name", QUESTIONS)
def test_whole_rule_holds_the_budget_on_each_questions_residuals(v3, name, cap):
    """The whole rule (controls in) and the test alone (no checks, so that equivalence is really exercised where the
    no-KL check makes it impossible): false material at Δ = 0, ±m; false equivalent at ±m, ±1.1m; false non-zero
    at 0 -- each <= alpha_q + 3 SE; "material or equivalent" at ±m <= 1.5 alpha_q + 3 SE (the union bound there).
    The bound is not met by never deciding: where the residuals allow (SD <= 0.9 margins: grammar Q4, arithmetic
    Q2-Q4) the rule settles a 2-margin difference and, without checks, an equivalence at 0, in over half the trials; on
    arithmetic the no-KL check (calibrated direction 0) withholds every equivalence as "inert"."""
    sch = R.Schedule(4, cap, ALPHA_Q)
    lim, lim_both = bound(ALPHA_Q, SIMS), bound(1.5 * ALPHA_Q, SIMS)
    tables = {checks: S.error_table(comparison(v3, name, checks), sch, n_sims=SIMS) for checks in (True, False)}
    for records in tables.values():
        for q in ("false material", "false equivalent", "false non-zero"):
            for delta, r in by(records, q).items():
                assert r["rate"] <= lim, (q, delta, r)
        assert all(r["rate"] <= lim_both for r in by(records, "false material or equivalent").values())
    low_noise = name in ("grammar Q4", "arithmetic Q2", "arithmetic Q3", "arithmetic Q4")
    if low_noise:
        assert all(r["rate"] > 0.5 for r in by(tables[True], "power material").values())
        assert by(tables[False], "power equivalent")[0.0]["rate"] > 0.5
    if name.startswith("arithmetic"):
        assert by(tables[True], "power equivalent")[0.0]["rate"] == 0.0  # inert: placement untestable at this β


def test_v3_rule_exceeds_its_budget_where_the_sign_test_does_not(v3):
    """The failure this replaces (issue 27, the audit: 0.054-0.071 against 0.0125). v3's rule -- sign-flip CIs of
    the mean, alpha 0.05/4 spread over 6 looks of batch 4 up to 24, the margin-sized control in the rule -- on
    arithmetic Q3's residuals (skewness -1.97), shifted to mean ±m: false material at +m and false equivalence at -m
    exceed 0.0125 + 3 SE (observed 0.049 and 0.063 over 2,000 trials). v4's rule on the same draws, shifted to median
    ±m, stays within its bound (observed <= 0.002)."""
    alpha, n = 0.05 / 4, 2000
    comp = comparison(v3, "arithmetic Q3")
    old = S.signflip_table(comp, 4, 24, alpha, n_sims=n, at=[1.0, -1.0])
    assert by(old, "false material")[1.0]["rate"] > bound(alpha, n)
    assert by(old, "false equivalent")[-1.0]["rate"] > bound(alpha, n)
    new = S.error_table(S.Comparison(comp.d, comp.margin), R.Schedule(4, 24, alpha), n_sims=n)
    for q in ("false material", "false equivalent"):
        assert max(r["rate"] for r in by(new, q).values()) <= bound(alpha, n)


# ---------------------------------------------------------------- the plan


def test_plan_cap_is_the_smallest_cap_with_the_power():
    """Normal differences with SD = 1 margin: the plan's cap reaches 80% at ±2m and every smaller decidable cap does
    not (rechecked on the same draws with max_cap one batch lower, which must return None and a power below
    target); an unreachable target returns None with the power at max_cap. Catches: the first cap above target on
    one sign only, powers from a different cap than the one returned."""
    d = np.random.default_rng(5).normal(0.0, 1.0, 60)
    comp = S.Comparison(d, 1.0)
    plan = S.plan_cap(comp, ALPHA_Q, batch_size=4, max_cap=60, n_sims=1000)
    cap = plan["cap"]
    assert cap is not None and plan["at"] == cap and min(plan["power_pos"], plan["power_neg"]) >= 0.8
    below = S.plan_cap(comp, ALPHA_Q, batch_size=4, max_cap=cap - 4, n_sims=1000)
    assert below["cap"] is None and min(below["power_pos"], below["power_neg"]) < 0.8 and below["at"] == cap - 4
    for c in range(12, cap, 4):
        assert S.plan_cap(comp, ALPHA_Q, batch_size=4, max_cap=c, n_sims=1000)["cap"] is None
    noisy = S.plan_cap(S.Comparison(d * 20, 1.0), ALPHA_Q, batch_size=4, max_cap=24, n_sims=500)
    assert noisy["cap"] is None and noisy["at"] == 24 and noisy["power_pos"] < 0.8


@pytest.mark.slow
def test_v3_residual_table_at_20000_trials(v3):
    """The acceptance table at 20,000 trials per Δ (both budgets the lead is choosing between, K = 9 and K = 5; caps
    24 and 48): every false rate of v4's whole rule <= alpha_q + 3 SE for every question; a few minutes."""
    for k in (9, 5):
        for cap in (24, 48):
            sch = R.Schedule(4, cap, 0.05 / k)
            for name in QUESTIONS:
                recs = S.error_table(comparison(v3, name), sch, n_sims=20000, seed=1)
                for q in ("false material", "false equivalent", "false non-zero"):
                    assert all(r["rate"] <= bound(0.05 / k, 20000) for r in by(recs, q).values()), (k, cap, name, q)
    assert T.rank(24, 0.05 / 9 / 4) >= 1
