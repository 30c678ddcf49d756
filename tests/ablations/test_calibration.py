"""ablations/calibration.py: what the calibration stage fixes on the calibration instances, on hand-made runs whose
every value is known, and on synthetic calibration runs (tests/ablations/synthetic.py)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ablations import calibration as C
from ablations.config import CalibrationParams
from ablations.load import load_runs

from . import synthetic as syn

REF = "reward_k1"


def rules(gain="peak", at="peak", fraction=1.0, margin_fraction=0.25, coefs=(0.01, 0.1, 1.0)) -> CalibrationParams:
    """params.yaml's grammar calibration rules (any other knob) with these values."""
    varied = dict(instances=[0, 1], coefs=list(coefs), margin_fraction=margin_fraction, gain=gain)
    return CalibrationParams(**{**syn.RULES["grammar"], **varied, "target": dict(at=at, fraction=fraction)})


# the no-KL runs: (instance, seed) -> (gold per evaluation, exact KL per evaluation); evaluation 0 is the SFT policy
NO_KL = {
    (0, 0): ([0.0, 0.5, 0.9, 0.9, 0.4], [0.0, 1.0, 2.0, 3.0, 8.0]),  # peak 0.9 first at KL 2 (a tie: the first)
    (1, 0): ([0.2, 0.6, 1.0, 0.8, 0.6], [0.0, 2.0, 4.0, 6.0, 10.0]),  # peak 1.0 at KL 4
}
# gain (peak) = mean(0.9 - 0.0, 1.0 - 0.2) = 0.85; gain (final) = mean(0.4 - 0.0, 0.6 - 0.2) = 0.4


def make(gold: dict[str, dict[float, float]], no_kl=NO_KL, log_kl: dict[str, dict[float, float]] | None = None):
    """(runs, evals) of calibration runs: the no-KL runs of ``no_kl`` and, for every arm and coefficient of
    ``gold``, one run per instance 0 and 1 with that final gold (instance 1 shifted by +0.1, so instance means
    differ but arm differences do not) and final KL exp(log_kl) (default: 5 / (1 + 10 coef))."""
    runs, evals = [], []
    for (i, s), (g, k) in no_kl.items():
        runs.append(dict(kind="calibration_baseline", instance=i, seed=s, arm="none", level=None, sft_gold=g[0],
                         final_gold=g[-1], final_kl=k[-1]))  # fmt: skip
        evals += [dict(kind="calibration_baseline", instance=i, seed=s, iteration=5 * j, gold=gj, kl=kj)
                  for j, (gj, kj) in enumerate(zip(g, k))]  # fmt: skip
    for arm, by_coef in gold.items():
        for c, v in by_coef.items():
            kl = math.exp(log_kl[arm][c]) if log_kl else 5 / (1 + 10 * c)
            for i in (0, 1):
                runs.append(dict(kind="calibration", instance=i, seed=0, arm=arm, level=c, sft_gold=0.1 * i,
                                 final_gold=v + 0.1 * i, final_kl=kl))  # fmt: skip
    return pd.DataFrame(runs), pd.DataFrame(evals)


GOLD = {REF: {0.01: 0.5, 0.1: 0.8, 1.0: 0.6}, "loss_k3": {0.01: 0.7, 0.1: 0.6, 1.0: 0.3}}


def calibrate(runs, evals, r=None, arms=(REF, "loss_k3"), metrics=("gold",)):
    return C.calibrate(runs, evals, task="grammar", rules=r or rules(), reference_arm=REF, arms=list(arms),
                       metrics=list(metrics))  # fmt: skip


def test_gain_is_peak_or_final_gold_minus_sft_and_the_margin_a_fraction_of_it():
    runs, evals = make(GOLD)
    peak = calibrate(runs, evals, rules(gain="peak", margin_fraction=0.25), metrics=("gold", "ood_gold"))
    assert peak["no_kl"]["gain"] == pytest.approx(0.85)
    assert peak["margins"] == {"gold": pytest.approx(0.25 * 0.85), "ood_gold": pytest.approx(0.25 * 0.85)}
    final = calibrate(runs, evals, rules(gain="final", margin_fraction=0.5))
    assert final["no_kl"]["gain"] == pytest.approx(0.4) and final["margins"]["gold"] == pytest.approx(0.2)
    nk = peak["no_kl"]
    assert (nk["sft_gold"], nk["peak_gold"], nk["final_gold"]) == pytest.approx((0.1, 0.95, 0.5))
    assert nk["peak_iteration"] == [10, 10] and peak["calibration_instances"] == [0, 1]
    assert peak["rules"] == rules(gain="peak", margin_fraction=0.25).model_dump()


def test_seeds_are_averaged_within_an_instance_before_the_instances():
    """Instance 0 with two seeds weighs as much as instance 1 with one."""
    no_kl = {**NO_KL, (0, 1): ([0.0, 0.3, 0.3, 0.3, 0.3], [0.0, 1.0, 1.0, 1.0, 1.0])}
    runs, evals = make(GOLD, no_kl)
    out = calibrate(runs, evals, rules(gain="peak"))
    assert out["no_kl"]["gain"] == pytest.approx(((0.9 + 0.3) / 2 + 0.8) / 2)  # not (0.9 + 0.3 + 0.8) / 3


def test_kl_target_is_a_fraction_of_the_median_kl_at_the_peak_or_at_the_end():
    runs, evals = make(GOLD)
    # peak KL: 2.0 (instance 0: the FIRST evaluation with the highest gold) and 4.0 -> median 3.0
    assert calibrate(runs, evals, rules(at="peak", fraction=1.0))["kl_target"] == pytest.approx(3.0)
    assert calibrate(runs, evals, rules(at="peak", fraction=0.5))["kl_target"] == pytest.approx(1.5)
    assert calibrate(runs, evals, rules(at="final", fraction=1.0))["kl_target"] == pytest.approx(9.0)  # 8, 10
    assert calibrate(runs, evals)["no_kl"]["peak_kl"] == [2.0, 4.0]


def test_best_coefficient_per_arm_ties_go_to_the_smaller():
    runs, evals = make(GOLD)
    out = calibrate(runs, evals)
    assert out["coef"] == 0.1 and out["tuned"] == {REF: 0.1, "loss_k3": 0.01}
    tie = {REF: {0.01: 0.5, 0.1: 0.8, 1.0: 0.8}, "loss_k3": {0.01: 0.7, 0.1: 0.7, 1.0: 0.7}}
    out = calibrate(*make(tie))
    assert out["coef"] == 0.1 and out["tuned"]["loss_k3"] == 0.01
    assert out["calibration_gold"][REF] == {"0.01": pytest.approx(0.55), "0.1": pytest.approx(0.85),
                                            "1": pytest.approx(0.85)}  # fmt: skip


def test_control_is_the_coefficient_whose_gold_differs_by_closest_to_one_margin():
    # margin = 0.25 x 0.85 = 0.2125; reference arm at its best 0.1 has gold 0.8: |0.8 - 0.5| = 0.3 (0.0875 from
    # the margin), |0.8 - 0.6| = 0.2 (0.0125 from it) -> control 1.0
    out = calibrate(*make(GOLD))
    assert out["control_coef"] == 1.0
    assert out["control_effect"]["gold"] == pytest.approx(0.2)
    # margin_fraction 1 (margin 0.85): 0.3 is closer to it than 0.2 -> 0.01
    assert calibrate(*make(GOLD), rules(margin_fraction=1.0))["control_coef"] == 0.01
    # ties go to the smaller coefficient: 0.01 and 1.0 both differ from 0.1 by 0.3
    tie = {REF: {0.01: 0.5, 0.1: 0.8, 1.0: 0.5}, "loss_k3": GOLD["loss_k3"]}
    assert calibrate(*make(tie))["control_coef"] == 0.01
    assert C.choose_control(pd.Series({0.01: 0.25, 0.1: 0.5, 1.0: 0.75}), 0.1, 0.125) == 0.01


def test_directions_of_the_controls():
    """control_direction: the sign of (reference arm at coef - at control_coef) on calibration, per metric;
    no_kl_direction: the sign of (no KL - reference arm at coef), for gold and for log KL."""
    log_kl = {REF: {0.01: 2.0, 0.1: 1.0, 1.0: -1.0}, "loss_k3": {0.01: 2.0, 0.1: 1.5, 1.0: 0.0}}
    out = calibrate(*make(GOLD, log_kl=log_kl))
    assert out["control_coef"] == 1.0
    assert out["control_effect"] == {"gold": pytest.approx(0.2), "log_kl": pytest.approx(2.0)}
    assert out["control_direction"] == {"gold": 1, "log_kl": 1}
    # no KL final gold: mean(0.4, 0.6) = 0.5 < 0.85 (reference at 0.1); its final KL exp(mean log(8, 10)) > e^1.05
    assert out["no_kl_direction"] == {"gold": -1, "log_kl": 1}
    worse = {REF: {0.01: 0.9, 0.1: 1.0, 1.0: 1.25}, "loss_k3": GOLD["loss_k3"]}  # the control costs nothing: +
    out = calibrate(*make(worse, log_kl=log_kl))
    assert out["coef"] == 1.0 and out["control_coef"] == 0.1  # |1.25 - 1.0| = 0.25 is closest to 0.2125
    assert out["control_direction"] == {"gold": 1, "log_kl": -1}  # gold(1.0) > gold(0.1), log KL(1.0) < log KL(0.1)


def test_refuses_a_calibration_without_gain_or_without_runs():
    flat = {k: ([g[0]] * len(g), kl) for k, (g, kl) in NO_KL.items()}
    with pytest.raises(ValueError, match="gain no gold"):
        calibrate(*make(GOLD, flat))
    runs, evals = make(GOLD)
    with pytest.raises(ValueError, match="no calibration no-KL runs"):
        calibrate(runs[runs.kind != "calibration_baseline"], evals)
    with pytest.raises(ValueError, match="no calibration runs of arm"):
        calibrate(runs, evals, arms=(REF, "loss_k3", "reward_k3"))
    one = {REF: {0.1: 0.8}, "loss_k3": {0.1: 0.6}}
    with pytest.raises(ValueError, match="second calibration coefficient"):
        calibrate(*make(one))


def test_reads_only_calibration_runs():
    """Evaluation runs in the same table change nothing: the calibration never looks at an evaluation instance."""
    runs, evals = make(GOLD)
    out = calibrate(runs, evals)
    leak = runs[runs.kind == "calibration"].assign(kind="fixed", instance=100, final_gold=9.0)
    base = runs[runs.kind == "calibration_baseline"].assign(kind="baseline", instance=100, final_gold=-9.0)
    ev = evals.assign(kind="baseline", instance=100, gold=9.0)
    again = calibrate(pd.concat([runs, leak, base]), pd.concat([evals, ev]))
    assert again == out and 100 not in again["calibration_instances"]


@pytest.mark.parametrize("task", ["grammar", "arithmetic"])
def test_calibrate_on_synthetic_calibration_runs_gives_the_synthetic_protocol(tmp_path, task):
    """calibrate() on the synthetic calibration runs (loaded as the stage loads them) returns every key of
    synthetic.calibrated(), with its coefficients, directions and (within the planted noise) margins and KL
    target: the evaluation tests judge runs against a protocol the calibration would have fixed."""
    exp = syn.write_calibration_runs(tmp_path, task=task)
    runs, evals = load_runs(exp, tmp_path)
    r = CalibrationParams(**syn.RULES[task])
    metrics = ["gold"] if task == "grammar" else ["gold", "ood_gold"]
    out = C.calibrate(runs, evals, task=task, rules=r, reference_arm=REF, arms=list(syn.CALIBRATION_ARMS),
                      metrics=metrics)  # fmt: skip
    want = syn.calibrated(task)
    assert set(out) == set(want) - {"frozen"}
    for key in ("coef", "control_coef", "tuned", "control_direction", "no_kl_direction", "calibration_instances"):
        assert out[key] == want[key], key
    assert set(out["no_kl"]) == set(want["no_kl"])
    for m in metrics:
        assert out["margins"][m] == pytest.approx(want["margins"][m], rel=0.2)
    assert out["kl_target"] == pytest.approx(want["kl_target"], rel=0.25)
    for k, v in want["control_effect"].items():
        assert np.sign(out["control_effect"][k]) == np.sign(v)
