"""SIGKILL of the runner's process group during the final analysis (issue 20, item 4), for real on the tiny grid of
test_e2e: the runner's workers (the analysis runs in one) die with it, and the next start removes the analysis's
temporary directory and marks its MLflow run FAILED. Slow (a few minutes): run with `make test-all`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.pipelines.procs import status, wait_for
from tests.pipelines.tiny import sh, stage_env, visible_runs

pytestmark = pytest.mark.slow
PY = sys.executable
WORDS = (b"pipelines.analysis", b"pipelines.runner.lockfile\0dvc", b"multiprocessing")


def survivors(root: Path) -> list[int]:
    """Processes working in ``root`` that run the analysis, the runner's DVC or its workers (the analysis runs in
    one)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes()
            here = os.readlink(p / "cwd") == str(root)
        except (OSError, ValueError):
            continue
        if here and any(w in cmd for w in WORDS):
            pids.append(int(p.name))
    return pids


def temp_dirs(root: Path) -> list[Path]:
    return list((root / "reports").glob(".*-tmp-*")) if (root / "reports").exists() else []


def kill_during_analysis(root: Path, tmp: Path) -> None:
    """Runs the runner until the analysis has its temporary directory, then SIGKILLs the runner's group."""
    out = tmp / "out.txt"
    proc = subprocess.Popen(
        [PY, "-m", "pipelines.run", "--workers", "2"],
        cwd=root,
        env=stage_env(root),
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: temp_dirs(root) or proc.poll() is not None, timeout=600)
        assert proc.poll() is None, out.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def touch_protocol(root: Path) -> None:
    """Makes only the analysis stages stale (no cell depends on the analysis section)."""
    p = yaml.safe_load((root / "params.yaml").read_text())
    p["analysis"]["alpha"] = round(p["analysis"]["alpha"] + 0.001, 3)
    (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))


def test_sigkill_during_the_analysis_leaves_no_process_and_the_rerun_cleans_up(repo, tmp_path):
    sh(repo, PY, "-m", "pipelines.run", "--workers", "2", "--no-analysis")  # the cells, recorded
    touch_protocol(repo)
    kill_during_analysis(repo, tmp_path)
    wait_for(lambda: not survivors(repo), timeout=10)  # DVC and the analysis died with the runner
    left = temp_dirs(repo)
    running = [s for s, v in visible_runs(repo).items() for r in v if r.info.status == "RUNNING"]
    assert left and running, (left, running)  # what the kill leaves, for the next start

    out = sh(repo, PY, "-m", "pipelines.run", "--workers", "2").stdout
    assert "temporary files left by killed stages" in out and "left RUNNING by a killed run FAILED" in out, out
    assert not temp_dirs(repo) and not survivors(repo)
    assert all(r.info.status != "RUNNING" for v in visible_runs(repo).values() for r in v)
    assert status(repo) == {}
    assert isinstance(json.loads((repo / ".dvc/tmp/rwlock").read_text() or "null"), dict)
