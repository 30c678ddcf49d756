"""ablations/comparisons.py: every comparison's per-instance table on hand-made runs whose values are known."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ablations.comparisons import comparisons, table, trajectory_at
from ablations.protocol_params import Primary

PROTOCOL = {
    "margins": {"gold": 0.1, "log_kl": 0.3},
    "levels": [1.0, 2.0, 4.0],
    "coef": 0.1,
    "tuned": {"reward_k1": 0.03, "loss_k3": 0.3},
    "control_direction": {"gold": 1, "log_kl": -1},
    "no_kl_direction": {"gold": -1, "log_kl": 1},
    "no_kl_contrast": {"0.03": -0.5, "0.1": -0.4, "0.3": 0.0},
}
Q = {
    "same_beta": Primary(arm="loss_k3", other="reward_k3", role="act", metric="gold", kind="placement"),
    "frontier": Primary(arm="loss_k3", other="reward_k1", role="levels", metric="gold", kind="placement"),
    "kl_vs_none": Primary(arm="reward_k1", other="none", role="levels", metric="gold", kind="penalty"),
    "camps": Primary(arm="loss_k3", other="reward_k1", role="tuned", metric="gold", kind="practice"),
}


def ev(gold, kl) -> pd.DataFrame:
    return pd.DataFrame({"iteration": range(len(gold)), "gold": gold, "kl": kl})


def test_trajectory_at_interpolates_gold_linearly_in_kl_at_the_first_crossing():
    e = ev([0.0, 0.4, 1.0, 0.2], [0.0, 1.0, 3.0, 6.0])
    assert trajectory_at(e, 2.0) == (pytest.approx(0.7), True)  # between (1, 0.4) and (3, 1.0)
    assert trajectory_at(e, 1.0) == (pytest.approx(0.4), True)  # exactly at an evaluation
    assert trajectory_at(e, 0.0) == (0.0, True)  # the SFT policy
    assert trajectory_at(ev([0.0, 0.5, 0.3], [0.0, 4.0, 2.0]), 3.0) == (pytest.approx(0.375), True)  # the FIRST
    assert trajectory_at(e, 10.0) == (0.2, False)  # never reached: its last gold, flagged


def test_comparisons_expand_levels_and_name_them():
    names = [c.name for c in comparisons(Q, 3)]
    assert names == ["same_beta", "frontier_level1", "frontier_level2", "frontier_level3", "kl_vs_none_level1",
                     "kl_vs_none_level2", "kl_vs_none_level3", "camps"]  # fmt: skip
    frontier = comparisons(Q, 3)[2]
    assert frontier.level == 2 and frontier.cells() == [("loss_k3", "level2"), ("reward_k1", "level2")]
    assert comparisons(Q, 3)[4].cells() == [("reward_k1", "level1")]  # the no-KL trajectory is no design cell


def runs_and_evals():
    """Instances 0 and 1 (instance 1 with two seeds): every cell's final gold and KL planted."""
    rows, evals = [], []

    def add(i, s, arm, role, gold, kl, trajectory=None):
        rows.append(dict(instance=i, seed=s, arm=arm, role=role, final_gold=gold, final_kl=kl))
        if trajectory is not None:
            evals.append(ev(*trajectory).assign(instance=i, seed=s, arm=arm))

    for i, seeds in ((0, (0,)), (1, (0, 1))):
        for s in seeds:
            add(i, s, "none", None, 0.0, 9.0, ([0.0, 0.4, 1.0, 0.0], [0.0, 1.0, 3.0, 9.0]))
            add(i, s, "reward_k1", "act", 0.8 + 0.1 * i, 2.0)
            add(i, s, "reward_k1", "control", 0.7 + 0.1 * i + 0.05 * s, 3.0)
            add(i, s, "loss_k3", "act", 0.5, 2.5)
            add(i, s, "reward_k3", "act", 0.6 + 0.2 * s, 4.0)
            add(i, s, "loss_k3", "tuned", 0.9, 2.0)
            add(i, s, "reward_k1", "tuned", 0.85, 2.0)
            for k, lvl in enumerate((1.0, 2.0, 4.0), 1):
                add(i, s, "loss_k3", f"level{k}", 0.3 * k, lvl * (1.3 if i else 1.0))  # instance 1 misses by 30%
                add(i, s, "reward_k1", f"level{k}", 0.2 * k, lvl)
    return pd.DataFrame(rows), pd.concat(evals, ignore_index=True)


def test_a_coefficient_comparison_has_its_difference_control_and_no_kl_contrast():
    runs, evals = runs_and_evals()
    c = comparisons(Q, 3)[0]
    t, meta = table(runs, evals, c, PROTOCOL, "reward_k1", 0.25)
    # seeds averaged first: instance 1's reward_k3 is mean(0.6, 0.8) = 0.7
    assert t.d.tolist() == pytest.approx([0.5 - 0.6, 0.5 - 0.7])
    assert t.control.tolist() == pytest.approx([0.1, 0.9 - 0.825])
    assert t.acts.tolist() == pytest.approx([0.0 - 0.6, 0.0 - 0.7])  # no KL minus the other's cell
    assert meta == {"margin": 0.1, "level": None, "control_direction": 1, "acts_margin": 0.1, "acts_direction": -1}
    assert "hit_arm" not in t


def test_a_tuned_comparison_takes_the_calibrated_no_kl_contrast_at_the_other_arms_tuned_coef():
    runs, evals = runs_and_evals()
    _, meta = table(runs, evals, comparisons(Q, 3)[-1], PROTOCOL, "reward_k1", 0.25)
    assert meta["acts_direction"] == -1  # the contrast at reward_k1's tuned 0.03 is -0.5
    tuned0 = {**PROTOCOL, "tuned": {"reward_k1": 0.3, "loss_k3": 0.3}}  # calibration saw no contrast at 0.3
    assert table(runs, evals, comparisons(Q, 3)[-1], tuned0, "reward_k1", 0.25)[1]["acts_direction"] == 0


def test_a_level_comparison_has_hits_and_a_log_kl_no_kl_contrast():
    runs, evals = runs_and_evals()
    t, meta = table(runs, evals, comparisons(Q, 3)[2], PROTOCOL, "reward_k1", 0.25)  # level 2: 2 nats
    assert t.d.tolist() == pytest.approx([0.6 - 0.4, 0.6 - 0.4])
    assert t.hit_arm.tolist() == [True, False] and t.hit_other.tolist() == [True, True]  # 30% off misses
    assert t.acts.tolist() == pytest.approx([math.log(9) - math.log(2)] * 2)
    assert meta["acts_margin"] == 0.3 and meta["acts_direction"] == 1 and meta["level"] == 2.0


def test_the_no_kl_trajectory_is_read_at_the_level():
    runs, evals = runs_and_evals()
    t, _ = table(runs, evals, comparisons(Q, 3)[4], PROTOCOL, "reward_k1", 0.25)  # level 1: no KL gold 0.4
    assert t.d.tolist() == pytest.approx([0.2 - 0.4, 0.2 - 0.4])
    assert t.acts.isna().all() and t.hit_other.all()
    t, _ = table(runs, evals, comparisons(Q, 3)[5], PROTOCOL, "reward_k1", 0.25)  # level 2: (1, 0.4) - (3, 1.0)
    assert t.d.tolist() == pytest.approx([0.4 - 0.7] * 2)
    assert np.isnan(t.acts).all()
