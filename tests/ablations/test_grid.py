"""The runner's stage names are DVC's: for every spelling of a value params.yaml accepts, the cells of
ablations.grid name exactly the stages DVC generates from dvc.yaml, and values that would make them disagree are
refused before any compute."""

from __future__ import annotations

import shutil

import pytest
import yaml

from ablations.config import ParamsError, load_params
from ablations.grid import cells, matrix_key, stage_name

from ..conftest import REPO, repo_params

# Spellings YAML 1.2 (DVC's parser) reads as floats or ints, including the ones where two parsers disagree.
COEF_SPELLINGS = ["0.1", "1.0", "1e-05", "1.0e-2", ".5", "0.30000000000000004", "2.50", "1000.0", "+0.25", "3E-3"]
COEF_SPELLINGS += ["3", "+7"]  # ints: DVC names them 3 and 7, and so does the runner
TARGET_SPELLINGS = ["3", "9.0", "20.0", "1e1", "+4", "0.5"]  # ints and floats alike (issue 20)
SEED_SPELLINGS = ["0", "7", "2147483647", "+3"]  # not 010: octal-looking ints are refused (YAML 1.1 reads 8)


def dvc_stage_names(tmp_path, params_text: str) -> set[str]:
    from dvc.repo import Repo

    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(params_text)
    Repo.init(str(tmp_path), no_scm=True)
    with Repo(str(tmp_path)) as repo:
        return {s.name for s in repo.index.stages}


def params_text(coefs: list[str], seeds: list[str], targets: list[str] | None = None) -> str:
    """The repository's params.yaml with these coefficients, seeds and grammar KL targets written verbatim."""
    p = repo_params()
    p["grammar"]["coefs"], p["grid"]["seeds"], p["grammar"]["kl_targets"] = "COEFS", "SEEDS", "TARGETS"
    text = yaml.safe_dump(p, sort_keys=False)
    spelled = {"COEFS": coefs, "SEEDS": seeds, "TARGETS": targets or ["3.0", "9.0", "20.0"]}
    for k, v in spelled.items():
        text = text.replace(k, "[" + ", ".join(v) + "]")
    return text


def test_matrix_key_is_dvc_to_str():
    from dvc.parsing.interpolate import to_str

    for value in (0.1, 1.0, 1e-05, 3, 0, True, False, "reward_k1", 0.30000000000000004):
        assert matrix_key(value) == to_str(value)
    assert stage_name("ppo", "loss_k3", 0.1, 2) == "ppo@loss_k3-0.1-2"


def test_runner_and_dvc_agree_on_every_accepted_spelling(tmp_path):
    text = params_text(COEF_SPELLINGS, SEED_SPELLINGS, TARGET_SPELLINGS)
    (tmp_path / "check.yaml").write_text(text)
    params = load_params(tmp_path / "check.yaml")
    ours = {c.stage for c in cells(params)}
    theirs = dvc_stage_names(tmp_path, text)
    assert ours <= theirs
    upstream = {f"grammar_{s}@{i}" for s in ("data", "sft", "rm") for i in params.grammar.instances}
    upstream |= {f"arithmetic_{s}@{i}" for s in ("data", "sft") for i in params.arithmetic.instances}
    assert theirs - ours == upstream | {"grammar_analysis", "arithmetic_analysis"}


@pytest.mark.parametrize(
    "coefs, seeds, message",
    [
        (["1", "1.0"], ["0"], "duplicate coefficient 1"),  # two names (…-1-…, …-1.0-…), one value
        (["0.1"], ["1.0"], "grid.seeds.0"),  # a float seed
        (["0.1"], ["true"], "grid.seeds.0"),  # a boolean seed
        (["true"], ["0"], "grammar.coefs.0"),  # a boolean coefficient
        (["0.1", "1e-1"], ["0"], "duplicate coefficient"),  # two spellings, one value, one stage name
        (["0.1"], ["1", "+1"], "duplicate seed 1"),
        (["0.1"], ["010"], "grid.seeds.0: '010': write the number without leading zeros"),
        ([".inf"], ["0"], "grammar.coefs.0"),
        ([".nan"], ["0"], "grammar.coefs.0"),
        (["0.1"], ["-1"], "grid.seeds.0"),
    ],
)
def test_values_that_would_disagree_or_mislead_are_refused(tmp_path, coefs, seeds, message):
    path = tmp_path / "params.yaml"
    path.write_text(params_text(coefs, seeds))
    with pytest.raises(ParamsError, match=message) as err:
        load_params(path)
    assert "\n" not in str(err.value)
