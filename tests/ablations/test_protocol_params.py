"""The ``analysis`` section of params.yaml: strict, no defaults, one-line messages. Margins are not written there:
the calibration fixes them (protocol/<task>.json) and ``AnalysisParams.judged`` fills them in."""

import math

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
    assert set(a.primary) == {"Q1", "Q2", "Q3", "Q4"} and a.primary["Q1"].metric == "log_kl"
    assert a.sequential.cap % a.sequential.batch_size == 0


def test_judged_fills_in_the_calibrated_margins_and_the_collapse_rule(tmp_path):
    a = check(tmp_path, repo_params()["analysis"]).analysis
    j = a.judged("arithmetic", {"gold": 0.1, "ood_gold": 0.1, "unused": 9.0})
    assert isinstance(j, Judged) and j.margins == {"gold": 0.1, "ood_gold": 0.1}
    assert j.collapse_drop == 0.1 and j.metrics == ("gold", "ood_gold")
    assert j.min_log_kl_reduction == pytest.approx(math.log(2), abs=1e-3)
    with pytest.raises(ValueError, match="no margin for ood_gold"):
        a.judged("arithmetic", {"gold": 0.1})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda a: a.pop("power"), "missing key 'analysis.power'"),
        (lambda a: a["tasks"]["grammar"].pop("kl_tolerance"), "missing key 'analysis.tasks.grammar.kl_tolerance'"),
        (lambda a: a.update(margin=0.05), "unknown key 'analysis.margin'"),
        (lambda a: a["tasks"]["grammar"].update(margins={"gold": 0.1}), "unknown key 'analysis.tasks.grammar.margins'"),
        (lambda a: a["tasks"]["grammar"].update(collapse_drop=0.1), "unknown key"),
        (lambda a: a["tasks"]["grammar"].update(metrics=["proxy"]), "primary metric 'gold'"),
        (lambda a: a["tasks"]["grammar"].update(metrics=["gold", "log_kl"]), "judged by Q1"),
        (lambda a: a["tasks"]["grammar"].update(metrics=["gold", "gold"]), "duplicate metric gold"),
        (lambda a: a["tasks"]["grammar"].update(kl_tolerance=1.5), "kl_tolerance"),
        (lambda a: a.update(alpha="0.05"), "analysis.alpha"),
        (lambda a: a.update(primary={}), "at least one primary comparison"),
        (lambda a: a["primary"].update(Q5=a["primary"]["Q1"]), "analysis.primary"),
        (lambda a: a["primary"]["Q2"].update(metric="ood_gold"), "analysis.primary.Q2.metric"),
        (lambda a: a["primary"]["Q2"].update(role="control"), "analysis.primary.Q2.role"),
        (lambda a: a["sequential"].update(cap=10), "must be a multiple of batch_size"),
        (lambda a: a["sequential"].pop("rho"), "missing key 'analysis.sequential.rho'"),
        (lambda a: a["sequential"].update(batch_size=2, cap=2), "at most the cap (2)"),  # 4 instances
        (lambda a: a["sequential"].update(batch_size=3, cap=9), "whole batches"),
        (lambda a: a["primary"]["Q3"].update(other="loss_k1"), "needs the design cell 'loss_k1-target'"),
        (lambda a: a["primary"]["Q4"].update(arm="reward_k3"), "needs the design cell 'reward_k3-tuned'"),
    ],
)
def test_protocol_mistakes_fail_with_one_line(tmp_path, edit, message):
    a = repo_params()["analysis"]
    edit(a)
    with pytest.raises(ParamsError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        check(tmp_path, a)
    assert "\n" not in str(e.value)
