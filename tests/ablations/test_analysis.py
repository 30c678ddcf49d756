"""End to end on synthetic run directories (tests/ablations/synthetic.py) with planted behaviour: evaluation runs
of the design resolved against a calibrated protocol, judged by the primary questions (the headline) and the
exploratory families."""

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest

from ablations import analysis as A
from ablations import signtest as T
from ablations import stats as S
from ablations.load import ExpectedRun

from . import synthetic as syn

PROTO = syn.protocol()  # batches of 4; every comparison's planned cap is 12: the exact tests decide at n = 12
IN = syn.inputs()
PLACEMENT = ("same_beta", "same_gradient", "frontier_level1", "frontier_level2", "frontier_level3")


def primary(tr) -> dict[str, dict]:
    return {r["comparison"]: r for r in tr.primary}


def verdicts(tr) -> dict[str, str]:
    return {q: r["verdict"] for q, r in primary(tr).items()}


def test_no_difference_with_sensitive_controls_does_not_matter(tmp_path):
    """The protocol can say "does not matter": every arm alike, every margin-sized control detected, the penalty
    acting, every primary comparison equivalent at n = 12; the exploratory no-KL controls pass."""
    tr = A.analyse(PROTO, syn.write_runs(tmp_path), tmp_path, **IN).tasks["grammar"]
    assert verdicts(tr) == dict.fromkeys(syn.comparison_names(), T.EQUIVALENT)
    assert all(r["control_detected"] and r["settled"] and r["n"] == 12 for r in tr.primary)
    assert all(primary(tr)[c]["acts"] for c in (*PLACEMENT, "camps"))
    assert tr.headline == "does not matter" and tr.carried_by == list(PLACEMENT)
    assert tr.families.pc_pass.all()


def test_planted_collapse_at_the_calibrated_cells_matters(tmp_path):
    """loss_k3 follows the common gold-vs-KL curve until 3 nats, then crashes: at the acting coefficient (KL 3.6),
    its tuned one (the same 0.1) and the frontier's levels 2 and 3 (4.2, 8.4 nats) it collapses, so same_beta, camps
    and frontier_level2/3 are material differences and the headline says "matters"; level 1 (2.1 nats) and the
    comparisons without loss_k3 are untouched; the collapse table counts the crashed runs."""
    exp = syn.write_runs(tmp_path, behaviours={"loss_k3": syn.Behaviour(crash_above=3.0)})
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    v = verdicts(tr)
    crashed = ("same_beta", "camps", "frontier_level2", "frontier_level3")
    assert all(v[c] == T.MATERIAL for c in crashed), v
    assert all(primary(tr)[c]["estimate"] < -1 for c in crashed)
    assert all(v[c] == T.EQUIVALENT for c in ("same_gradient", "frontier_level1", "kl_vs_none_level2")), v
    assert tr.headline == "matters" and tr.carried_by == ["same_beta", "frontier_level2", "frontier_level3"]
    collapse = tr.collapse.set_index(["kind", "arm", "level"])
    assert collapse.loc[("fixed", "loss_k3", 0.1), "rate"] == 1 and collapse.loc[("matched", "loss_k3", 8.4), "rate"]
    assert collapse.loc[("matched", "loss_k3", 2.1), "rate"] == 0
    assert collapse.loc[("fixed", "reward_k3", 0.1), "rate"] == 0


def test_a_collapse_beyond_the_calibrated_cells_shows_only_in_the_exploratory_families(tmp_path):
    """The headline speaks for the calibrated cells only: loss_k3 crashes past 12 nats, which none of the design
    cells reaches (the highest level is 8.4), so every primary comparison is equivalent; the exploratory cell at KL
    target 14 shows the crash as a difference there."""
    exp = syn.write_runs(tmp_path, behaviours={"loss_k3": syn.Behaviour(crash_above=12.0)}, targets=(14.0,))
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    assert tr.headline == "does not matter"
    c = tr.comparisons.set_index(["family", "label"])
    row = c.loc[("Q3 gold @ KL target 14", "loss_k3 − reward_k3")]
    assert row.verdict == S.DIFFERENCE and row.material and row["diff"] < -1


def test_failed_positive_control_makes_every_comparison_insensitive(tmp_path):
    """No over-optimisation and no gain (gold flat in KL): the margin-sized control has no gold effect, so every
    comparison, which alone would be equivalent, is "insensitive" (the penalty's gold effect is not shown either,
    but a rule that cannot detect a margin cannot show inertness); the headline is not "does not matter"."""
    tr = A.analyse(PROTO, syn.write_runs(tmp_path, curves=syn.FLAT), tmp_path, **IN).tasks["grammar"]
    for c, r in primary(tr).items():
        assert r["verdict"] == T.INSENSITIVE and not r["control_detected"], c
        assert -r["margin"] < r["lo90"] and r["hi90"] < r["margin"]
    assert primary(tr)["same_beta"]["acts"] is False and primary(tr)["frontier_level1"]["acts"] is True
    assert tr.headline == "not settled"


def test_a_penalty_that_does_not_act_makes_the_coefficient_comparisons_inert(tmp_path):
    """Arithmetic asked at its best-gold β 0.03 (the v3 trap: in RLVR the best β is the one that does least): no KL
    keeps only 0.05 more accuracy than the reference arm there, less than the 0.1 margin, so same_beta,
    same_gradient and camps (all at 0.03) read "inert" (placement is not testable there) although their controls
    are detected; the frontier, whose penalty check is on log KL, stays equivalent."""
    cal = syn.calibrated("arithmetic", coef=0.03, control_coef=0.1, control_direction={"gold": 1, "log_kl": 1})
    proto = syn.protocol(("arithmetic",))
    exp = syn.write_runs(tmp_path, task="arithmetic", protocol=cal)
    tr = A.analyse(proto, exp, tmp_path, **syn.inputs("arithmetic", cal=cal)).tasks["arithmetic"]
    p = primary(tr)
    for c in ("same_beta", "same_gradient", "camps"):
        assert (p[c]["verdict"], p[c]["acts"], p[c]["control_detected"]) == (T.INERT, False, True), c
        assert p[c]["label"].startswith("the penalty is inert here")
    assert all(p[f"frontier_level{k}"]["verdict"] == T.EQUIVALENT for k in (1, 2, 3))
    assert tr.headline == "not settled"


def test_non_restraining_arm_is_found_by_the_exploratory_restraint_family(tmp_path):
    """loss_k1 (the contract's zero-gradient arm, run by the `checks` design group) barely restrains: the
    exploratory restraint family says so, and it carries no primary comparison, so the headline is unaffected."""
    exp = syn.write_runs(tmp_path, behaviours={"loss_k1": syn.Behaviour(restraint=0.02)}, design=syn.DESIGN)
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    r = tr.restraint.set_index(["level", "arm"])
    assert r.loc[(0.1, "loss_k1"), "verdict"] == S.NO_RESTRAINT
    assert (r.xs("reward_k1", level="arm").verdict == S.RESTRAINS).all()
    assert "loss_k1" not in {r_["contrast"].split(" − ")[0] for r_ in tr.primary}
    assert tr.headline == "does not matter"


def test_missed_level_is_a_failure_counted_not_dropped(tmp_path):
    """reward_k1 ends 60% above level 2 on one of 12 instances: the steering table counts 11 hits of 12, and the
    frontier comparison at level 2 keeps the missed run with its final gold (intention to treat): hit rate 11/12,
    still steerable (>= 0.8), compared on all 12 instances."""
    level = syn.calibrated()["levels"][1]
    exp = syn.write_runs(tmp_path, misses={("reward_k1", level, 3, 0)})
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    st = tr.steering.set_index(["arm", "target"])
    assert (st.loc[("reward_k1", level), ["runs", "hits"]] == [12, 11]).all()
    assert st.loc[("reward_k1", level), "ci_hi"] == pytest.approx(S.clopper_pearson(11, 12, 0.95)[1])
    assert (st.drop(("reward_k1", level)).hits == 12).all()
    r = tr.runs[(tr.runs.kind == "matched") & (tr.runs.arm == "reward_k1") & (tr.runs.level == level)]
    assert len(r) == 12
    row = tr.comparisons[
        (tr.comparisons.family == f"Q3 gold @ KL target {level:g}") & (tr.comparisons.arm == "loss_k3")
    ]
    assert (row.n == 12).all() and row.mean_other.iloc[0] == pytest.approx(r.final_gold.mean())
    f2 = primary(tr)["frontier_level2"]
    assert (f2["n"], f2["hit_rate_other"], f2["hit_rate_arm"], f2["steerable"]) == (12, pytest.approx(11 / 12), 1, True)


def test_unsteerable_arm_is_not_steerable_and_not_compared_where_it_misses(tmp_path):
    """loss_k3 ignores its controller (final KL as at the initial coefficient, 18 / 5 = 3.6 nats): it misses the
    levels 2.1 and 8.4 in every run but lands within 25% of 4.2; reward_k1 hits every level. The frontier at levels 1
    and 3 reads "not steerable" (not compared); level 2 is compared."""
    exp = syn.write_runs(tmp_path, behaviours={"loss_k3": syn.Behaviour(steerable=False)})
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    st = tr.steering.set_index(["arm", "target"])
    assert not st.loc[("loss_k3", 2.1)].steerable and not st.loc[("loss_k3", 8.4)].steerable
    assert st.loc[("loss_k3", 4.2)].steerable and st.xs("reward_k1", level="arm").steerable.all()
    p = primary(tr)
    for c in ("frontier_level1", "frontier_level3"):
        assert (p[c]["verdict"], p[c]["steerable"], p[c]["hit_rate_arm"]) == ("not steerable", False, 0.0), c
    assert p["frontier_level2"]["steerable"] and p["frontier_level2"]["verdict"] != "not steerable"
    assert tr.headline == "not settled"


def test_missing_runs_are_all_named(tmp_path):
    exp = syn.write_runs(tmp_path)
    (tmp_path / exp[10].path / "summary.json").unlink()
    shutil.rmtree(tmp_path / exp[0].path)
    with pytest.raises(A.MissingResultsError) as e:
        A.analyse(PROTO, [*exp, ExpectedRun("fixed@nowhere", tmp_path / "runs/grammar/fixed/0-x-1-0")], tmp_path, **IN)
    msg = str(e.value)
    assert "3 stage(s)" in msg and all(s in msg for s in (exp[10].stage, exp[0].stage, "fixed@nowhere"))


@pytest.mark.parametrize("field, value", [("instance", 1), ("role", "tuned"), ("arm", "loss_k1")])
def test_results_of_another_run_are_refused(tmp_path, field, value):
    """A design run's summary that names another instance, role or arm than its directory is refused."""
    exp = syn.write_runs(tmp_path)
    run = next(r for r in exp if "design_same_beta@" in r.stage and "reward_k3-act" in r.stage and "@2-" in r.stage)
    s = tmp_path / run.path / "summary.json"
    d = json.loads(s.read_text())
    d[field] = value
    s.write_text(json.dumps(d))
    with pytest.raises(A.MissingResultsError, match=run.stage):
        A.analyse(PROTO, exp, tmp_path, **IN)


def test_design_runs_are_read_as_fixed_and_matched_runs_at_their_calibrated_values(tmp_path):
    tr = A.analyse(PROTO, syn.write_runs(tmp_path), tmp_path, **IN).tasks["grammar"]
    d = tr.runs[tr.runs.path.str.contains("/design/")]
    assert len(d) == 12 * sum(len(syn.GROUPS[g]) for g in syn.EVALUATED)
    assert set(zip(d.role, d.kind, d.level)) == {
        ("act", "fixed", 0.1), ("control", "fixed", 0.023), ("tuned", "fixed", 0.1), ("level1", "matched", 2.1),
        ("level2", "matched", 4.2), ("level3", "matched", 8.4)}  # fmt: skip
    assert set(tr.runs[tr.runs.kind == "baseline"].instance) == set(range(12))


def test_a_design_group_runs_only_on_its_allocated_instances(tmp_path):
    """Per-question allocation: the same_beta group was allocated the first 8 instances only (settled there), so
    same_beta is judged on those (2 looks, open below its cap) while every other comparison has all 12."""
    exp = syn.write_runs(tmp_path, allocation={"same_beta": list(range(8))})
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    p = primary(tr)
    assert (p["same_beta"]["n_available"], p["same_beta"]["looks"], p["same_beta"]["status"]) == (8, 2, "open")
    assert all(r["n_available"] == 12 for c, r in p.items() if c != "same_beta")
    sb = tr.runs[(tr.runs.role == "act") & tr.runs.arm.isin(["loss_k3", "reward_k3"])]
    assert set(sb.instance) == set(range(8))


def test_outputs_and_report(tmp_path):
    beh = {"loss_k3": syn.Behaviour(crash_above=3.0, length_offset=1.0)}
    exp = syn.write_runs(tmp_path, behaviours=beh, coefs=(0.03,), targets=(8.0,))
    written = A.run(PROTO, exp, tmp_path / "reports", tmp_path, task="grammar", **IN)
    assert [p.relative_to(tmp_path / "reports").as_posix() for p in written] == list(A.TASK_OUTPUTS)
    assert all(p.is_file() and p.stat().st_size > 0 for p in written)
    report = (tmp_path / "reports/report.md").read_text()
    assert report.startswith("# Does it matter") and "**Answer (matters).**" in report
    assert "Carried by: same_beta, frontier_level2, frontier_level3." in report
    assert "12 independent instances" in report and "1 PPO seed" in report  # scope next to the claim
    for c in syn.comparison_names():
        assert f"- **{c}** (" in report, c
    assert "**Protocol v4 (frozen).** `protocol/grammar.json`" in report and "Protocol lock." in report
    assert "calibration instances 0, 1, 2 only" in report and "gold margin ±0.03" in report
    assert "**Sample-size plan** (`protocol/grammar.plan.json`" in report
    assert "**Contract checks**" in report and "| k1_in_loss | loss_k1 − reward_k1 | log_kl " in report
    assert "[+0.900, +1.600]" in report and "beyond the margin" in report
    assert "## Primary comparisons" in report and "## Exploratory families" in report
    assert "Family-wise error of every primary claim of this task ≤ α = 0.05" in report and "α/9 = 0.00556" in report
    assert "Outcomes, in order of precedence" in report  # the precedence is stated in every report
    assert "; rliable: bootstrap 95% CI of mean Δ" in report and "P(loss_k3 > reward_k3)" in report  # never deciding
    assert "sequential.png" in report
    answer = (tmp_path / "reports/answer.md").read_text()
    assert answer.startswith("#### Task `grammar`: matters") and "| same_beta " in answer
    assert "Carried by: same_beta" in answer
    stats = json.loads((tmp_path / "reports/stats.json").read_text())
    assert stats["headline"] == "matters" and stats["primary"]["same_beta"]["verdict"] == T.MATERIAL
    assert stats["budget"]["per_comparison"] == pytest.approx(0.05 / 9) and stats["n_instances"] == 12
    assert stats["protocol"] == syn.calibrated()["frozen"] and stats["plan"] == syn.calibrated()["plan_frozen"]
    comp = pd.read_csv(tmp_path / "reports/comparisons.csv")
    assert {"ci90_lo", "ci90_hi", "fw_lo", "fw_hi", "n_needed_diff", "n_needed_equiv"} <= set(comp.columns)


def test_bimodal_cell_flagged_by_mixed_collapse(tmp_path):
    off = {i: (-2.0 if i % 3 == 0 else 0.0) for i in range(12)}
    exp = syn.write_runs(tmp_path, behaviours={"loss_k1": syn.Behaviour(instance_offset=off)}, design=syn.DESIGN)
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    cells = tr.cells.set_index(["kind", "arm", "level"])
    assert (
        cells.loc[("fixed", "loss_k1", 0.1), "bimodal"]
        and "mixed collapse" in cells.loc[("fixed", "loss_k1", 0.1), "bimodal_why"]
    )
    assert not cells.loc[("fixed", "reward_k1", 0.1), "bimodal"]
    f = tr.factorial
    assert set(f.effect) == {"placement", "estimator", "placement × estimator"}
    assert (f[f.kind == "fixed"].bimodal_cells == "loss_k1").all()
    assert not math.isnan(f.p.iloc[0]) and (f.p >= S.signflip_floor(12) - 1e-12).all()


def test_arithmetic_task_compares_every_metric(tmp_path):
    proto = syn.protocol(("arithmetic",))
    exp = syn.write_runs(tmp_path, task="arithmetic", coefs=(0.3,))
    tr = A.analyse(proto, exp, tmp_path, **syn.inputs("arithmetic")).tasks["arithmetic"]
    assert set(tr.families.metric) == {"kl", "gold", "ood_gold"}
    assert np.isfinite(tr.comparisons.p).any()
    assert {r["metric"] for r in tr.primary} == {"gold"}  # params.yaml's primary metric
    assert primary(tr)["same_beta"]["margin"] == syn.calibrated("arithmetic")["margins"]["gold"]


def test_seeds_are_averaged_within_instances_and_only_complete_batches_are_judged(tmp_path):
    """Ten instances x two seeds: the unit is the instance (n = 10 in the exploratory comparisons); the primary
    comparisons look at complete batches only (n_available 10, looks at 4 and 8, neither reachable below the cap
    of 12 at alpha/9: open, undecided at n = 8)."""
    exp = syn.write_runs(tmp_path, instances=range(10), seeds=(0, 1))
    tr = A.analyse(PROTO, exp, tmp_path, **syn.inputs(instances=range(10))).tasks["grammar"]
    c = tr.comparisons[tr.comparisons.in_family]
    assert (c.n == 10).all()  # the unit is the instance, not the run
    r = tr.runs[(tr.runs.kind == "fixed") & (tr.runs.arm == "loss_k3") & (tr.runs.level == 0.1)]
    row = c[(c.family == "Q2 gold @ coef 0.1") & (c.label == "loss_k3 − reward_k3")].iloc[0]
    # loss_k3's act and tuned cells are both at 0.1: the same runs twice, averaged within each instance
    assert row.mean_arm == pytest.approx(r.groupby("instance").final_gold.mean().mean())
    assert (tr.collapse.runs[(tr.collapse.kind == "fixed") & (tr.collapse.arm == "reward_k3")] == 20).all()
    for q in tr.primary:
        assert (q["n_available"], q["looks"], q["n"], q["status"]) == (10, 2, 8, "open")
        assert [look["n"] for look in q["path"]] == [4, 8]


def test_per_task_stage_writes_one_task_into_its_folder(tmp_path):
    proto = syn.protocol(("grammar", "arithmetic"))  # the protocol names both; this stage has grammar's runs only
    exp = syn.write_runs(tmp_path)
    written = A.run(proto, exp, tmp_path / "reports/grammar", tmp_path, task="grammar", **IN)
    assert [p.relative_to(tmp_path / "reports/grammar").as_posix() for p in written] == list(A.TASK_OUTPUTS)
    assert all(p.is_file() for p in written)
    with pytest.raises(ValueError, match="exactly that task"):
        A.run(proto, exp, tmp_path / "x", tmp_path, task="arithmetic", **IN)


def test_sft_values_come_from_the_iteration_0_eval_when_the_summary_lacks_them(tmp_path):
    from ablations.load import load_runs

    exp = syn.write_runs(tmp_path)
    before, _ = load_runs(exp, tmp_path)
    for r in exp:
        s = tmp_path / r.path / "summary.json"
        s.write_text(json.dumps({k: v for k, v in json.loads(s.read_text()).items() if not k.startswith("sft_")}))
    after, _ = load_runs(exp, tmp_path)
    np.testing.assert_allclose(after.sft_gold, before.sft_gold)
    np.testing.assert_allclose(after.sft_length, before.sft_length)


def test_calibration_then_evaluation_end_to_end(tmp_path):
    """The protocol calibrate() fixes on the synthetic calibration runs resolves the design and judges the
    evaluation runs: with loss_k3 crashing past 3 nats on every instance, calibration (which ran loss_k3 too)
    tunes loss_k3 away from the crash, and same_beta (at the reference arm's acting coefficient) is a material
    difference."""
    from ablations.calibration import calibrate
    from ablations.config import CalibrationParams
    from ablations.load import load_runs

    beh = {"loss_k3": syn.Behaviour(crash_above=3.0)}
    runs, evals = load_runs(syn.write_calibration_runs(tmp_path, behaviours=beh), tmp_path)
    cal = calibrate(runs, evals, task="grammar", rules=CalibrationParams(**syn.RULES["grammar"]),
                    reference_arm="reward_k1", arms=list(syn.CALIBRATION_ARMS), metrics=["gold"])  # fmt: skip
    assert cal["tuned"]["loss_k3"] == 0.3 and cal["coef"] == 0.1  # 0.3: KL 1.4, below the crash
    frozen = {k: v for k, v in syn.calibrated().items() if k in ("frozen", "plan", "plan_frozen")}
    cal = {**cal, **frozen}
    ev = syn.write_runs(tmp_path, behaviours=beh, protocol=cal, instances=range(100, 112))
    tr = A.analyse(PROTO, ev, tmp_path, **syn.inputs(instances=range(100, 112), cal=cal)).tasks["grammar"]
    v = verdicts(tr)
    assert v["same_beta"] == T.MATERIAL and tr.headline == "matters"
    tuned = tr.runs[tr.runs.role == "tuned"].groupby("arm")["level"].unique()
    assert tuned["loss_k3"].tolist() == [0.3] and tuned["reward_k1"].tolist() == [0.1]
    assert set(tr.runs.instance).isdisjoint(cal["calibration_instances"])


def test_amendment_rows_show_each_comparisons_verdict_and_status_before_and_now():
    """The amendments table of a report: per primary comparison (stats.json keys its rows by comparison, so a level
    comparison is frontier_level3, not its question "frontier"), the verdict with its status in the report committed
    before the amendment and now. Catches: keying "now" by question (every level row read None), a status-only
    amendment (amendment 1 closes, the verdict stays) showing no change."""
    from types import SimpleNamespace

    from ablations.lock import Change, LockStatus

    change = Change("c" * 40, "2026-12-05T04:00:00", "amendment 1", ("ablations/primary.py",))
    row = lambda c, q, v, s: {"comparison": c, "question": q, "verdict": v, "status": s}
    before = {"primary": {r["comparison"]: r for r in (
        row("same_beta", "same_beta", T.MATERIAL, "settled"),
        row("frontier_level3", "frontier", "not steerable", "open"))}}  # fmt: skip
    closed = "closed: not steerable by its cap"
    now = SimpleNamespace(primary=[row("same_beta", "same_beta", T.MATERIAL, "settled"),
                                   row("frontier_level3", "frontier", "not steerable", closed)])  # fmt: skip
    lock = LockStatus(available=True, amendments=(change,), before=((change, before),))
    got = [(r["question"], r["before"], r["now"]) for r in A.amendments(lock, now)]
    assert got == [
        ("same_beta", f"{T.MATERIAL} (settled)", f"{T.MATERIAL} (settled)"),
        ("frontier_level3", "not steerable (open)", f"not steerable ({closed})"),
    ]
    assert A.amendments(LockStatus(available=True), now) == []  # no amendment, no table
