"""The README's params.yaml snippets are valid: each, merged into params.yaml as a profile is, passes the schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from ablations.config import load_params
from pipelines.profile import merge

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_params_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_snippet_validates_merged_into_params_yaml(tmp_path, monkeypatch, i):
    monkeypatch.chdir(tmp_path)  # a pretrained model of a snippet is a directory here, with its config.json
    for path in re.findall(r"pretrained: (\./[\w./-]+)", SNIPPETS[i]):
        (tmp_path / path).mkdir(parents=True)
        (tmp_path / path / "config.json").write_text("{}")
    rt = YAML()
    doc = rt.load((ROOT / "params.yaml").read_text())
    snippet = YAML(typ="safe", pure=True).load(SNIPPETS[i])
    assert merge(doc, snippet), "the snippet changes nothing in params.yaml"
    with (tmp_path / "params.yaml").open("w") as f:
        rt.dump(doc, f)
    load_params(tmp_path / "params.yaml")  # raises ParamsError naming the key if the README is wrong
