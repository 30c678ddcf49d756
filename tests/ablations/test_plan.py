"""ablations/plan.py: the sample-size plan of protocol v4 on synthetic planning runs (tests/ablations/synthetic.py
write_plan_runs: the no-KL baseline and every design entry of params.yaml on the planning instances), as the
planning stage reads them. The rule's constants are params.yaml's but for a small simulation (the plan's own Monte
Carlo is tested in test_simulate.py)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ablations import plan as PL
from ablations.comparisons import comparisons, primary_comparisons, table
from ablations.load import load_runs

from . import synthetic as syn

SEQ = {**syn._P["analysis"]["sequential"], "batch_size": 4, "max_cap": 24, "simulations": 300}
PROTO = syn.protocol(sequential=SEQ)
CAL = syn.calibrated("grammar")


def planning(tmp_path, noise: float = 0.005, **kw) -> tuple[pd.DataFrame, pd.DataFrame]:
    return load_runs(syn.write_plan_runs(tmp_path, noise=noise, **kw), tmp_path)


def test_every_comparison_gets_a_cap_from_its_own_planning_rows(tmp_path):
    """Every primary comparison (a frontier question once per level) is planned on the 8 planning instances: a cap
    in whole batches up to the max cap, the power there, and its noise in margins; the rule's constants are
    recorded beside them."""
    runs, evals = planning(tmp_path)
    out = PL.plan(runs, evals, "grammar", PROTO, CAL)
    assert list(out["comparisons"]) == syn.comparison_names()
    assert out["plan_instances"] == syn._P["grammar"]["calibration"]["plan_instances"]
    rule = out["rule"]
    assert (rule["comparisons"], rule["batch_size"], rule["max_cap"], rule["simulations"]) == (9, 4, 24, 300)
    assert rule["alpha_per_comparison"] == pytest.approx(0.05 / 9) and rule["effect_margins"] == SEQ["effect"]
    for name, c in out["comparisons"].items():
        assert c["cap"] % 4 == 0 and 4 <= c["cap"] <= 24, name
        assert c["n_plan"] == 8 and c["margin"] == CAL["margins"]["gold"]
        assert c["reached"] == (min(c["power_pos"], c["power_neg"]) >= SEQ["power"]), name
        assert (c["level"] is None) == (not name.startswith(("frontier", "kl_vs_none"))), name
    # tight noise (SD well below a margin): a 2-margin difference is settled at the first decidable look, n = 12
    assert {c["cap"] for c in out["comparisons"].values()} == {12}


def test_the_noise_is_the_comparisons_planning_differences(tmp_path):
    """sd, median, skewness and the hit rates come from the comparison's own per-instance table (the same table the
    analysis reads): recomputed here from ablations.comparisons.table."""
    runs, evals = planning(tmp_path)
    out = PL.plan(runs, evals, "grammar", PROTO, CAL)
    for c in primary_comparisons(PROTO, 3):
        t, meta = table(runs, evals, c, CAL, PROTO.reference_arm, PROTO.tasks["grammar"].kl_tolerance)
        got = out["comparisons"][c.name]
        assert got["sd"] == pytest.approx(t.d.std(ddof=1)) and got["median"] == pytest.approx(np.median(t.d))
        assert got["sd_margins"] == pytest.approx(got["sd"] / meta["margin"])
        if c.level is not None:
            assert got["hit_rate_arm"] == pytest.approx(t.hit_arm.mean()), c.name
        else:
            assert got["hit_rate_arm"] is None


def test_a_noisier_comparison_plans_for_more_instances(tmp_path):
    """loss_k3's gold at the acting coefficient varies by ±2 margins across instances (same_beta, camps and the
    frontier read loss_k3): those comparisons plan for more instances than the tight ones, up to the max cap,
    where a plan that cannot reach the power says so (reached false)."""
    rng = np.random.default_rng(0)
    off = dict(zip(syn._P["grammar"]["calibration"]["plan_instances"], rng.normal(0, 0.06, 8)))
    runs, evals = planning(tmp_path, behaviours={"loss_k3": syn.Behaviour(instance_offset=off)})
    out = PL.plan(runs, evals, "grammar", PROTO, CAL)["comparisons"]
    assert out["same_gradient"]["cap"] == 12  # no loss_k3 in it: as tight as before
    assert out["same_beta"]["sd_margins"] > 1 and out["same_beta"]["cap"] > 12
    assert not out["camps"]["reached"] or out["camps"]["cap"] > 12
    for c in out.values():
        assert c["reached"] or (c["cap"] == 24 and min(c["power_pos"], c["power_neg"]) < SEQ["power"])


def test_a_comparison_with_fewer_than_two_planning_instances_is_refused(tmp_path):
    runs, evals = load_runs(syn.write_plan_runs(tmp_path, instances=[3]), tmp_path)
    with pytest.raises(ValueError, match=r"comparison same_beta has 1 planning instance\(s\); it needs 2 or more"):
        PL.plan(runs, evals, "grammar", PROTO, CAL)


def test_the_contract_checks_are_reported_on_the_planning_instances(tmp_path):
    """analysis.checks (k1 in the loss vs in the reward, log KL) gets the median of its planning differences and the
    exact sign-test CI: at 8 instances and 95% the order-statistic interval is the range (rank 1: P(Bin(8, 1/2) = 0)
    = 1/256 <= 0.025 < 9/256), and the two-sided sign p is 2 P(Bin(8, 1/2) <= min(#pos, #neg)). No cap: checks
    have no error budget and never enter the rule's comparison count."""
    runs, evals = planning(tmp_path, noise=0.05)
    out = PL.plan(runs, evals, "grammar", PROTO, CAL)
    assert list(out["checks"]) == list(PROTO.checks) == ["k1_in_loss"]
    assert out["rule"]["comparisons"] == len(out["comparisons"])  # checks are not counted
    (c,) = comparisons(PROTO.checks, 3)
    t, meta = table(runs, evals, c, CAL, PROTO.reference_arm, PROTO.tasks["grammar"].kl_tolerance)
    got, d = out["checks"]["k1_in_loss"], t.d.to_numpy(float)
    assert got["n"] == 8 and got["median"] == pytest.approx(np.median(d))
    assert (got["lo"], got["hi"]) == (d.min(), d.max()) and got["level"] == pytest.approx(0.95)
    k = min((d > 0).sum(), (d < 0).sum())
    assert got["p_sign"] == pytest.approx(min(1.0, 2 * sum(math.comb(8, i) for i in range(k + 1)) / 256))
    margin = meta["margin"]
    inside, beyond = -margin < d.min() and d.max() < margin, d.min() > margin or d.max() < -margin
    assert got["ci"] == ("beyond the margin" if beyond else "inside the margin" if inside else "neither")
