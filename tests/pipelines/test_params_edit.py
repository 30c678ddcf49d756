"""params.yaml edited while the runner runs (issue 20, point 0), for real on the tiny grid of test_e2e: what is
recorded in dvc.lock is what was computed. Slow (a few minutes): run with `make test-all`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.pipelines.fakes import runner_script
from tests.pipelines.procs import status, wait_while_running
from tests.pipelines.tiny import cell_stages, stage_env, visible_runs

pytestmark = pytest.mark.slow
PY = sys.executable


def test_a_ppo_param_changed_while_the_runner_runs_leaves_the_changed_cells_stale(repo, tmp_path):
    (tmp_path / "fake").mkdir()
    env = {
        **stage_env(repo),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "FAKE_DIR": str(tmp_path / "fake"),
    }
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    proc = subprocess.Popen(  # every cell real; the first finished cell is recorded at once, the rest at the end
        [PY, "-c", runner_script("slow_real", fake_dvc=False), "--workers", "2", "--commit-every", "600"],
        cwd=repo,
        env={**env, "FAKE_FAST": "1000"},
        stdout=out.open("w"),
        stderr=err.open("w"),
        start_new_session=True,
    )
    # the evaluation wave (its cells, then the analysis: "[k/N]"), once its second cell has finished
    wave = lambda: out.read_text().partition("grid cells to run")[2]
    wait_while_running(proc, tmp_path, lambda: "[2/" in wave())
    params = yaml.safe_load((repo / "params.yaml").read_text())
    old_lr = params["grammar"]["ppo"]["lr"]
    params["grammar"]["ppo"]["lr"] = old_lr * 1.5
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert proc.wait(timeout=900) == 1, out.read_text() + err.read_text()

    last = err.read_text().splitlines()[-1]
    assert "changed while the runner ran" in last and "left stale" in last, last
    assert "not recorded: grammar_" in out.read_text()
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    runs = visible_runs(repo)
    grammar = cell_stages()
    for stage in grammar:  # every recorded cell carries the lr its finished MLflow run (its computation) used
        ran = [float(r.data.params["lr"]) for r in runs[stage] if r.info.status == "FINISHED"]
        if stage in lock:
            recorded = lock[stage]["params"]["params.yaml"]["grammar.ppo"]["lr"]
            assert ran == [recorded], (stage, ran, recorded)
    stale = set(status(repo)) & grammar  # not recorded: they rerun with the new lr on the next start
    assert stale and not stale & set(lock), (stale, set(lock))
