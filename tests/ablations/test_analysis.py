"""End to end on synthetic run directories (tests/ablations/synthetic.py) with planted behaviour."""

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest

from ablations import analysis as A
from ablations import answers as ANS
from ablations import stats as S
from ablations.load import ExpectedRun
from ablations.questions import answer_questions

from . import synthetic as syn

PROTO = syn.protocol()


def answers_of(res, task="grammar") -> dict[tuple[str, str], str]:
    return {(r.question, r.metric): r.reported for r in res.tasks[task].answers.itertuples()}


def test_no_difference_with_sensitive_controls_does_not_matter(tmp_path):
    """The protocol can say "does not matter": every arm alike, no KL over-optimises (every positive control
    passes), every arm steerable, and the halves agree."""
    res = A.analyse(PROTO, syn.write_runs(tmp_path), tmp_path)
    tr = res.tasks["grammar"]
    assert tr.families.pc_pass.all()
    assert set(answers_of(res).values()) == {"equivalent"}, tr.answers
    assert tr.headline == "does not matter"


def test_planted_late_collapse_is_not_does_not_matter(tmp_path):
    """loss_k1 follows reward_k1's gold-vs-KL curve exactly until 4 nats (past the lowest target, 2 nats), then
    crashes: it must not come out as "does not matter", and what matters must name it."""
    exp = syn.write_runs(tmp_path, behaviours={"loss_k1": syn.Behaviour(crash_above=4.0)}, targets=(2.0, 8.0))
    res = A.analyse(PROTO, exp, tmp_path)
    tr = res.tasks["grammar"]
    assert tr.headline == "matters"
    ans = answers_of(res)
    assert ans[("Q3", "gold")] == "matters" and ans[("Q2", "gold")] == "matters"
    c = tr.comparisons.set_index(["family", "label"])
    assert c.loc[("Q3 gold @ KL target 2", "loss_k1 − reward_k1"), "verdict"] == "equivalent"  # same curve there
    assert c.loc[("Q3 gold @ KL target 8", "loss_k1 − reward_k1"), "material"]
    assert "loss_k1" in " ".join(str(x) for x in tr.answers.carriers)
    collapse = tr.collapse.set_index(["kind", "arm", "level"])
    assert (
        collapse.loc[("matched", "loss_k1", 8.0), "rate"] == 1
        and collapse.loc[("matched", "loss_k1", 2.0), "rate"] == 0
    )


def test_failed_positive_control_makes_the_family_insensitive(tmp_path):
    """No over-optimisation and no gain (gold flat in KL): no KL and the reference arm end with the same gold, so
    the gold families cannot detect the absence of a penalty; everything looks equivalent, yet the answer is
    "insensitive", never "equivalent", and the headline is not "does not matter"."""
    res = A.analyse(PROTO, syn.write_runs(tmp_path, curves=syn.FLAT), tmp_path)
    tr = res.tasks["grammar"]
    gold = tr.families[tr.families.metric == "gold"]
    assert not gold.pc_pass.any()
    c = tr.comparisons[tr.comparisons.in_family]
    assert ((c.verdict == "equivalent") | c.within_margin).all()  # alone they would say "does not matter"
    for q in ("Q2", "Q3", "Q4"):
        assert answers_of(res)[(q, "gold")] == "insensitive"
    assert answers_of(res)[("Q1", "kl")] == "equivalent"  # KL still responds to the penalty
    assert tr.headline == "not settled"


def test_reference_that_does_not_restrain_makes_q1_insensitive(tmp_path):
    beh = {a: syn.Behaviour(restraint=0.0) for a in syn.CROSSED}
    res = A.analyse(PROTO, syn.write_runs(tmp_path, behaviours=beh), tmp_path)
    tr = res.tasks["grammar"]
    assert not tr.families[tr.families.question == "Q1"].pc_pass.any()
    assert answers_of(res)[("Q1", "kl")] == "insensitive"


def test_non_restraining_arm_matters_for_q1(tmp_path):
    res = A.analyse(PROTO, syn.write_runs(tmp_path, behaviours={"loss_k1": syn.Behaviour(restraint=0.02)}), tmp_path)
    tr = res.tasks["grammar"]
    r = tr.restraint.set_index(["level", "arm"])
    assert (r.xs("loss_k1", level="arm").verdict == S.NO_RESTRAINT).all()
    assert (r.xs("reward_k1", level="arm").verdict == S.RESTRAINS).all()
    assert answers_of(res)[("Q1", "kl")] == "matters"


def test_missed_target_is_a_failure_counted_not_dropped(tmp_path):
    miss = ("reward_k2", 8.0, 3, 0)
    exp = syn.write_runs(tmp_path, misses={miss})
    tr = A.analyse(PROTO, exp, tmp_path).tasks["grammar"]
    st = tr.steering.set_index(["arm", "target"])
    assert (st.loc[("reward_k2", 8.0), ["runs", "hits"]] == [6, 5]).all()
    assert st.loc[("reward_k2", 8.0), "ci_hi"] == pytest.approx(S.clopper_pearson(5, 6, 0.95)[1])
    assert (st.drop(("reward_k2", 8.0)).hits == 6).all()
    # intention to treat: the missed run is in the comparison with its final gold
    r = tr.runs[(tr.runs.kind == "matched") & (tr.runs.arm == "reward_k2") & (tr.runs.level == 8.0)]
    assert len(r) == 6
    row = tr.comparisons[(tr.comparisons.family == "Q3 gold @ KL target 8") & (tr.comparisons.arm == "reward_k2")]
    assert (row.n == 6).all() and row.mean_arm.iloc[0] == pytest.approx(r.final_gold.mean())


def test_unsteerable_arm_matters_for_q3(tmp_path):
    beh = {"loss_k1": syn.Behaviour(steerable=False)}
    tr = A.analyse(PROTO, syn.write_runs(tmp_path, behaviours=beh), tmp_path).tasks["grammar"]
    st = tr.steering.set_index("arm")
    assert not st.loc["loss_k1"].steerable.any() and st.loc["reward_k1"].steerable.all()
    assert tr.answers.set_index("question").loc["Q3", "reported"] == "matters"


def test_split_half_agreement_and_a_flip_is_unsettled(tmp_path):
    """loss_k2 gains 0.2 gold on the instances of one half and loses 0.2 on the other: each half finds a clear
    difference, of opposite signs. The agreement table must match answering each half separately, and Q2-Q4 must be
    reported as unsettled rather than as a verdict."""
    flip = syn.Behaviour(instance_offset=(0.2, -0.2, 0.2, -0.2, 0.2, -0.2))
    exp = syn.write_runs(tmp_path, behaviours={"loss_k2": flip})
    tr = A.analyse(PROTO, exp, tmp_path).tasks["grammar"]
    assert tr.halves == ([0, 2, 4], [1, 3, 5])
    runs = tr.runs
    halves = [answer_questions(runs[runs.instance.isin(h)], "grammar", PROTO, permutation=False) for h in tr.halves]
    ag = tr.agreement.set_index(["family", "item"])
    for name, res in zip(("half_a", "half_b"), halves):
        c = res["comparisons"][res["comparisons"].in_family]
        for r in c.itertuples():
            assert ag.loc[(r.family, r.label), name] == ANS._signed(r)
        for r in res["restraint"].itertuples():
            assert ag.loc[(r.family, r.arm), name] == r.verdict
    assert ag.agree.sum() == (ag.half_a == ag.half_b).sum() and len(ag) == len(
        tr.comparisons[tr.comparisons.in_family]
    ) + len(tr.restraint)
    row = ag.loc[("Q2 gold @ coef 0.1", "loss_k2 − reward_k1")]
    assert {row.half_a, row.half_b} == {"difference+", "difference-"} and row.conflict
    rep = tr.answers.set_index(["question", "metric"])
    for q in ("Q2", "Q3", "Q4"):
        assert rep.loc[(q, "gold"), "reported"] == "unsettled"
    assert tr.headline != "does not matter"


def test_missing_runs_are_all_named(tmp_path):
    exp = syn.write_runs(tmp_path)
    (tmp_path / exp[10].path / "summary.json").unlink()
    shutil.rmtree(tmp_path / exp[0].path)
    with pytest.raises(A.MissingResultsError) as e:
        A.analyse(PROTO, [*exp, ExpectedRun("fixed@nowhere", tmp_path / "runs/grammar/fixed/0-x-1-0")], tmp_path)
    msg = str(e.value)
    assert "3 stage(s)" in msg and all(s in msg for s in (exp[10].stage, exp[0].stage, "fixed@nowhere"))


def test_results_of_another_run_are_refused(tmp_path):
    exp = syn.write_runs(tmp_path)
    s = tmp_path / exp[20].path / "summary.json"
    d = json.loads(s.read_text())
    d["instance"] = (d["instance"] + 1) % 6
    s.write_text(json.dumps(d))
    with pytest.raises(A.MissingResultsError, match=exp[20].stage):
        A.analyse(PROTO, exp, tmp_path)


def test_outputs_and_report(tmp_path):
    beh = {"loss_k1": syn.Behaviour(crash_above=4.0, length_offset=1.0)}
    exp = syn.write_runs(tmp_path, behaviours=beh, coefs=(0.03, 0.3), targets=(8.0,))
    written = A.run(PROTO, exp, tmp_path / "reports", tmp_path)
    assert [p.relative_to(tmp_path / "reports").as_posix() for p in written] == A.output_paths(["grammar"])
    assert all(p.is_file() and p.stat().st_size > 0 for p in written)
    report = (tmp_path / "reports/grammar/report.md").read_text()
    assert report.startswith("# Does it matter") and "**Answer (matters).**" in report
    assert "6 independent instances" in report and "1 PPO seed" in report  # scope next to the claim
    for q in ("Q1", "Q2", "Q3", "Q4"):
        assert f"**{q} " in report
    assert "90% CI (TOST)" in report and "positive control" in report and "Protocol lock." in report
    assert "loss_k1, final length" in report  # secondary outcome line
    stats = json.loads((tmp_path / "reports/grammar/stats.json").read_text())
    assert stats["headline"] == "matters" and stats["answers"]["Q3/gold"]["reported"] == "matters"
    comp = pd.read_csv(tmp_path / "reports/grammar/comparisons.csv")
    assert {"ci90_lo", "ci90_hi", "fw_lo", "fw_hi", "n_needed_diff", "n_needed_equiv"} <= set(comp.columns)
    assert json.loads((tmp_path / "reports/stats.json").read_text())["grammar"]["headline"] == "matters"


def test_bimodal_cell_flagged_by_mixed_collapse(tmp_path):
    exp = syn.write_runs(tmp_path, behaviours={"loss_k1": syn.Behaviour(instance_offset=(0, 0, -2, -2, -2, -2))})
    tr = A.analyse(PROTO, exp, tmp_path).tasks["grammar"]
    cells = tr.cells.set_index(["kind", "arm", "level"])
    assert (
        cells.loc[("fixed", "loss_k1", 0.1), "bimodal"]
        and "mixed collapse" in cells.loc[("fixed", "loss_k1", 0.1), "bimodal_why"]
    )
    assert not cells.loc[("fixed", "reward_k1", 0.1), "bimodal"]
    f = tr.factorial
    assert set(f.effect) == {"placement", "estimator", "placement × estimator"}
    assert (f[f.kind == "fixed"].bimodal_cells == "loss_k1").all()
    assert not math.isnan(f.p.iloc[0]) and (f.p >= S.signflip_floor(6) - 1e-12).all()


def test_arithmetic_task_compares_every_metric(tmp_path):
    proto = syn.protocol(("arithmetic",))
    exp = syn.write_runs(tmp_path, task="arithmetic", targets=(2.0, 6.0))
    tr = A.analyse(proto, exp, tmp_path).tasks["arithmetic"]
    assert set(zip(tr.answers.question, tr.answers.metric)) == {("Q1", "kl")} | {
        (q, m) for q in ("Q2", "Q3", "Q4") for m in ("gold", "ood_gold")
    }
    assert set(tr.families.metric) == {"kl", "gold", "ood_gold"}
    assert np.isfinite(tr.comparisons.p).any()


def test_seeds_are_averaged_within_instances_and_n_need_not_be_even(tmp_path):
    exp = syn.write_runs(tmp_path, instances=range(5), seeds=(0, 1), coefs=(0.03, 0.3), targets=(8.0,))
    tr = A.analyse(PROTO, exp, tmp_path).tasks["grammar"]
    c = tr.comparisons
    assert (c.n == 5).all()  # the unit is the instance, not the run
    r = tr.runs[(tr.runs.kind == "fixed") & (tr.runs.arm == "loss_k2") & (tr.runs.level == 0.3)]
    row = c[(c.family == "Q2 gold @ coef 0.3") & (c.label == "loss_k2 − reward_k1")].iloc[0]
    assert row.mean_arm == pytest.approx(r.groupby("instance").final_gold.mean().mean())
    assert (tr.collapse.runs[tr.collapse.kind == "fixed"] == 10).all()  # collapse is counted per run
    assert tr.halves == ([0, 2, 4], [1, 3])
    assert set(tr.tuning.evaluated_on.map(len)) == {2, 3}


def test_per_task_stage_writes_one_task_into_its_folder(tmp_path):
    proto = syn.protocol(("grammar", "arithmetic"))  # the protocol names both; this stage has grammar's runs only
    exp = syn.write_runs(tmp_path, coefs=(0.03, 0.3), targets=(8.0,))
    written = A.run(proto, exp, tmp_path / "reports/grammar", tmp_path, task="grammar")
    assert [p.relative_to(tmp_path / "reports/grammar").as_posix() for p in written] == list(A.TASK_OUTPUTS)
    assert all(p.is_file() for p in written)
    with pytest.raises(ValueError, match="exactly that task"):
        A.run(proto, exp, tmp_path / "x", tmp_path, task="arithmetic")


def test_sft_values_come_from_the_iteration_0_eval_when_the_summary_lacks_them(tmp_path):
    from ablations.load import load_runs

    exp = syn.write_runs(tmp_path, coefs=(0.1,), targets=())
    before, _ = load_runs(exp, tmp_path)
    for r in exp:
        s = tmp_path / r.path / "summary.json"
        s.write_text(json.dumps({k: v for k, v in json.loads(s.read_text()).items() if not k.startswith("sft_")}))
    after, _ = load_runs(exp, tmp_path)
    np.testing.assert_allclose(after.sft_gold, before.sft_gold)
    np.testing.assert_allclose(after.sft_length, before.sft_length)
