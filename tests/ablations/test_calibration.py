"""ablations/calibration.py: what the calibration stage fixes on the calibration instances, on hand-made runs whose
every value is known, and on synthetic calibration runs (tests/ablations/synthetic.py)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from ablations import calibration as C
from ablations.config import CalibrationParams, load_params
from ablations.load import load_runs

from ..helpers import REPO
from . import synthetic as syn

REF = "reward_k1"


# the values these hand-made runs are computed for; every other calibration knob is the repository's (params.yaml's
# grammar section), so a knob added to the schema needs no edit here
RULES = dict(instances=[0, 1], plan_instances=[5, 6], coefs=[0.01, 0.1, 1.0], margin_fraction=0.25, gain="peak",
             acts=1.0, levels=[0.125, 0.25, 0.5], log_kl_fraction=0.25)  # fmt: skip


def rules(**overrides) -> CalibrationParams:
    """The calibration rules of these tests: RULES, then ``overrides`` (a tuple reads as a list)."""
    base = load_params(REPO / "params.yaml").grammar.calibration.model_dump()
    values = {**base, **RULES, **{k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}}
    return CalibrationParams.model_validate(values)


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
    assert {k: v for k, v in peak["margins"].items() if k != "log_kl"} == {
        "gold": pytest.approx(0.25 * 0.85), "ood_gold": pytest.approx(0.25 * 0.85)}  # fmt: skip
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


def test_levels_are_fractions_of_the_median_final_kl_of_the_no_kl_runs():
    runs, evals = make(GOLD)
    # final KL 8 and 10 -> median 9
    assert calibrate(runs, evals, rules(levels=(0.1, 0.5, 0.9)))["levels"] == pytest.approx([0.9, 4.5, 8.1])
    assert calibrate(runs, evals)["no_kl"]["peak_kl"] == [2.0, 4.0]


def test_coef_is_the_best_gold_among_the_coefficients_where_the_penalty_acts():
    """Instance means: no KL final gold 0.5; reference arm 0.55 / 0.85 / 0.65 at 0.01 / 0.1 / 1.0, so the no-KL
    contrast is -0.05 / -0.35 / -0.15 against a margin of 0.2125."""
    runs, evals = make(GOLD)
    out = calibrate(runs, evals, rules(acts=1.0))  # acts where |contrast| >= 0.2125: only 0.1
    assert out["coef"] == 0.1 and out["acts_on_calibration"] is True
    assert out["no_kl_contrast"] == {"0.01": pytest.approx(-0.05), "0.1": pytest.approx(-0.35),
                                     "1": pytest.approx(-0.15)}  # fmt: skip
    out = calibrate(runs, evals, rules(acts=2.0))  # nothing acts (0.425): the largest contrast, flagged
    assert out["coef"] == 0.1 and out["acts_on_calibration"] is False
    # RLVR-like: the best gold is where the penalty does least; the coef is the best among the acting ones
    rlvr = {REF: {0.01: 0.5, 0.1: 0.45, 1.0: 0.1}, "loss_k3": GOLD["loss_k3"]}  # contrast -0.05, 0.0, 0.35
    out = calibrate(*make(rlvr), rules(acts=1.0))
    assert out["tuned"][REF] == 0.01 and out["coef"] == 1.0 and out["acts_on_calibration"] is True
    assert out["no_kl_direction"]["gold"] == 1  # no KL keeps more gold than the reference arm at 1.0


def test_best_coefficient_per_arm_ties_go_to_the_smaller():
    runs, evals = make(GOLD)
    out = calibrate(runs, evals)
    assert out["tuned"] == {REF: 0.1, "loss_k3": 0.01}
    tie = {REF: {0.01: 0.5, 0.1: 0.8, 1.0: 0.8}, "loss_k3": {0.01: 0.7, 0.1: 0.7, 1.0: 0.7}}
    out = calibrate(*make(tie))
    assert out["tuned"] == {REF: 0.1, "loss_k3": 0.01}
    assert out["calibration_gold"][REF] == {"0.01": pytest.approx(0.55), "0.1": pytest.approx(0.85),
                                            "1": pytest.approx(0.85)}  # fmt: skip


def test_control_is_interpolated_in_log_beta_to_one_margin():
    """From coef 0.1 (gold 0.85): the stronger side reaches only 0.2 at 1.0 (< the 0.2125 margin), so the weaker
    side: 0.3 at 0.01, crossed at t = 0.2125 / 0.3 of the way in log beta: 0.1 x 10^-t."""
    out = calibrate(*make(GOLD))
    t = 0.2125 / 0.3
    assert out["control_interpolated"] is True
    assert out["control_coef"] == pytest.approx(0.1 * 10**-t)
    assert out["control_effect"]["gold"] == pytest.approx(0.2125)  # exactly one margin, by construction
    # log KL 5 / (1 + 10 c): ln 2.5 at 0.1, ln(5 / 1.1) at 0.01, interpolated the same way
    lk = math.log(2.5) + t * (math.log(5 / 1.1) - math.log(2.5))
    assert out["control_effect"]["log_kl"] == pytest.approx(math.log(2.5) - lk)
    # the stronger side first: gold 0.5 at 1.0 crosses 0.2125 below 0.85 at t = 0.2125 / 0.35
    strong = {REF: {0.01: 0.5, 0.1: 0.8, 1.0: 0.45}, "loss_k3": GOLD["loss_k3"]}
    out = calibrate(*make(strong))
    assert out["control_coef"] == pytest.approx(0.1 * 10 ** (0.2125 / 0.35))
    # neither side reaches one margin: the nearest calibration coefficient, not interpolated
    flat = {REF: {0.01: 0.75, 0.1: 0.8, 1.0: 0.7}, "loss_k3": GOLD["loss_k3"]}
    out = calibrate(*make(flat), rules(acts=1.0))
    assert out["control_interpolated"] is False and out["control_coef"] == 1.0
    assert C.choose_control(pd.Series({0.01: 0.25, 0.1: 0.5, 1.0: 0.75}), 0.1, 0.125) == (
        pytest.approx(0.1 * 10**0.5), True)  # fmt: skip


def test_log_kl_margin_is_a_fraction_of_what_the_reference_arm_does_to_log_kl():
    out = calibrate(*make(GOLD))  # no KL: mean(ln 8, ln 10); reference at 0.1: ln 2.5
    want = 0.25 * abs((math.log(8) + math.log(10)) / 2 - math.log(2.5))
    assert out["margins"] == {"gold": pytest.approx(0.2125), "log_kl": pytest.approx(want)}


def test_directions_of_the_controls():
    """control_direction: the sign of (reference arm at coef - at control_coef) on calibration, per metric;
    no_kl_direction: the sign of (no KL - reference arm at coef), for gold and for log KL."""
    log_kl = {REF: {0.01: 2.0, 0.1: 1.0, 1.0: -1.0}, "loss_k3": {0.01: 2.0, 0.1: 1.5, 1.0: 0.0}}
    out = calibrate(*make(GOLD, log_kl=log_kl))
    assert out["control_direction"] == {"gold": 1, "log_kl": -1}  # the weaker control: more KL, less gold
    assert out["no_kl_direction"] == {"gold": -1, "log_kl": 1}


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
    same = {REF: {0.01: 0.5, 0.1: 0.8, 1.0: 0.6}, "loss_k3": GOLD["loss_k3"]}
    flat_kl = {a: dict.fromkeys((0.01, 0.1, 1.0), math.log(9)) for a in (REF, "loss_k3")}  # as no KL's
    runs, evals = make(same, log_kl=flat_kl, no_kl={(0, 0): ([0.0, 0.9], [0.0, 9.0]), (1, 0): ([0.2, 1.0], [0.0, 9.0])})
    with pytest.raises(ValueError, match="no log-KL margin"):
        calibrate(runs, evals)


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
    assert set(out) == set(want) - {"frozen", "plan", "plan_frozen"}
    for key in ("coef", "acts_on_calibration", "tuned", "control_interpolated", "control_direction",
                "no_kl_direction", "calibration_instances"):  # fmt: skip
        assert out[key] == want[key], key
    assert out["control_coef"] == pytest.approx(want["control_coef"], rel=0.1)
    assert set(out["no_kl"]) == set(want["no_kl"])
    assert out["margins"] == pytest.approx(want["margins"], rel=0.1)
    assert out["levels"] == pytest.approx(want["levels"], rel=0.1)
    assert out["no_kl_contrast"] == pytest.approx(want["no_kl_contrast"], abs=0.01)
    assert out["control_effect"] == pytest.approx(want["control_effect"], rel=0.1)
