"""The runner's --population (pipelines/runner/population.py): stale cells grouped by structure, each group one worker
call, every cell of a group recorded in dvc.lock as a cell is (fake DVC and fake cells, tests/pipelines/fakes.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ablations.config import Params
from ablations.grid import calibration_cells, plan_cells
from pipelines.runner import population
from tests.conftest import repo_params
from tests.pipelines.fakes import committed, env, runner_script
from tests.pipelines.procs import HANG_S
from tests.pipelines.tiny import ALL_CELLS, TINY, make_repo, sh, visible_runs

PARAMS = Params.model_validate(repo_params(TINY))
CAL, PLAN = calibration_cells(PARAMS), plan_cells(PARAMS)


def structure_of(cell) -> tuple:
    return (cell.arm, cell.kind.endswith("baseline"))


def test_plan_groups_cells_of_one_structure_in_order_up_to_n():
    items = population.plan(PARAMS, CAL, 2)
    members = [c for item in items for c in population.members(item)]
    assert sorted(c.stage for c in members) == sorted(c.stage for c in CAL)  # each cell once
    for item in items:
        assert len(population.members(item)) <= 2
        assert len({structure_of(c) for c in population.members(item)}) == 1
    groups = [i for i in items if isinstance(i, population.Group)]
    assert groups and all(len(g.cells) == 2 for g in groups[:1])


def test_a_moving_reference_cell_runs_on_its_own():
    arm = {"target": "reference", "placement": "reward", "estimator": "k1", "ref_sync_every": 2, "ref_sync_alpha": 1.0}
    over = {**TINY, "grid": {**TINY["grid"], "arms": {**TINY["grid"]["arms"], "reward_k1": arm}}}
    params = Params.model_validate(repo_params(over))
    cal = calibration_cells(params)
    items = population.plan(params, cal, 8)
    grouped = {c.arm for i in items if isinstance(i, population.Group) for c in i.cells}
    assert "reward_k1" not in grouped and "loss_k3" in grouped
    assert {c.stage for c in cal if c.arm == "reward_k1"} <= {i.stage for i in items}


@pytest.mark.parametrize("bf16", [False, True])
def test_hf_cells_are_grouped_unless_under_bf16_autocast(bf16):
    from tests.pipelines.test_hf_pipeline import hf_params

    params = Params.model_validate(hf_params(hf={"bf16": bf16}))
    cal = calibration_cells(params)
    items = population.plan(params, cal, 8)
    groups = [i for i in items if isinstance(i, population.Group)]
    assert (not groups) if bf16 else (groups and len(items) < len(cal))
    assert sorted(c.stage for i in items for c in population.members(i)) == sorted(c.stage for c in cal)


def test_the_runner_runs_groups_and_records_every_cell(workdir):
    script = runner_script().replace(
        "from tests.pipelines import fakes; ",
        "from tests.pipelines import fakes; from pipelines.runner import population; "
        "population.group_fn = fakes.sleepy_group; ",
    )
    argv = ["--workers", "2", "--commit-every", "0", "--calibration-only", "--population", "3"]
    out = subprocess.run(
        [sys.executable, "-c", script, *argv], cwd=workdir, env=env(workdir, FAKE_FAST="1000"),
        capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout, out.stderr)
    recorded = set(committed(workdir / "fake.lock"))
    tails = {"grammar_calibrate", "grammar_planning"}
    assert recorded == {c.stage for c in CAL + PLAN} | tails  # every cell, recorded as a cell
    groups = [json.loads(p.read_text()) for p in (workdir / "fake").glob("group-*.json")]
    # plan cells need the calibration's protocol to know their structure (the fake calibrate writes none): alone
    planned = [i for w in (CAL, PLAN) for i in population.plan(PARAMS, w, 3) if isinstance(i, population.Group)]
    assert sorted(groups) == sorted([c.stage for c in g.cells] for g in planned) and groups
    assert all((workdir / "runs").exists() for _ in groups)


@pytest.mark.slow
def test_the_pipeline_with_populations_is_clean_and_has_one_run_per_stage(tmp_path):
    """The tiny project end to end with real DVC and real cells, --population 8: every cell recorded (dvc status
    clean), its outputs written and one FINISHED MLflow run per stage, as without populations."""
    repo = make_repo(tmp_path, repo_params(TINY))
    out = sh(repo, sys.executable, "-m", "pipelines.run", "--workers", "2", "--population", "8")
    assert "in its population" in out.stdout, out.stdout
    status = sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout
    assert json.loads(status or "{}") == {}, status
    runs = visible_runs(repo)
    assert set(runs) >= ALL_CELLS
    assert all(len(runs[s]) == 1 and runs[s][0].info.status == "FINISHED" for s in ALL_CELLS)
    summary = json.loads((repo / "runs/grammar/design/10-loss_k3-act-0/summary.json").read_text())
    assert summary["arm"] == "loss_k3" and "final_gold" in summary
