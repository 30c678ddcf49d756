"""Pieces of the exploratory families (ablations/questions.py): family construction, and what answer_questions
reads from the evaluation runs now that the headline is carried by the primary comparisons alone (the exploratory
families keep their own names, Q1-Q3: restraint, matched coefficient, matched KL)."""

import numpy as np
import pytest

from ablations import questions as Q
from ablations.analysis import judged
from ablations.load import load_runs

from . import synthetic as syn


def test_pairs_cross_placements_within_estimators_and_compare_with_the_reference():
    specs = {**syn.CROSSED, "old_loss_k3": syn.spec("loss", "k3", target="old_policy")}
    pairs = Q.comparison_pairs(specs, "reward_k1")
    assert ("loss_k1", "reward_k1", "placement (k1)") in pairs and ("loss_k3", "reward_k3", "placement (k3)") in pairs
    assert ("old_loss_k3", "reward_k1", "vs reference") in pairs
    assert not any(a == "old_loss_k3" and role.startswith("placement") for a, _, role in pairs)  # target differs
    assert len({frozenset(p[:2]) for p in pairs}) == len(pairs) == 5  # loss_k1 vs reward_k1 appears once


def _answer(tmp_path, **kw):
    proto = syn.protocol()
    runs, _ = load_runs(syn.write_runs(tmp_path, **kw), tmp_path)
    runs = runs.assign(log_kl=np.log(runs.final_kl))
    p = judged(proto, "grammar", syn.calibrated())
    return runs, p, Q.answer_questions(runs, "grammar", p, p.tasks["grammar"])


def test_families_come_from_the_design_and_exploratory_cells_and_there_is_no_q4(tmp_path):
    """Design cells are fixed (act, control, tuned) or matched (level<k>) runs like any other: the families are one
    per coefficient and per KL target that has at least one pair; the control's coefficient (only the reference
    arm ran there) makes no comparison family, only a Q1 restraint family."""
    _, _, res = _answer(tmp_path, coefs=(0.03,), targets=(8.0,), design=syn.DESIGN)
    levels = syn.calibrated()["levels"]  # 2.1, 4.2, 8.4 nats
    control = syn.calibrated()["control_coef"]
    fam = res["families"]
    assert set(fam.question) == {"Q1", "Q2", "Q3"}
    assert set(fam[fam.question == "Q2"].level) == {0.03, 0.1}  # the control's coefficient has the reference alone
    assert set(fam[fam.question == "Q3"].level) == {*levels, 8.0}  # the calibrated levels and the exploratory one
    assert set(fam[fam.question == "Q1"].level) == {0.03, 0.1, control}
    c = res["comparisons"]
    at = c[(c.family == "Q2 gold @ coef 0.1") & c.in_family]
    assert set(at.label) == {"loss_k1 − reward_k1", "loss_k3 − reward_k3", "reward_k3 − reward_k1",
                             "loss_k3 − reward_k1", "loss_k3_isrtg − reward_k1"}  # fmt: skip
    assert (c[c.in_family].n == 12).all()
    lvl = c[(c.family == "Q3 gold @ KL target 2.1") & c.in_family]
    assert set(lvl.label) == {"loss_k3 − reward_k1"}  # only the frontier's arms are steered to the levels


def test_a_family_without_the_reference_arm_has_a_no_kl_control_that_cannot_pass(tmp_path):
    """A family's no-KL control is no KL minus the reference arm at the family's level: where the reference arm was
    not steered (reward_k3 and loss_k3 at level 1, no frontier_reward group) it has no instance and cannot pass."""
    design = [*(e for g in syn.EVALUATED if g != "frontier_reward" for e in syn.GROUPS[g]), "reward_k3-level1"]
    _, _, res = _answer(tmp_path, design=design)
    c, fam = res["comparisons"], res["families"]
    name = "Q3 gold @ KL target 2.1"
    assert set(c[(c.family == name) & c.in_family].label) == {"loss_k3 − reward_k3"}
    pc = c[(c.family == name) & ~c.in_family]
    assert pc.n.tolist() == [0] and not fam[fam.family == name].pc_pass.any()


def test_positive_control_of_a_family_is_tested_at_alpha_over_m_outside_the_family(tmp_path):
    _, p, res = _answer(tmp_path)
    fam = res["families"].set_index("family")
    c = res["comparisons"]
    for name, f in fam[fam.question != "Q1"].iterrows():
        members = c[(c.family == name) & c.in_family]
        pc = c[(c.family == name) & ~c.in_family]
        assert len(pc) == 1 and pc.role.iloc[0] == Q.PC_ROLE and pc.label.iloc[0] == "none − reward_k1"
        assert f.m == len(members) and f.pc_threshold == pytest.approx(p.alpha / len(members))
        assert f.pc_pass == (pc.p.iloc[0] < p.alpha / len(members))
        assert set(members.m) == {len(members)}
    # the margins are the calibrated ones, and the collapse rule uses the gold margin
    assert set(c[c.metric == "gold"].margin) == {syn.calibrated()["margins"]["gold"]}
    assert p.tasks["grammar"].collapse_drop == syn.calibrated()["margins"]["gold"]
