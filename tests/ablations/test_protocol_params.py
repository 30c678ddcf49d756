"""The ``analysis`` section of params.yaml: strict, no defaults, one-line messages. Margins are not written there:
the calibration fixes them (protocol/<task>.json) and ``AnalysisParams.judged`` fills them in."""

import pytest
import yaml

from ablations.config import Judged, ParamsError, load_params

from ..conftest import repo_params


def check(tmp_path, analysis: dict):
    raw = repo_params()
    raw["analysis"] = analysis
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    return load_params(tmp_path / "params.yaml")


def test_repository_protocol_is_valid_and_complete(tmp_path):
    a = check(tmp_path, repo_params()["analysis"]).analysis
    assert a.reference_arm == "reward_k1" and set(a.tasks) >= {"grammar"}
    assert all("gold" in t.metrics for t in a.tasks.values())
    assert set(a.primary) == {"same_beta", "same_gradient", "frontier", "kl_vs_none", "camps"}
    assert {q.kind for q in a.primary.values()} == {"placement", "penalty", "practice"}
    assert a.primary["frontier"].role == "levels" and a.primary["kl_vs_none"].other == "none"
    assert set(a.checks) == {"k1_in_loss"} and a.checks["k1_in_loss"].metric == "log_kl"
    assert a.sequential.max_cap % a.sequential.batch_size == 0


def test_judged_fills_in_the_calibrated_margins_and_the_collapse_rule(tmp_path):
    a = check(tmp_path, repo_params()["analysis"]).analysis
    j = a.judged("arithmetic", {"gold": 0.1, "ood_gold": 0.1, "log_kl": 0.4})
    assert isinstance(j, Judged) and j.margins == {"gold": 0.1, "ood_gold": 0.1, "log_kl": 0.4}
    assert j.collapse_drop == 0.1 and j.metrics == ("gold", "ood_gold")
    with pytest.raises(ValueError, match="no margin for ood_gold"):
        a.judged("arithmetic", {"gold": 0.1, "log_kl": 0.4})
    with pytest.raises(ValueError, match="no margin for log_kl"):  # calibrated, never written by hand
        a.judged("grammar", {"gold": 0.1})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda a: a.pop("power"), "missing key 'analysis.power'"),
        (lambda a: a.pop("checks"), "missing key 'analysis.checks'"),
        (lambda a: a["tasks"]["grammar"].pop("kl_tolerance"), "missing key 'analysis.tasks.grammar.kl_tolerance'"),
        (lambda a: a.update(margin=0.05), "unknown key 'analysis.margin'"),
        (lambda a: a["tasks"]["grammar"].update(margins={"gold": 0.1}), "unknown key 'analysis.tasks.grammar.margins'"),
        (lambda a: a["tasks"]["grammar"].update(collapse_drop=0.1), "unknown key"),
        (lambda a: a["tasks"]["grammar"].update(min_log_kl_reduction=0.69), "unknown key"),  # v3's: now calibrated
        (lambda a: a["tasks"]["grammar"].update(metrics=["proxy"]), "primary metric 'gold'"),
        (lambda a: a["tasks"]["grammar"].update(metrics=["gold", "log_kl"]), "'log_kl' has its own calibrated margin"),
        (lambda a: a["tasks"]["grammar"].update(metrics=["gold", "gold"]), "duplicate metric gold"),
        (lambda a: a["tasks"]["grammar"].update(kl_tolerance=1.5), "kl_tolerance"),
        (lambda a: a.update(alpha="0.05"), "analysis.alpha"),
        (lambda a: a.update(primary={}), "at least one primary question"),
        (lambda a: a.update(primary={"camps": a["primary"]["camps"]}), "at least one placement question"),
        (lambda a: a["primary"].update(Q5=a["primary"]["camps"]), "analysis.primary"),  # names are identifiers
        (lambda a: a["primary"]["same_beta"].update(metric="ood_gold"), "analysis.primary.same_beta.metric"),
        (lambda a: a["primary"]["same_beta"].update(role="control"), "analysis.primary.same_beta.role"),
        (lambda a: a["primary"]["same_beta"].update(role="target"), "analysis.primary.same_beta.role"),  # v3's role
        (lambda a: a["primary"]["same_beta"].update(kind="headline"), "analysis.primary.same_beta.kind"),
        (lambda a: a["primary"]["same_beta"].pop("kind"), "missing key 'analysis.primary.same_beta.kind'"),
        (lambda a: a["primary"]["camps"].update(other="none"), "the no-KL trajectory) is read at the frontier's"),
        (lambda a: a["sequential"].update(max_cap=10), "must be a multiple of batch_size"),
        (lambda a: a["sequential"].pop("effect"), "missing key 'analysis.sequential.effect'"),
        (lambda a: a["sequential"].update(cap=24), "unknown key 'analysis.sequential.cap'"),  # v3's: now planned
        (lambda a: a["sequential"].update(effect=1.0), "analysis.sequential.effect"),  # a plan at the margin itself
        (lambda a: a["sequential"].update(batch_size=2, max_cap=2), "at most the max cap (2)"),  # 4 instances
        (lambda a: a["sequential"].update(batch_size=3, max_cap=9), "whole batches"),
        (lambda a: a["primary"]["same_gradient"].update(role="tuned"), "needs the design cell 'loss_k3_isrtg-tuned'"),
        (lambda a: a["primary"]["camps"].update(arm="reward_k3"), "needs the design cell 'reward_k3-tuned'"),
        (lambda a: a["primary"]["frontier"].update(arm="reward_k3"), "needs the design cell 'reward_k3-level1'"),
        (lambda a: a["checks"]["k1_in_loss"].update(arm="loss_k1_x"), "needs the design cell 'loss_k1_x-act'"),
    ],
)
def test_protocol_mistakes_fail_with_one_line(tmp_path, edit, message):
    a = repo_params()["analysis"]
    edit(a)
    with pytest.raises(ParamsError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        check(tmp_path, a)
    assert "\n" not in str(e.value)
