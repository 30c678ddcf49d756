"""The iteration-0 evaluation of a task instance (pipelines/eval0.py), made once and read by every cell of it
(pipelines/ppo.py ``initial_eval``): a cell's outputs are byte for byte those of a cell that measures it itself."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import yaml

from ablations.experiment import load_experiment
from ablations.grid import find_cell
from pipelines import data, eval0, rm, sft
from pipelines.common import eval0_path, eval_sets, setup
from pipelines.cpu import PIN_ENV
from pipelines.dvcyaml import render
from pipelines.ppo import initial_eval, load_cell, to_csv
from rlhf.ppo import train_ppo
from tests.conftest import repo_params
from tests.pipelines.tiny import TINY

CELL = "grammar_design@10-reward_k1-act-0"  # the params' reward_k1 where the penalty acts (calibrated)


@pytest.fixture(autouse=True)
def _unpinned(monkeypatch):
    """The stages run in this process, where torch was imported before pipelines: unpinned (pipelines/cpu.py)."""
    monkeypatch.setenv(PIN_ENV, "off")


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    """The tiny grid's evaluation instance 10 built by its stages (data, sft, rm, eval0) in a working directory,
    with a calibrated protocol for its design cells."""
    root = tmp_path_factory.mktemp("eval0")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv(PIN_ENV, "off")
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        (root / "params.yaml").write_text(yaml.safe_dump(repo_params(TINY), sort_keys=False))
        (root / "protocol").mkdir()
        protocol = {"coef": 0.1, "control_coef": 0.03, "tuned": {"reward_k1": 0.1, "loss_k3": 0.3}, "levels": [1, 2, 4]}
        (root / "protocol/grammar.json").write_text(json.dumps(protocol))
        for stage in (data, sft, rm, eval0):
            stage.main(["grammar", "10"])
        yield root


def test_a_cell_reading_eval0_writes_the_same_bytes_as_a_cell_measuring_it(instance, monkeypatch):
    monkeypatch.chdir(instance)
    params, device = load_experiment(), setup()
    c = load_cell(params, find_cell(params, CELL), device)
    assert c.initial_eval is not None and list(c.initial_eval)[:3] == ["iteration", "gold", "proxy"]
    args = (c.ref, c.reward_model, c.task, c.data["train_prompts"], eval_sets(c.data, device), c.cfg)
    read = train_ppo(copy.deepcopy(c.ref), *args, initial_eval=c.initial_eval)
    measured = train_ppo(copy.deepcopy(c.ref), *args)
    assert read["evals"][0] == measured["evals"][0]  # floats read back bit for bit, keys in the same order
    for key in ("evals", "history"):
        assert to_csv(read[key]) == to_csv(measured[key])
    assert json.dumps(read["summary"]) == json.dumps(measured["summary"])


def test_eval0_is_used_not_measured_again(instance, monkeypatch):
    """What the cell is given is its iteration-0 row (a marked copy shows it was not measured again)."""
    monkeypatch.chdir(instance)
    params, device = load_experiment(), setup()
    c = load_cell(params, find_cell(params, CELL), device)
    marked = {**c.initial_eval, "gold": 123.0}
    cfg = c.cfg.model_copy(update={"iterations": 1})
    out = train_ppo(copy.deepcopy(c.ref), c.ref, c.reward_model, c.task, c.data["train_prompts"],
                    eval_sets(c.data, device), cfg, initial_eval=marked)  # fmt: skip
    assert out["evals"][0] == marked and out["summary"]["peak_gold"] == 123.0


def test_a_cell_with_other_evaluation_values_measures_iteration_0_itself(instance, monkeypatch, capsys):
    monkeypatch.chdir(instance)
    params = load_experiment()
    cell = find_cell(params, "grammar_baseline@10-0")
    assert initial_eval(cell) is not None
    hotter = replace(cell, config=cell.config.model_copy(update={"temperature": 0.5}))
    assert initial_eval(hotter) is None
    assert "it measures iteration 0" in capsys.readouterr().out
    made = json.loads(eval0_path("grammar", 10).read_text())["made_with"]
    assert made == {k: getattr(cell.config, k) for k in eval0.READS}


def test_a_missing_eval0_names_the_stage_to_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(repo_params(TINY), sort_keys=False))
    cell = find_cell(load_experiment(), "grammar_calibration_baseline@0-0")
    with pytest.raises(FileNotFoundError, match=r"dvc repro grammar_calibration_eval0@0\)$"):
        initial_eval(cell)


def test_the_stage_declares_exactly_the_values_the_evaluation_reads_and_every_cell_depends_on_it():
    stages = yaml.safe_load(render())["stages"]
    for task in ("grammar", "arithmetic"):
        params = stages[f"{task}_eval0"]["params"]
        assert {p for p in params if p.startswith(f"{task}.ppo.")} == {f"{task}.ppo.{k}" for k in eval0.READS}
        assert stages[f"{task}_eval0"]["outs"] == ["models/<task>/${item.instance}/eval0.json".replace("<task>", task)]
        cells = [s for s, e in stages.items() if s.startswith(f"{task}_") and "pipelines.ppo" in e["cmd"]]
        assert cells and all(f"models/{task}/${{item.instance}}/eval0.json" in stages[s]["deps"] for s in cells)
