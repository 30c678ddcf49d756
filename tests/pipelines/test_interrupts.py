"""The grid runner interrupted for real (issue 9): real DVC, real cells, on the tiny grid of test_e2e in a temporary
repository. The first two cells are real PPO runs; the others hold a RUNNING MLflow run for a minute
(tests/pipelines/fakes.py ``slow_real``), so that signals land while cells run.

Slow (minutes): run with `make test-all`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ablations.config import load_params
from ablations.grid import calibration_cells, cells, evaluation_cells, upstream_stages
from pipelines.runner import lockfile
from tests.pipelines.fakes import runner_script
from tests.pipelines.procs import alive, children, status, wait_for, wait_while_running, worker_pids
from tests.pipelines.tiny import sh, stage_env, visible_runs

pytestmark = pytest.mark.slow
PY = sys.executable


def start(root: Path, tmp: Path, fast: int) -> subprocess.Popen:
    """The runner (first ``fast`` cells real, the others slow) in its own process group, recording after every
    cell, its output in tmp/out.txt and tmp/err.txt."""
    (tmp / "fake").mkdir(exist_ok=True)
    env = {**stage_env(root), "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "FAKE_DIR": str(tmp / "fake")}
    return subprocess.Popen(
        [PY, "-c", runner_script("slow_real", fake_dvc=False), "--workers", "2", "--commit-every", "0"],
        cwd=root,
        env={**env, "FAKE_FAST": str(fast)},
        stdout=(tmp / "out.txt").open("w"),
        stderr=(tmp / "err.txt").open("w"),
        start_new_session=True,
    )


def grid_stages(root: Path) -> set[str]:
    return {c.stage for c in cells(load_params(root / "params.yaml"))}


def wave_sizes(root: Path) -> tuple[int, int]:
    """The number of calibration cells and of evaluation cells."""
    params = load_params(root / "params.yaml")
    return len(calibration_cells(params)), len(evaluation_cells(params))


def recorded(root: Path) -> set[str]:
    """The grid cells in dvc.lock (asserting that DVC can read it)."""
    assert lockfile.problem(root / "dvc.lock") is None
    return set(yaml.safe_load((root / "dvc.lock").read_text())["stages"]) & grid_stages(root)


def locked(root: Path) -> set[str]:
    """Every stage in dvc.lock (asserting that DVC can read it)."""
    assert lockfile.problem(root / "dvc.lock") is None
    return set(yaml.safe_load((root / "dvc.lock").read_text())["stages"])


def forget_cells(root: Path) -> None:
    """Every grid cell stale and unrecorded, as before its first run (data, SFT and RM stay)."""
    if not (root / "dvc.lock").exists():
        sh(root, PY, "-m", "dvc", "repro", *upstream_stages(load_params(root / "params.yaml")))
    shutil.rmtree(root / "runs", ignore_errors=True)
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    lock["stages"] = {k: v for k, v in lock["stages"].items() if k not in grid_stages(root)}
    (root / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))


def runs_tables(root: Path) -> dict[str, bytes]:
    """Every runs.csv of the analysis (one per task, or one), by path."""
    tables = {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "reports").rglob("runs.csv"))}
    assert tables
    return tables


def test_double_ctrl_c_during_a_commit_then_sigterm_then_a_rerun(repo, tmp_path):
    proc = start(repo, tmp_path, fast=2)  # data, SFT and RM first (real, in the pool), then the calibration wave
    # As soon as the first finished upstream stage is being recorded: Ctrl-C twice.
    wait_while_running(proc, tmp_path, lambda: children(proc.pid, b"pipelines.runner.lockfile\0commit"))
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the runner and its workers, not the commit
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    err = (tmp_path / "err.txt").read_text()  # the stages' own logs, then the runner's one line
    assert err.splitlines()[-1].startswith("stopped by SIGINT") and "Traceback" not in err, err
    first = locked(repo)  # DVC can read dvc.lock, and it holds every stage that finished, up to date
    assert first and first == {s for s in first if s not in status(repo)}
    assert not [p for p in worker_pids(tmp_path) if alive(p)]
    runs = visible_runs(repo)
    assert all(r.info.status != "RUNNING" for v in runs.values() for r in v)

    # SIGTERM (`kill`, `timeout`) with both workers inside slow cells: one line, no orphans, RUNNING -> FAILED.
    shutil.rmtree(tmp_path / "fake")
    proc = start(repo, tmp_path, fast=2)
    wait_while_running(proc, tmp_path, lambda: len(recorded(repo)) >= 2 and len(worker_pids(tmp_path)) == 2)
    time.sleep(3)  # the slow cells have opened their MLflow runs
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    err = (tmp_path / "err.txt").read_text()
    assert err.splitlines()[-1].startswith("stopped by SIGTERM") and "Traceback" not in err, err
    assert not [p for p in worker_pids(tmp_path) if alive(p)]
    runs = {s: [r.info.status for r in v] for s, v in visible_runs(repo).items()}
    stopped = {s: v for s, v in runs.items() if s in grid_stages(repo) - recorded(repo)}
    assert stopped and all(v == ["FAILED"] for v in stopped.values()), runs

    # The rerun does only what is left, and the pipeline ends clean. The first two cells (the only real ones) are
    # calibration cells, so the signals landed in the calibration wave: no evaluation cell had started.
    n_cal, n_eval = wave_sizes(repo)
    left = n_cal - len(recorded(repo))
    assert not {s for s in recorded(repo) if not s.startswith("grammar_calibration")}
    out = sh(repo, PY, "-m", "pipelines.run", "--workers", "2").stdout
    assert f"{left} of {n_cal} calibration cells to run" in out, out
    assert f"{n_eval} of {n_eval} grid cells to run" in out, out
    assert status(repo) == {}


def test_sigkill_keeps_recorded_cells_and_the_resumed_results_are_bit_identical(repo, tmp_path):
    forget_cells(repo)
    proc = start(repo, tmp_path, fast=3)
    wait_while_running(proc, tmp_path, lambda: len(recorded(repo)) == 3 and len(worker_pids(tmp_path)) == 2)
    kept = recorded(repo)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not [p for p in worker_pids(tmp_path) if alive(p)], timeout=30)  # workers die with it
    (repo / "dvc.lock").write_text("")  # and a DVC killed while rewriting it in place (issue 9: 4 of 4 times)
    assert sh(repo, PY, "-m", "dvc", "status", check=False).returncode != 0  # plain DVC cannot go on

    out = sh(repo, PY, "-m", "pipelines.run", "--workers", "2").stdout
    assert "restored the last good copy" in out
    n_cal, n_eval = wave_sizes(repo)
    assert f"{n_cal - 3} of {n_cal} calibration cells to run" in out, out  # the recorded cells were kept
    assert f"{n_eval} of {n_eval} grid cells to run" in out, out
    assert status(repo) == {} and recorded(repo) >= kept
    resumed = runs_tables(repo)

    shutil.rmtree(repo / "runs")
    sh(repo, PY, "-m", "pipelines.run", "--workers", "2")
    assert runs_tables(repo) == resumed  # bit-identical
