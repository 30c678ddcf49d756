"""ablations/primary.py: the pre-registered primary questions, decided by exact sequential tests, and the headline
they carry, on hand-made per-instance values with planted effects (no files). The look schedule is params.yaml's
unless a test says otherwise: batches of 4 up to 24 instances (6 looks), alpha 0.05 over 4 questions, so every look
runs at a_j = 0.05 / 4 / 6 and the exact two-sided test first reaches it at n = 12 (2/2^12 <= a_j < 2/2^8)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ablations import primary as P
from ablations import sequential as Q

from . import synthetic as syn

CAL = syn.calibrated("grammar")  # coef 0.1, control 0.3, loss_k3 tuned 0.1, KL target 4
SEQ = dict(batch_size=4, cap=24, rho=1.0)
PROTO = syn.protocol(sequential=SEQ)
A_J = 0.05 / 4 / 6
CELLS = {
    "reward_k1": ("reward_k1", "fixed", 0.1),
    "loss_k1": ("loss_k1", "fixed", 0.1),
    "reward_k3": ("reward_k3", "fixed", 0.1),
    "loss_k3": ("loss_k3", "fixed", 0.1),  # also loss_k3's tuned cell (its best coefficient is the reference's)
    "control": ("reward_k1", "fixed", 0.3),
    "reward_k3_target": ("reward_k3", "matched", 4.0),
    "loss_k3_target": ("loss_k3", "matched", 4.0),
    "none": ("none", "baseline", None),
}
# (gold, log KL) shift of each cell against the instance's base: the margin-sized control costs the reference arm
# one margin of gold (0.03) and lowers its log KL (as calibrated: reference at coef - at control > 0 on both); no
# KL ends with less gold and more KL
DEFAULT = {"control": (-0.03, -0.96), "none": (-0.1, 1.6)}


def frame(n: int = 24, shifts: dict | None = None, noise: float = 0.0, seed: int = 0) -> tuple[pd.DataFrame, list]:
    """Evaluation runs (one seed) on instances 100, 101, ...: every cell of CELLS with final gold = the instance's
    base + its gold shift (+ noise) and log KL likewise; a shift is a scalar or one value per instance."""
    rng = np.random.default_rng(seed)
    base_g, base_k = 0.5 + rng.normal(0, 0.05, n), 1.3 + rng.normal(0, 0.1, n)
    shifts = {**DEFAULT, **(shifts or {})}
    rows = []
    for name, (arm, kind, level) in CELLS.items():
        g, k = (np.broadcast_to(np.asarray(x, float), (n,)) for x in shifts.get(name, (0.0, 0.0)))
        for i in range(n):
            rows.append(dict(arm=arm, kind=kind, level=level, instance=100 + i, seed=0,
                             final_gold=base_g[i] + g[i] + noise * rng.normal(),
                             log_kl=base_k[i] + k[i] + noise * rng.normal()))  # fmt: skip
    return pd.DataFrame(rows), [100 + i for i in range(n)]


def analyse(runs, order, proto=PROTO, cal=CAL) -> dict:
    out = P.analyse(runs, "grammar", proto, cal, order)
    out["by"] = {r["question"]: r for r in out["primary"]}
    return out


def first_reachable(schedule: Q.Schedule) -> int:
    return next(j for j in range(1, schedule.J + 1) if schedule.reachable(j))


def test_large_q1_effect_is_a_material_difference_at_the_first_reachable_look():
    """loss_k1 ends with log KL 1.5 above reward_k1's at the same coefficient (KL x 4.5, margin ln 2): material at
    the first look the exact test can reach (n = 12), every earlier look inconclusive with an unbounded CI; settled
    there, with the looks after it still computed and shown."""
    runs, order = frame(shifts={"loss_k1": (0.0, 1.5)}, noise=0.05)
    out = analyse(runs, order)
    q1 = out["by"]["Q1"]
    sch = P.schedule(PROTO)
    assert first_reachable(sch) == 3
    assert (q1["verdict"], q1["status"], q1["settled"]) == (Q.MATERIAL, "settled", True)
    assert (q1["looks_decided"], q1["n"], q1["n_available"], q1["looks"]) == (3, 12, 24, 6)
    assert q1["lo"] > math.log(2) and q1["estimate"] == pytest.approx(1.5, abs=0.05)
    assert q1["a_j"] == pytest.approx(A_J) and q1["control_detected"] is True
    early = q1["path"][:2]
    assert all(look["verdict"] == "inconclusive" and look["lo"] == -np.inf for look in early)
    assert [look["n"] for look in q1["path"]] == [4, 8, 12, 16, 20, 24]
    assert q1["p_exact"] == pytest.approx(2 / 2**12) and q1["t_p"] < 1e-6  # the t-test is shown beside it
    assert out["headline"] == P.MATTERS


def test_zero_effect_with_a_detected_control_and_tight_noise_is_equivalent():
    runs, order = frame(noise=0.002)
    out = analyse(runs, order)
    for q in ("Q2", "Q3", "Q4"):
        r = out["by"][q]
        assert (r["verdict"], r["settled"], r["control_detected"]) == (Q.EQUIVALENT, True, True), q
        assert -r["margin"] < r["lo90"] <= r["hi90"] < r["margin"]
    assert out["by"]["Q2"]["margin"] == CAL["margins"]["gold"]
    assert out["by"]["Q1"]["verdict"] == Q.EQUIVALENT and out["by"]["Q1"]["margin"] == pytest.approx(math.log(2))
    assert out["headline"] == P.NO_MATTER
    assert out["by"]["Q2"]["no_kl_direction_ok"] and out["by"]["Q1"]["no_kl_direction_ok"]


@pytest.mark.parametrize(
    "control, why",
    [((0.0, -0.96), "no gold effect"), ((+0.03, -0.96), "the opposite direction")],
    ids=["undetectable", "wrong-direction"],
)
def test_zero_effect_with_the_control_not_detected_is_insensitive_not_equivalent(control, why):
    """The same zero effect and tight noise, but the margin-sized control shows {why}: the gold questions cannot
    say "equivalent" (they are "insensitive" and stay open below the cap); Q1, whose log-KL control is still
    detected, is equivalent; the headline is not "does not matter"."""
    runs, order = frame(shifts={"control": control}, noise=0.002)
    out = analyse(runs, order)
    for q in ("Q2", "Q3", "Q4"):
        r = out["by"][q]
        assert (r["verdict"], r["settled"], r["control_detected"]) == (Q.INSENSITIVE, False, False), q
        assert -r["margin"] < r["lo90"] <= r["hi90"] < r["margin"]  # alone it would have said equivalent
        assert r["status"] == "unsettled at cap"
        assert all(look["effective"] != Q.EQUIVALENT for look in r["path"])
    assert out["by"]["Q1"]["verdict"] == Q.EQUIVALENT
    assert out["headline"] == P.NOT_SETTLED


def test_an_unsettled_question_below_the_cap_is_open_and_only_complete_batches_count():
    runs, order = frame(n=10, shifts={"control": (0.0, -0.96)}, noise=0.002)
    r = analyse(runs, order)["by"]["Q2"]
    assert (r["n_available"], r["looks"], r["status"], r["settled"]) == (10, 2, "open", False)
    assert [look["n"] for look in r["path"]] == [4, 8]


def test_instances_follow_the_pre_registered_order():
    """The looks take the instances in ``order``, not in sorted order: a large effect planted on the last four
    instances only is seen at n = 12 only when they come first."""
    n = 24
    late = np.r_[np.zeros(20), np.full(4, 0.5)]
    runs, order = frame(n=n, shifts={"loss_k3": (late, 0.0)}, noise=0.002)
    first = analyse(runs, order)["by"]["Q2"]["path"][2]
    moved = analyse(runs, order[20:] + order[:20])["by"]["Q2"]["path"][2]
    assert first["estimate"] == pytest.approx(0.0, abs=0.01)
    assert moved["estimate"] == pytest.approx(4 * 0.5 / 12, abs=0.01)
    with pytest.raises(ValueError, match=r"instances \[999\]"):
        analyse(runs, [*order[:23], 999])


HEADLINE_CASES = [
    ([(Q.MATERIAL, True), (Q.INCONCLUSIVE, False)], P.MATTERS),
    ([(Q.MATERIAL, True), (Q.EQUIVALENT, True)], P.MATTERS),
    ([(Q.EQUIVALENT, True), (Q.EQUIVALENT, True)], P.NO_MATTER),
    ([(Q.EQUIVALENT, True), (Q.INSENSITIVE, False)], P.NOT_SETTLED),
    ([(Q.EQUIVALENT, True), (Q.DIFFERENCE, False)], P.NOT_SETTLED),  # a difference not beyond the margin
    ([(Q.DIFFERENCE, False)], P.NOT_SETTLED),
    ([(Q.EQUIVALENT, False)], P.NOT_SETTLED),  # a verdict that did not settle carries nothing
    ([], P.NOT_SETTLED),
]


@pytest.mark.parametrize("rows, headline", HEADLINE_CASES)
def test_headline_rules(rows, headline):
    """ "matters" as soon as one primary question settles as a material difference; "does not matter" only when
    every primary question settles as equivalent; otherwise "not settled"."""
    assert P.headline([{"verdict": v, "settled": s} for v, s in rows]) == headline


def test_error_budget_is_alpha_over_k_spent_over_the_looks():
    """Each of the K primary questions gets alpha/K, spent over its J looks (rho 1: alpha/K/J each), and the looks'
    levels add up to alpha/K, so the union bound over questions and looks is alpha."""
    runs, order = frame(noise=0.002)
    b = analyse(runs, order)["budget"]
    assert (b["alpha"], b["questions"]) == (0.05, 4) and b["per_question"] == pytest.approx(0.05 / 4)
    assert b["looks"] == [4, 8, 12, 16, 20, 24]
    assert b["levels"] == pytest.approx([A_J] * 6) and sum(b["levels"]) == pytest.approx(0.05 / 4)
    assert b["reachable"] == [False, False, True, True, True, True]
    two = syn.protocol(sequential=SEQ, primary={q: syn.PRIMARY[q] for q in ("Q1", "Q2")})
    b2 = analyse(runs, order, proto=two)["budget"]
    assert b2["questions"] == 2 and b2["per_question"] == pytest.approx(0.025)
    assert sum(b2["levels"]) == pytest.approx(0.025)
    rho = syn.protocol(sequential={**SEQ, "rho": 2.0})
    levels = analyse(runs, order, proto=rho)["budget"]["levels"]
    assert sum(levels) == pytest.approx(0.0125) and levels == sorted(levels) and levels[0] < levels[-1]


# ---------------------------------------------------------------- mutations these tests must catch

# control values (one per instance, n = 12) whose one-sided exact p is 13/4096 = 0.0032: 11 values of +0.03 and one
# of -0.045 (-1.5 x 0.03): exactly 12 non-empty flip sets have a mean <= 0 (the negative one alone or with one of the
# positives). Detected at alpha (0.05) and at alpha/K (0.0125), NOT at a_j = alpha/K/J = 0.0021.
BORDERLINE = np.r_[np.full(11, 0.03), -0.045]


def test_control_is_tested_at_the_look_level_a_j():
    """Mutation caught: "testing the control at alpha instead of a_j" (in sequential.path or primary.question:
    detected(control, alpha) or detected(control, alpha/K) where it must be detected(control, a_j)).

    The gold differences are zero up to 0.001 (equivalent at n = 12); the margin-sized control is BORDERLINE:
    detected at alpha and at alpha/K but not at the look's a_j. The correct procedure says "insensitive" (no
    equivalence licensed); the mutant says "equivalent" and settles every gold question."""
    assert Q.signflip_p_one_sided(BORDERLINE, 0.0, "greater") == pytest.approx(13 / 4096)
    assert Q.detected(BORDERLINE, 0.05) and Q.detected(BORDERLINE, 0.0125) and not Q.detected(BORDERLINE, A_J)
    wiggle = np.tile([0.001, -0.001], 6)
    runs, order = frame(n=12, shifts={"control": (-BORDERLINE, -0.96), "loss_k3": (wiggle, 0.0)})
    out = analyse(runs, order)
    q2 = out["by"]["Q2"]
    assert q2["path"][2]["verdict"] == Q.EQUIVALENT  # the raw verdict at n = 12
    assert (q2["verdict"], q2["settled"], q2["control_detected"]) == (Q.INSENSITIVE, False, False)
    assert out["headline"] == P.NOT_SETTLED


def test_alpha_is_divided_by_the_number_of_primary_questions():
    """Mutation caught: "alpha not divided by K" (primary.schedule with alpha = proto.alpha instead of
    proto.alpha / len(proto.primary)).

    Q2's difference is 0.03 (one margin) + e, e = 0.01 x BORDERLINE / 0.03 (11 x +0.01, one -0.015): at n = 12
    (cap 12: 3 looks) 12 flip-set means of e are <= 0, so the (1 - a_j) CI's lower end (the k-th smallest mean,
    k = floor(a_j/2 x 4096)) is above the margin only if k > 12. With a_j = 0.05/4/3, k = 8: "difference" (not
    beyond the margin), unsettled. With the mutant's a_j = 0.05/3, k = 34: "material difference", settled, and the
    headline would say "matters"."""
    e = BORDERLINE / 3
    proto = syn.protocol(sequential=dict(batch_size=4, cap=12, rho=1.0))
    runs, order = frame(n=12, shifts={"loss_k3": (0.03 + e, 0.0)})
    out = analyse(runs, order, proto=proto)
    q2 = out["by"]["Q2"]
    assert q2["a_j"] == pytest.approx(0.05 / 4 / 3)
    assert q2["lo"] <= 0.03 < q2["hi"] and q2["lo"] > 0
    assert (q2["verdict"], q2["settled"]) == (Q.DIFFERENCE, False)
    # the same data at the mutant's level would be material: the test above fails under the mutation
    mutant = Q.outcome(0.03 + e, 0.03, 0.05 / 3)
    assert mutant["verdict"] == Q.MATERIAL
    assert out["headline"] == P.NOT_SETTLED
