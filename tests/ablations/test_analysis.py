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
from ablations import sequential as Q
from ablations import stats as S
from ablations.load import ExpectedRun

from . import synthetic as syn

PROTO = syn.protocol()  # batches of 4 up to 12 instances: the exact tests first reach a_j at n = 12
IN = syn.inputs()


def primary(tr) -> dict[str, dict]:
    return {r["question"]: r for r in tr.primary}


def verdicts(tr) -> dict[str, str]:
    return {q: r["verdict"] for q, r in primary(tr).items()}


def test_no_difference_with_sensitive_controls_does_not_matter(tmp_path):
    """The protocol can say "does not matter": every arm alike, every margin-sized control detected, every
    primary question equivalent (at n = 8 or 12); the exploratory no-KL controls pass where the reference arm ran."""
    tr = A.analyse(PROTO, syn.write_runs(tmp_path), tmp_path, **IN).tasks["grammar"]
    assert verdicts(tr) == dict.fromkeys(("Q1", "Q2", "Q3", "Q4"), Q.EQUIVALENT)
    assert all(r["control_detected"] and r["settled"] and r["n"] in (8, 12) for r in tr.primary)
    assert tr.headline == "does not matter"
    f = tr.families
    assert f[f.question != "Q3"].pc_pass.all()


def test_planted_collapse_at_the_calibrated_cells_matters(tmp_path):
    """loss_k3 follows reward_k3's gold-vs-KL curve until 3 nats, then crashes: at the calibrated coefficient
    (KL 3.6) and target (4 nats) it collapses, so Q2, Q3 and Q4 are material differences and the headline says
    "matters"; Q1 (loss_k1) is untouched; the collapse table counts the crashed runs."""
    exp = syn.write_runs(tmp_path, behaviours={"loss_k3": syn.Behaviour(crash_above=3.0)})
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    v = verdicts(tr)
    assert v["Q1"] == Q.EQUIVALENT and all(v[q] == Q.MATERIAL for q in ("Q2", "Q3", "Q4"))
    assert all(primary(tr)[q]["estimate"] < -1 for q in ("Q2", "Q3", "Q4"))
    assert tr.headline == "matters"
    collapse = tr.collapse.set_index(["kind", "arm", "level"])
    assert collapse.loc[("fixed", "loss_k3", 0.1), "rate"] == 1 and collapse.loc[("matched", "loss_k3", 4.0), "rate"]
    assert collapse.loc[("fixed", "reward_k3", 0.1), "rate"] == 0


def test_a_collapse_beyond_the_calibrated_cells_shows_only_in_the_exploratory_families(tmp_path):
    """The headline speaks for the calibrated cells only: loss_k3 crashes past 6 nats, which none of the design
    cells reaches, so every primary question is equivalent; the exploratory cell at KL target 8 shows the crash
    as a difference there."""
    exp = syn.write_runs(tmp_path, behaviours={"loss_k3": syn.Behaviour(crash_above=6.0)}, targets=(8.0,))
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    assert tr.headline == "does not matter"
    c = tr.comparisons.set_index(["family", "label"])
    row = c.loc[("Q3 gold @ KL target 8", "loss_k3 − reward_k3")]
    assert row.verdict == S.DIFFERENCE and row.material and row["diff"] < -1


def test_failed_positive_control_makes_the_gold_questions_insensitive(tmp_path):
    """No over-optimisation and no gain (gold flat in KL): the margin-sized control has no gold effect, so Q2-Q4,
    which alone would be equivalent, are "insensitive"; Q1 (KL still responds to the penalty) is equivalent; the
    headline is not "does not matter"."""
    tr = A.analyse(PROTO, syn.write_runs(tmp_path, curves=syn.FLAT), tmp_path, **IN).tasks["grammar"]
    p = primary(tr)
    for q in ("Q2", "Q3", "Q4"):
        assert p[q]["verdict"] == Q.INSENSITIVE and not p[q]["control_detected"]
        assert -p[q]["margin"] < p[q]["lo90"] and p[q]["hi90"] < p[q]["margin"]
    assert p["Q1"]["verdict"] == Q.EQUIVALENT and p["Q1"]["control_detected"]
    assert tr.headline == "not settled"


def test_reference_that_does_not_restrain_makes_q1_insensitive(tmp_path):
    beh = {a: syn.Behaviour(restraint=0.0) for a in syn.CROSSED}
    tr = A.analyse(PROTO, syn.write_runs(tmp_path, behaviours=beh), tmp_path, **IN).tasks["grammar"]
    assert not tr.families[tr.families.question == "Q1"].pc_pass.any()
    assert verdicts(tr)["Q1"] == Q.INSENSITIVE and not primary(tr)["Q1"]["control_detected"]


def test_non_restraining_arm_matters_for_q1(tmp_path):
    exp = syn.write_runs(tmp_path, behaviours={"loss_k1": syn.Behaviour(restraint=0.02)})
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    r = tr.restraint.set_index(["level", "arm"])
    assert r.loc[(0.1, "loss_k1"), "verdict"] == S.NO_RESTRAINT
    assert (r.xs("reward_k1", level="arm").verdict == S.RESTRAINS).all()
    q1 = primary(tr)["Q1"]
    assert q1["verdict"] == Q.MATERIAL and q1["lo"] > math.log(2) and q1["no_kl_direction_ok"]
    assert tr.headline == "matters"


def test_missed_target_is_a_failure_counted_not_dropped(tmp_path):
    miss = ("reward_k3", 4.0, 3, 0)
    exp = syn.write_runs(tmp_path, misses={miss})
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    st = tr.steering.set_index(["arm", "target"])
    assert (st.loc[("reward_k3", 4.0), ["runs", "hits"]] == [12, 11]).all()
    assert st.loc[("reward_k3", 4.0), "ci_hi"] == pytest.approx(S.clopper_pearson(11, 12, 0.95)[1])
    assert (st.drop(("reward_k3", 4.0)).hits == 12).all()
    # intention to treat: the missed run is in the exploratory and the primary comparison with its final gold
    r = tr.runs[(tr.runs.kind == "matched") & (tr.runs.arm == "reward_k3") & (tr.runs.level == 4.0)]
    assert len(r) == 12
    row = tr.comparisons[(tr.comparisons.family == "Q3 gold @ KL target 4") & (tr.comparisons.arm == "loss_k3")]
    assert (row.n == 12).all() and row.mean_other.iloc[0] == pytest.approx(r.final_gold.mean())
    assert primary(tr)["Q3"]["n_available"] == 12


def test_unsteerable_arm_is_not_steerable(tmp_path):
    """loss_k3 ignores its controller (final KL as at the initial coefficient, 18 / 5 = 3.6 nats): it misses a
    calibrated target of 8 nats in every run, reward_k3 hits it in every run."""
    cal = syn.calibrated(kl_target=8.0)
    exp = syn.write_runs(tmp_path, behaviours={"loss_k3": syn.Behaviour(steerable=False)}, protocol=cal)
    tr = A.analyse(PROTO, exp, tmp_path, **syn.inputs(cal=cal)).tasks["grammar"]
    st = tr.steering.set_index("arm")
    assert not st.loc["loss_k3"].steerable and st.loc["reward_k3"].steerable
    assert primary(tr)["Q3"]["levels"] == "KL target 8 / KL target 8"


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
    run = next(r for r in exp if "design@" in r.stage and "reward_k3-coef" in r.stage and "@2-" in r.stage)
    s = tmp_path / run.path / "summary.json"
    d = json.loads(s.read_text())
    d[field] = value
    s.write_text(json.dumps(d))
    with pytest.raises(A.MissingResultsError, match=run.stage):
        A.analyse(PROTO, exp, tmp_path, **IN)


def test_design_runs_are_read_as_fixed_and_matched_runs_at_their_calibrated_values(tmp_path):
    tr = A.analyse(PROTO, syn.write_runs(tmp_path), tmp_path, **IN).tasks["grammar"]
    d = tr.runs[tr.runs.path.str.contains("/design/")]
    assert len(d) == 12 * len(syn.DESIGN)
    assert set(zip(d.role, d.kind, d.level)) == {("coef", "fixed", 0.1), ("control", "fixed", 0.3),
                                                 ("tuned", "fixed", 0.1), ("target", "matched", 4.0)}  # fmt: skip
    assert set(tr.runs[tr.runs.kind == "baseline"].instance) == set(range(12))


def test_outputs_and_report(tmp_path):
    beh = {"loss_k3": syn.Behaviour(crash_above=3.0, length_offset=1.0)}
    exp = syn.write_runs(tmp_path, behaviours=beh, coefs=(0.03,), targets=(8.0,))
    written = A.run(PROTO, exp, tmp_path / "reports", tmp_path, task="grammar", **IN)
    assert [p.relative_to(tmp_path / "reports").as_posix() for p in written] == list(A.TASK_OUTPUTS)
    assert all(p.is_file() and p.stat().st_size > 0 for p in written)
    report = (tmp_path / "reports/report.md").read_text()
    assert report.startswith("# Does it matter") and "**Answer (matters).**" in report
    assert "12 independent instances" in report and "1 PPO seed" in report  # scope next to the claim
    for q in ("Q1", "Q2", "Q3", "Q4"):
        assert f"**{q} (" in report
    assert "**Protocol (frozen).** `protocol/grammar.json`" in report and "Protocol lock." in report
    assert "calibration instances 0, 1, 2 only" in report and "margin ±0.03" in report
    assert "## Primary questions" in report and "## Exploratory families" in report
    assert "Family-wise error of the whole headline ≤ α = 0.05" in report and "α/4 = 0.0125" in report
    assert "![Primary questions" in report or "sequential.png" in report
    answer = (tmp_path / "reports/answer.md").read_text()
    assert answer.startswith("#### Task `grammar`: matters") and "| Q2 " in answer
    stats = json.loads((tmp_path / "reports/stats.json").read_text())
    assert stats["headline"] == "matters" and stats["primary"]["Q2"]["verdict"] == Q.MATERIAL
    assert stats["budget"]["per_question"] == pytest.approx(0.0125) and stats["n_instances"] == 12
    assert stats["protocol"] == syn.calibrated()["frozen"]
    comp = pd.read_csv(tmp_path / "reports/comparisons.csv")
    assert {"ci90_lo", "ci90_hi", "fw_lo", "fw_hi", "n_needed_diff", "n_needed_equiv"} <= set(comp.columns)


def test_bimodal_cell_flagged_by_mixed_collapse(tmp_path):
    off = {i: (-2.0 if i % 3 == 0 else 0.0) for i in range(12)}
    exp = syn.write_runs(tmp_path, behaviours={"loss_k1": syn.Behaviour(instance_offset=off)})
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
    assert {r["metric"] for r in tr.primary} == {"log_kl", "gold"}  # the primary metrics
    assert primary(tr)["Q2"]["margin"] == syn.calibrated("arithmetic")["margins"]["gold"]


def test_seeds_are_averaged_within_instances_and_only_complete_batches_are_judged(tmp_path):
    """Ten instances x two seeds: the unit is the instance (n = 10 in the exploratory comparisons); the primary
    questions look at complete batches only (n_available 10, looks at 4 and 8: equivalence is reachable at n = 8,
    where the TOST level a_j = 0.05/4/3 needs one flip set of 2^8)."""
    exp = syn.write_runs(tmp_path, instances=range(10), seeds=(0, 1))
    tr = A.analyse(PROTO, exp, tmp_path, **syn.inputs(instances=range(10))).tasks["grammar"]
    c = tr.comparisons[tr.comparisons.in_family]
    assert (c.n == 10).all()  # the unit is the instance, not the run
    r = tr.runs[(tr.runs.kind == "fixed") & (tr.runs.arm == "loss_k3") & (tr.runs.level == 0.1)]
    row = c[(c.family == "Q2 gold @ coef 0.1") & (c.label == "loss_k3 − reward_k3")].iloc[0]
    # loss_k3's coef and tuned cells are both at 0.1: the same runs twice, averaged within each instance
    assert row.mean_arm == pytest.approx(r.groupby("instance").final_gold.mean().mean())
    assert (tr.collapse.runs[(tr.collapse.kind == "fixed") & (tr.collapse.arm == "reward_k3")] == 20).all()
    for q in tr.primary:
        assert (q["n_available"], q["looks"]) == (10, 2) and q["n"] in (4, 8)
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
    tunes loss_k3 away from the crash, and Q2 (at the reference arm's coefficient) is a material difference."""
    from ablations.calibration import calibrate
    from ablations.config import CalibrationParams
    from ablations.load import load_runs

    beh = {"loss_k3": syn.Behaviour(crash_above=3.0)}
    runs, evals = load_runs(syn.write_calibration_runs(tmp_path, behaviours=beh), tmp_path)
    cal = calibrate(runs, evals, task="grammar", rules=CalibrationParams(**syn.RULES["grammar"]),
                    reference_arm="reward_k1", arms=list(syn.CALIBRATION_ARMS), metrics=["gold"])  # fmt: skip
    assert cal["tuned"]["loss_k3"] == 0.3 and cal["coef"] == 0.1  # 0.3: KL 1.4, below the crash
    cal = {**cal, "frozen": {"path": "protocol/grammar.json", "sha256": "f" * 64, "commit": None}}
    ev = syn.write_runs(tmp_path, behaviours=beh, protocol=cal, instances=range(100, 112))
    tr = A.analyse(PROTO, ev, tmp_path, **syn.inputs(instances=range(100, 112), cal=cal)).tasks["grammar"]
    v = verdicts(tr)
    assert v["Q2"] == Q.MATERIAL and tr.headline == "matters"
    assert primary(tr)["Q4"]["levels"] == "β 0.3 / β 0.1"
    assert set(tr.runs.instance).isdisjoint(cal["calibration_instances"])
