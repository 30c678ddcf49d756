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
    assert message.startswith("usage: python -m pipelines.calibrate <task>; allowed: grammar, arithmetic"), message
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
