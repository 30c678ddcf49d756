"""The ``analysis`` section of params.yaml: strict, no defaults, one-line messages."""

import pytest
import yaml

from ablations.config import ParamsError, load_params

from ..conftest import repo_params


def check(tmp_path, analysis: dict):
    raw = repo_params()
    raw["analysis"] = analysis
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    return load_params(tmp_path / "params.yaml")


def test_repository_protocol_is_valid_and_complete(tmp_path):
    a = check(tmp_path, repo_params()["analysis"]).analysis
    assert a.reference_arm == "reward_k1" and set(a.tasks) >= {"grammar"}
    assert all("gold" in t.margins for t in a.tasks.values())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda a: a.pop("power"), "missing key 'analysis.power'"),
        (lambda a: a["tasks"]["grammar"].pop("kl_tolerance"), "missing key 'analysis.tasks.grammar.kl_tolerance'"),
        (lambda a: a.update(margin=0.05), "unknown key 'analysis.margin'"),
        (lambda a: a["tasks"]["grammar"].update(margins={"proxy": 0.1}), "primary metric 'gold'"),
        (lambda a: a["tasks"]["grammar"]["margins"].update(gold=0.0), "every margin must be > 0"),
        (lambda a: a["tasks"]["grammar"].update(kl_tolerance=1.5), "kl_tolerance"),
        (lambda a: a.update(alpha="0.05"), "analysis.alpha"),
    ],
)
def test_protocol_mistakes_fail_with_one_line(tmp_path, edit, message):
    a = repo_params()["analysis"]
    edit(a)
    with pytest.raises(ParamsError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        check(tmp_path, a)
    assert "\n" not in str(e.value)
