"""The calibration stage (pipelines/calibrate.py) and the design cells that depend on it (pipelines/ppo.py), fast:
the refusals, in one line, before anything is written. tests/pipelines/test_e2e.py runs the stage for real (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ablations.config import load_params
from ablations.grid import calibration_cells, evaluation_cells, protocol_path
from pipelines import calibrate

ROOT = Path(__file__).resolve().parents[2]


def refusal(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        calibrate.main(argv)
    return str(e.value.code)


def test_calibrate_refuses_in_one_line_when_its_calibration_runs_are_missing(params_copy):
    message = refusal(["grammar"])
    assert "\n" not in message, message
    n = len([c for c in calibration_cells(load_params()) if c.task == "grammar"])  # none has run
    assert message.startswith(f"error: grammar_calibrate needs every calibration run; {n} stage(s) have no usable")
    assert "grammar_calibration_baseline@0-0" in message and "analysis" not in message, message
    assert not (params_copy / "protocol").exists()  # nothing written


def test_calibrate_names_the_tasks_it_knows(params_copy):
    message = refusal(["grammer"])
    running = ", ".join(load_params().tasks())  # the tasks with instances
    assert message.startswith(f"usage: python -m pipelines.calibrate <task>; allowed: {running}"), message
    assert refusal([]).startswith("usage: ")
    assert not (params_copy / "protocol").exists()


def test_a_design_cell_refuses_to_run_before_the_calibration(params_copy):
    from pipelines.ppo import resolved

    params = load_params()
    cell = next(c for c in evaluation_cells(params) if c.kind == "design")
    assert cell.kl is None  # its strength is not known until the calibration
    with pytest.raises(FileNotFoundError, match=r"protocol/grammar\.json not found: run the calibration first"):
        resolved(params, cell)
    baseline = next(c for c in evaluation_cells(params) if c.kind == "baseline")
    assert resolved(params, baseline) is baseline  # only design cells need the protocol
    assert protocol_path("grammar") == Path("protocol/grammar.json")


def test_a_killed_protocol_write_leaves_a_temporary_file_the_runner_removes(tmp_path, monkeypatch):
    """Issue 30: the fixed-name protocol/.<task>.json.tmp of a killed write was never cleaned (pipelines.leftovers)."""
    from pipelines.leftovers import clean_temp

    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate.os, "replace", killed)
    monkeypatch.setattr(calibrate.Path, "unlink", lambda *a, **k: None)  # a kill runs no cleanup
    with pytest.raises(KeyboardInterrupt):
        calibrate.write_json(tmp_path / "protocol/grammar.json", {"coef": 0.1})
    monkeypatch.undo()
    left = list((tmp_path / "protocol").iterdir())
    assert len(left) == 1 and not (tmp_path / "protocol/grammar.json").exists()
    assert clean_temp(tmp_path) == left and not list((tmp_path / "protocol").iterdir())


@pytest.mark.parametrize("text", ['{"coef": 0.1, "tuned": {"reward_k1"', "", "[1, 2]"])
def test_a_cut_protocol_file_fails_in_one_line_naming_it(params_copy, monkeypatch, text):
    """Issue 30: a truncated protocol/<task>.json read by a design cell or the analysis gave a 20-line
    JSONDecodeError that did not name the file."""
    from pipelines import analysis, ppo

    monkeypatch.setenv("RLHF_CPU_PIN", "off")  # torch came before pipelines in this process
    path = params_copy / "protocol/grammar.json"
    path.parent.mkdir()
    path.write_text(text)
    params = load_params()
    cell = next(c for c in evaluation_cells(params) if c.kind == "design")
    with pytest.raises(SystemExit) as e:
        ppo.main([cell.stage])
    message = str(e.value.code)
    assert message.startswith("error: protocol/grammar.json: ") and "\n" not in message, message
    assert "git checkout protocol/grammar.json" in message and "dvc repro grammar_calibrate" in message
    (params_copy / "protocol/grammar.plan.json").write_text("{}")  # the analysis reads the plan too
    with pytest.raises(ValueError, match=r"^protocol/grammar\.json: ") as err:
        analysis.main("grammar")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ['{"comparisons": {"same_beta"', "", "[1, 2]"])
def test_a_cut_plan_file_fails_in_one_line_naming_it_and_its_stage(params_copy, text):
    """The analysis reads protocol/<task>.plan.json (each comparison's cap) beside the protocol: cut, it fails in one
    line naming the file and the planning stage that writes it."""
    from pipelines import analysis

    (params_copy / "protocol").mkdir()
    (params_copy / "protocol/grammar.json").write_text("{}")
    (params_copy / "protocol/grammar.plan.json").write_text(text)
    with pytest.raises(ValueError, match=r"^protocol/grammar\.plan\.json: ") as err:
        analysis.main("grammar")
    message = str(err.value)
    assert "\n" not in message and "git checkout protocol/grammar.plan.json" in message, message
    assert "dvc repro grammar_planning" in message
