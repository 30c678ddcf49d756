"""The packaged model's stage and its place in the pipeline (issue 31), fast: the conversion stage refuses a name
params.yaml does not list, the runner converts before any upstream chain, and the SFT stage's model builder refuses
to start without the converted directory. tests/pipelines/test_real_lm.py runs the real conversion (slow)."""

from __future__ import annotations

import argparse

import pytest

from ablations.section import ModelParams
from pipelines import pretrained
from pipelines.common import build_lm
from pipelines.runner import cli
from tests.ablations.test_packaged import SMOL


def test_stage_refuses_a_name_params_yaml_does_not_list_in_one_line(params_copy):
    with pytest.raises(SystemExit) as e:
        pretrained.main(["smollm2-135m"])  # the repository's params.yaml lists none
    assert str(e.value) == (
        "usage: python -m pipelines.pretrained <name>; allowed: none (params.yaml `pretrained` is empty) "
        "(got 'smollm2-135m')"
    )


def test_runner_converts_the_listed_models_before_any_upstream_chain(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "dvc", lambda args, env, sig, **kw: calls.append(("dvc", *args)))
    monkeypatch.setattr(cli, "upstream_chains", lambda params, evaluation: calls.append(("chains",)) or [])
    monkeypatch.setattr(cli.plan, "status", lambda env, sig: calls.append(("status",)) or {})
    monkeypatch.setattr(cli.plan, "stale_chains", lambda chains, stale: [])
    params = argparse.Namespace(pretrained=["smollm2-135m"])
    args = argparse.Namespace(calibration_only=False)
    cli.Sweep(args, None, params, {}, 1, None, None, None).upstream()
    assert calls == [("dvc", "repro", "pretrained@smollm2-135m"), ("chains",), ("status",)]  # asked after it
    calls.clear()
    cli.Sweep(args, None, argparse.Namespace(pretrained=[]), {}, 1, None, None, None).upstream()
    assert calls == [("chains",), ("status",)]  # nothing to convert: no `dvc repro`


def test_sft_model_builder_refuses_a_packaged_model_not_yet_converted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hf = argparse.Namespace(**SMOL)  # validated elsewhere: here only the builder's own check
    model = ModelParams.model_construct(backend="hf", d_model=576, n_layers=30, n_heads=9, hf=hf)
    with pytest.raises(FileNotFoundError, match=r"models/pretrained/smollm2-135m not found: convert it first"):
        build_lm(model, 15, 11)
