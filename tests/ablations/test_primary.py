"""ablations/primary.py: the pre-registered primary comparisons (protocol v4), decided by exact sequential sign tests
of the median, and the headline the placement comparisons carry, on hand-made per-instance values with planted
effects (no files). The questions are params.yaml's (tests/ablations/synthetic.py): same_beta, same_gradient,
frontier (3 levels), kl_vs_none (3 levels) and camps, K = 9 comparisons sharing alpha 0.05. Unless a test says
otherwise every comparison's planned cap is 24 (6 looks of 4): at alpha/9 the exact test first reaches a decision
at n = 12 (2^-12 <= a_j / 2 < 2^-8), so looks 3-6 share the comparison's alpha."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ablations import primary as P
from ablations import rule as R
from ablations import signtest as T

from . import synthetic as syn

K = len(syn.comparison_names())  # 9
CAL = syn.calibrated("grammar", plan_=syn.plan("grammar", cap=24))  # coef 0.1; levels 2.1, 4.2, 8.4 nats
MARGIN = CAL["margins"]["gold"]  # 0.03
PROTO = syn.protocol(sequential={**syn._P["analysis"]["sequential"], "batch_size": 4, "max_cap": 24})
LEVELS = CAL["levels"]
NONE_KL = 18.0  # the no-KL runs' final exact KL; their gold falls linearly with KL along training, by NONE_GOLD
NONE_GOLD = -0.1  # no KL ends 0.1 (> 2 margins) below the reference arm: the penalty acts at coef
ITERS = np.arange(0, 65, 5)
COEF_CELLS = ("reward_k1-act", "reward_k1-control", "reward_k3-act", "loss_k3-act", "loss_k3_isrtg-act",
              "reward_k1-tuned", "loss_k3-tuned")  # fmt: skip
LEVEL_CELLS = tuple(f"{a}-level{k}" for a in ("reward_k1", "loss_k3") for k in (1, 2, 3))
# gold shift of a cell against the instance's base: the margin-sized control costs the reference arm one margin
# (act - control = +0.03, the calibrated direction +1); a level cell sits on the no-KL trajectory's gold at its KL
DEFAULT = {"reward_k1-control": -MARGIN}


def _level_gold(level: float) -> float:
    return NONE_GOLD * level / NONE_KL


def frame(n: int = 24, gold: dict | None = None, kl: dict | None = None, noise: float = 0.002, seed: int = 0,
          none_gold: float = NONE_GOLD) -> tuple[pd.DataFrame, pd.DataFrame, list]:  # fmt: skip
    """(runs, evals, order) of evaluation runs (one seed) on instances 100, 101, ...: every design cell with final
    gold = the instance's base + its shift (``gold``: by cell, a scalar or one value per instance; + noise), final KL
    3.6 nats for a coefficient cell and its level (times ``kl``'s factor, by cell: per instance too) for a level
    cell; the no-KL runs' evaluations go linearly from (KL 0, base gold) to (18 nats, base + ``none_gold``)."""
    rng = np.random.default_rng(seed)
    base = 0.5 + rng.normal(0, 0.05, n)
    gold, kl = {**DEFAULT, **(gold or {})}, kl or {}
    per = lambda x: np.broadcast_to(np.asarray(x, float), (n,))
    rows, evals = [], []
    for cell in COEF_CELLS + LEVEL_CELLS:
        arm, role = cell.rsplit("-", 1)
        g, f = per(gold.get(cell, 0.0)), per(kl.get(cell, 1.0))
        lvl = LEVELS[int(role[5:]) - 1] if role.startswith("level") else None
        for i in range(n):
            final_gold = base[i] + g[i] + noise * rng.normal() + (_level_gold(lvl) if lvl else 0.0)
            final_kl = (lvl if lvl else 3.6) * f[i] * math.exp(noise * rng.normal())
            rows.append(dict(arm=arm, role=role, instance=100 + i, seed=0, final_gold=final_gold, final_kl=final_kl))
    for i in range(n):
        rows.append(dict(arm="none", role=None, instance=100 + i, seed=0, final_gold=base[i] + none_gold,
                         final_kl=NONE_KL))  # fmt: skip
        k = NONE_KL * ITERS / ITERS[-1]
        evals.append(pd.DataFrame(dict(arm="none", instance=100 + i, seed=0, iteration=ITERS, kl=k,
                                       gold=base[i] + none_gold * k / NONE_KL)))  # fmt: skip
    return pd.DataFrame(rows), pd.concat(evals, ignore_index=True), [100 + i for i in range(n)]


def analyse(runs, evals, order, proto=PROTO, cal=CAL) -> dict:
    out = P.analyse(runs, evals, "grammar", proto, cal, cal["plan"], order)
    out["by"] = {r["comparison"]: r for r in out["primary"]}
    return out


def first_reachable(schedule: R.Schedule) -> int:
    return next(j for j in range(1, schedule.J + 1) if schedule.reachable(j))


def test_large_same_beta_effect_is_a_material_difference_at_the_first_reachable_look():
    """loss_k3 keeps 0.15 more gold than reward_k3 at the same β (5 margins): material at the first look the exact
    test can reach (n = 12), every earlier look inconclusive with an unbounded CI; settled there, with the looks
    after it still computed and shown; it carries the headline "matters"."""
    runs, evals, order = frame(gold={"loss_k3-act": 0.15})
    out = analyse(runs, evals, order)
    r = out["by"]["same_beta"]
    sch = P.schedule(PROTO, K, 24)
    assert first_reachable(sch) == 3
    assert (r["verdict"], r["status"], r["settled"], r["label"]) == (T.MATERIAL, "settled", True, T.MATERIAL)
    assert (r["looks_decided"], r["n"], r["n_available"], r["looks"], r["cap"]) == (3, 12, 24, 6, 24)
    assert r["lo"] > MARGIN and r["estimate"] == pytest.approx(0.15, abs=0.01)
    assert r["a_j"] == pytest.approx(sch.levels()[2]) and r["control_detected"] is True and r["acts"] is True
    early = r["path"][:2]
    assert all(look["verdict"] == T.INCONCLUSIVE and look["lo"] == -np.inf for look in early)
    assert [look["n"] for look in r["path"]] == [4, 8, 12, 16, 20, 24]
    assert r["p_sign"] == pytest.approx(2 / 2**12) and r["t_p"] < 1e-6  # the t-test is shown beside it
    assert r["boot_mean"] == pytest.approx(r["mean"]) and r["boot_mean_lo"] > 0.1 and r["p_improve"] > 0.9  # rliable
    assert out["headline"] == P.MATTERS and out["carried_by"] == ["same_beta"]


def test_zero_effect_with_a_detected_control_and_an_acting_penalty_is_equivalent():
    runs, evals, order = frame()
    out = analyse(runs, evals, order)
    for name, r in out["by"].items():
        assert (r["verdict"], r["settled"], r["control_detected"]) == (T.EQUIVALENT, True, True), name
        assert -r["margin"] < r["lo90"] <= r["hi90"] < r["margin"] and r["margin"] == MARGIN
        assert r["steerable"] is True
    for name in ("same_beta", "same_gradient", "camps", "frontier_level1"):
        assert out["by"][name]["acts"] is True, name  # the no-KL contrast beyond its margin, as calibrated
    assert out["by"]["kl_vs_none_level1"]["acts"] is None  # no KL itself is the other side: no such check
    assert out["headline"] == P.NO_MATTER
    assert out["carried_by"] == [n for n, r in out["by"].items() if r["kind"] == "placement"]


@pytest.mark.parametrize(
    "control, why", [(0.0, "no gold effect"), (+MARGIN, "the opposite direction")], ids=["undetectable", "wrong-way"]
)
def test_zero_effect_with_the_control_not_detected_is_insensitive_not_equivalent(control, why):
    """The same zero effect and tight noise, but the margin-sized control shows {why}: no comparison can say
    "equivalent" (each is "insensitive" and unsettled at its cap); the headline is not "does not matter"."""
    runs, evals, order = frame(gold={"reward_k1-control": control})
    out = analyse(runs, evals, order)
    for name, r in out["by"].items():
        assert (r["verdict"], r["settled"], r["control_detected"]) == (T.INSENSITIVE, False, False), name
        assert -r["margin"] < r["lo90"] <= r["hi90"] < r["margin"]  # alone it would have said equivalent
        assert r["status"] == "unsettled at cap" and r["label"] == T.LABELS[T.INSENSITIVE]
        assert all(look["effective"] != T.EQUIVALENT for look in r["path"])
    assert out["headline"] == P.NOT_SETTLED


def test_zero_effect_where_the_penalty_does_not_act_is_inert_not_equivalent():
    """No KL ends with the reference arm's gold (the penalty changes nothing at the calibrated β): the coefficient
    comparisons cannot say "equivalent" ("inert": placement is not testable there), while the frontier, whose
    penalty check is on log KL (no KL ends far above every level), and the no-KL trajectory (no check) stay
    equivalent. The headline is not "does not matter"."""
    runs, evals, order = frame(none_gold=0.0)
    out = analyse(runs, evals, order)
    for name in ("same_beta", "same_gradient", "camps"):
        r = out["by"][name]
        assert (r["verdict"], r["settled"], r["acts"], r["control_detected"]) == (T.INERT, False, False, True), name
        assert r["label"].startswith("the penalty is inert here")
    for name in ("frontier_level1", "frontier_level3", "kl_vs_none_level2"):
        assert out["by"][name]["verdict"] == T.EQUIVALENT, name
    assert out["headline"] == P.NOT_SETTLED


def test_an_arm_that_misses_its_level_is_not_steerable_there_not_compared():
    """loss_k3 ends 60% above level 2 on 6 of 24 instances (hit rate 0.75 < min_hit_rate 0.8): frontier_level2 is
    "not steerable" at every look (never settled, its hit rates reported); the other levels are compared."""
    miss = np.where(np.arange(24) % 4 == 0, 1.6, 1.0)
    runs, evals, order = frame(kl={"loss_k3-level2": miss})
    out = analyse(runs, evals, order)
    r = out["by"]["frontier_level2"]
    assert (r["verdict"], r["settled"], r["steerable"]) == (P.NOT_STEERABLE, False, False)
    assert r["hit_rate_arm"] == pytest.approx(0.75) and r["hit_rate_other"] == 1.0
    assert all(look["verdict"] == P.NOT_STEERABLE for look in r["path"])
    assert out["by"]["frontier_level1"]["verdict"] == T.EQUIVALENT
    assert out["by"]["kl_vs_none_level2"]["verdict"] == T.EQUIVALENT  # reward_k1 hits level 2
    assert out["headline"] == P.NOT_SETTLED


@pytest.mark.parametrize("misses, status", [(4, "open"), (5, P.CLOSED)])
def test_not_steerable_and_out_of_reach_by_the_cap_is_closed_not_open(misses, status):
    """Amendment 1. At n = 12 of cap 24, loss_k3 misses level 2 on ``misses`` instances: not steerable now (rate
    <= 8/12 < 0.8) either way. With 4 misses, 20 hits of 24 (0.833) are still possible: open (settle extends it);
    with 5, at most 19 of 24 (0.79): closed, the cells stop. The verdict is "not steerable" both ways, the frozen
    rule's status ("open") is kept beside it, and no other comparison changes. Catches: closing on the current rate
    (4 misses would close), an off-by-one at the boundary, closing a comparison that is steerable or settled."""
    miss = np.where(np.arange(12) < misses, 1.6, 1.0)
    runs, evals, order = frame(n=12, kl={"loss_k3-level2": miss})
    out = analyse(runs, evals, order)
    r = out["by"]["frontier_level2"]
    assert (r["verdict"], r["status"], r["status_frozen"], r["settled"]) == (P.NOT_STEERABLE, status, "open", False)
    assert r["steerable_in_reach"] is (status == "open")
    for name, other in out["by"].items():
        if name != "frontier_level2":
            assert other["status"] == other["status_frozen"] and other["steerable_in_reach"], name


def _reachable_by_enumeration(hits: list[bool], cap: int, batch: int, rate: float) -> bool:
    """Independent slow check: some completion of the runs to come makes some later look (a multiple of ``batch``
    up to ``cap``) steerable, by the rule itself (primary.steerable on that look's first n)."""
    n, todo = len(hits), cap - len(hits)
    for tail in range(2**todo):
        seq = hits + [bool(tail >> k & 1) for k in range(todo)]
        t = pd.DataFrame({"hit_arm": seq, "hit_other": [True] * cap})
        if any(P.steerable(t, m, rate) for m in range(n + batch, cap + 1, batch)):
            return True
    return False


@pytest.mark.parametrize("rate", [0.5, 0.75, 0.8])
def test_steerable_in_reach_agrees_with_enumerating_every_future(rate):
    """Every hit/miss history of 4 and 8 runs, cap 12, batches of 4: the closed form ((h + cap - n) / cap >= rate,
    the best case at the cap) equals the enumeration of all 2^(cap - n) futures at every later look."""
    for n in (4, 8):
        for bits in range(2**n):
            hits = [bool(bits >> k & 1) for k in range(n)]
            t = pd.DataFrame({"hit_arm": hits, "hit_other": [True] * n})
            want = _reachable_by_enumeration(hits, 12, 4, rate)
            assert P.steerable_in_reach(t, n, 12, rate) is want, (hits, rate)
            flipped = t.rename(columns={"hit_arm": "hit_other", "hit_other": "hit_arm"})
            assert P.steerable_in_reach(flipped, n, 12, rate) is want  # either side can close it
    assert P.steerable_in_reach(pd.DataFrame({"d": [0.0] * 4}), 4, 12, 0.8) is True  # a coefficient comparison


def test_the_penalty_and_practice_questions_do_not_carry_the_headline():
    """reward_k1 at every level keeps 0.15 more gold than the no-KL trajectory at that KL (the penalty improves
    the gold-KL frontier) and the camps differ by 0.15: both material, but every placement comparison is
    equivalent, so the answer is "does not matter", carried by the placement comparisons alone."""
    lift = {f"reward_k1-level{k}": 0.15 for k in (1, 2, 3)} | {f"loss_k3-level{k}": 0.15 for k in (1, 2, 3)}
    runs, evals, order = frame(gold=lift | {"loss_k3-tuned": 0.15})
    out = analyse(runs, evals, order)
    for name in ("kl_vs_none_level1", "kl_vs_none_level2", "kl_vs_none_level3", "camps"):
        assert out["by"][name]["verdict"] == T.MATERIAL, name
    assert out["by"]["camps"]["kind"] == "practice" and out["by"]["kl_vs_none_level1"]["kind"] == "penalty"
    assert out["headline"] == P.NO_MATTER
    assert "camps" not in out["carried_by"] and not any(c.startswith("kl_vs_none") for c in out["carried_by"])


def test_an_unsettled_comparison_below_the_cap_is_open_and_only_complete_batches_count():
    runs, evals, order = frame(n=10, gold={"reward_k1-control": 0.0})
    r = analyse(runs, evals, order)["by"]["same_beta"]
    assert (r["n_available"], r["looks"], r["status"], r["settled"]) == (10, 2, "open", False)
    assert [look["n"] for look in r["path"]] == [4, 8]


def test_each_comparison_runs_to_its_own_planned_cap():
    """The plan caps same_beta at 12 and the others at 24: with the control undetected, same_beta is unsettled at
    its cap after 3 looks (12 of 24 instances used) while the others use all 24."""
    cal = syn.calibrated("grammar", plan_=syn.plan("grammar", cap={n: 24 for n in syn.comparison_names()} | {
        "same_beta": 12}))  # fmt: skip
    runs, evals, order = frame(gold={"reward_k1-control": 0.0})
    out = analyse(runs, evals, order, cal=cal)
    r = out["by"]["same_beta"]
    assert (r["cap"], r["looks"], r["n"], r["n_available"], r["status"]) == (12, 3, 12, 24, "unsettled at cap")
    assert (out["by"]["camps"]["cap"], out["by"]["camps"]["n"]) == (24, 24)
    assert out["budget"]["caps"]["same_beta"] == 12


def test_instances_follow_the_pre_registered_order():
    """The looks take the instances in ``order``, not in sorted order: a large effect planted on the last four
    instances only moves the median at n = 12 only when they come first."""
    late = np.r_[np.zeros(20), np.full(4, 0.5)]
    runs, evals, order = frame(gold={"loss_k3-act": late})
    first = analyse(runs, evals, order)["by"]["same_beta"]["path"][2]
    moved = analyse(runs, evals, order[20:] + order[:20])["by"]["same_beta"]["path"][2]
    assert first["estimate"] == pytest.approx(0.0, abs=0.01) and first["hi"] < 0.5
    assert moved["hi"] == pytest.approx(0.5, abs=0.01)  # the four late instances are among the first 12 now


HEADLINE_CASES = [
    ([(T.MATERIAL, True, "placement"), (T.INCONCLUSIVE, False, "placement")], P.MATTERS),
    ([(T.MATERIAL, True, "placement"), (T.EQUIVALENT, True, "placement")], P.MATTERS),
    ([(T.EQUIVALENT, True, "placement"), (T.EQUIVALENT, True, "placement")], P.NO_MATTER),
    ([(T.EQUIVALENT, True, "placement"), (T.INSENSITIVE, False, "placement")], P.NOT_SETTLED),
    ([(T.EQUIVALENT, True, "placement"), (T.INERT, False, "placement")], P.NOT_SETTLED),
    ([(T.EQUIVALENT, True, "placement"), (T.NONZERO, False, "placement")], P.NOT_SETTLED),  # not beyond the margin
    ([(T.EQUIVALENT, True, "placement"), (P.NOT_STEERABLE, False, "placement")], P.NOT_SETTLED),
    ([(T.NONZERO, False, "placement")], P.NOT_SETTLED),
    ([(T.EQUIVALENT, False, "placement")], P.NOT_SETTLED),  # a verdict that did not settle carries nothing
    ([(T.EQUIVALENT, True, "placement"), (T.MATERIAL, True, "penalty"), (T.MATERIAL, True, "practice")], P.NO_MATTER),
    ([(T.MATERIAL, True, "penalty"), (T.MATERIAL, True, "practice")], P.NOT_SETTLED),  # no placement comparison
    ([], P.NOT_SETTLED),
]


@pytest.mark.parametrize("rows, headline", HEADLINE_CASES)
def test_headline_rules(rows, headline):
    """ "matters" as soon as one placement comparison settles as a material difference; "does not matter" only when
    every placement comparison settles as equivalent; otherwise "not settled". Penalty and practice comparisons
    never carry it."""
    rows = [{"comparison": f"c{i}", "verdict": v, "settled": s, "kind": k} for i, (v, s, k) in enumerate(rows)]
    assert P.headline(rows) == headline


def test_error_budget_is_alpha_over_the_comparisons_spent_over_the_reachable_looks():
    """Each of the K comparisons (a levels question counts once per level) gets alpha/K, spent only on the looks
    where the exact test can reach a decision, and what those looks attain adds up to at most alpha/K; fewer
    questions give each comparison more."""
    runs, evals, order = frame()
    b = analyse(runs, evals, order)["budget"]
    assert (b["alpha"], b["comparisons"]) == (0.05, K) and b["per_comparison"] == pytest.approx(0.05 / K)
    assert b["caps"] == dict.fromkeys(syn.comparison_names(), 24)
    sch = P.schedule(PROTO, K, 24)
    assert [sch.reachable(j) for j in range(1, 7)] == [False, False, True, True, True, True]
    assert sch.levels()[:2].tolist() == [0, 0] and sch.costs().sum() <= 0.05 / K + 1e-15
    two = {q: syn.PRIMARY[q] for q in ("same_beta", "camps")}
    proto2 = syn.protocol(primary=two, sequential=PROTO.sequential.model_dump())
    cal2 = syn.calibrated("grammar", plan_=syn.plan("grammar", cap=24, questions=two))
    b2 = analyse(runs, evals, order, proto=proto2, cal=cal2)["budget"]
    assert b2["comparisons"] == 2 and b2["per_comparison"] == pytest.approx(0.025)


# ---------------------------------------------------------------- mutations these tests must catch

# control values (one per instance, n = 12) whose one-sided sign-test p is F(1) = 13/4096 = 0.0032: 11 of +0.03
# and one of -0.045. Detected at alpha/K (0.0056), NOT at the look's a_j (0.05/9/4 = 0.0014 at n = 12, cap 24).
BORDERLINE = np.r_[np.full(11, 0.03), -0.045]


def test_control_is_tested_at_the_look_level_a_j():
    """Mutation caught: "testing the control at alpha or alpha/K instead of a_j" (in rule.path: detected(control,
    alpha/K) where it must be detected(control, a_j)).

    The gold differences are zero up to 0.001 (equivalent at n = 12); the margin-sized control is BORDERLINE:
    detected at alpha and at alpha/K but not at the look's a_j. The correct procedure says "insensitive" (no
    equivalence licensed); the mutant says "equivalent" and settles every comparison."""
    a_j = P.schedule(PROTO, K, 24).levels()[2]
    assert T.sign_p(BORDERLINE, 0.0, "greater") == pytest.approx(13 / 4096)
    assert T.detected(BORDERLINE, 0.05, +1) and T.detected(BORDERLINE, 0.05 / K, +1)
    assert not T.detected(BORDERLINE, a_j, +1)
    wiggle = np.tile([0.001, -0.001], 6)
    runs, evals, order = frame(n=12, gold={"reward_k1-control": -BORDERLINE, "loss_k3-act": wiggle}, noise=0.0)
    out = analyse(runs, evals, order)
    r = out["by"]["same_beta"]
    assert r["path"][2]["verdict"] == T.EQUIVALENT  # the raw verdict at n = 12
    assert (r["verdict"], r["settled"], r["control_detected"]) == (T.INSENSITIVE, False, False)
    assert out["headline"] == P.NOT_SETTLED


def test_alpha_is_divided_by_the_number_of_comparisons():
    """Mutation caught: "alpha not divided by K" (primary.schedule with alpha = proto.alpha instead of
    proto.alpha / K).

    same_beta's difference is one margin + e on 12 instances (cap 12: only the third look is reachable, a_3 =
    alpha/9 = 0.0056): 11 values above the margin and one (0.01) inside it. The (1 - a_3) CI's lower end is the
    k1-th smallest value, k1 = rank(12, a_3 / 2) = 1 (F(1) = 0.0032 > 0.0028): 0.01, inside the margin, so the
    verdict is "non-zero, materiality undetermined", unsettled. At the mutant's level 0.05, k1 = 3: "material
    difference", settled, and the headline would say "matters"."""
    d = np.r_[np.full(11, MARGIN + 0.01), 0.01]
    cal = syn.calibrated("grammar")  # cap 12
    runs, evals, order = frame(n=12, gold={"loss_k3-act": d}, noise=0.0)
    out = analyse(runs, evals, order, cal=cal)
    r = out["by"]["same_beta"]
    assert r["a_j"] == pytest.approx(0.05 / K) and r["cap"] == 12
    assert 0 < r["lo"] <= MARGIN < r["hi"]
    assert (r["verdict"], r["settled"]) == (T.NONZERO, False)
    mutant = T.outcome(d, MARGIN, 0.05)  # the same data at the mutant's level would be material
    assert mutant["verdict"] == T.MATERIAL
    assert out["headline"] == P.NOT_SETTLED
