"""Recording finished stages in dvc.lock (pipelines/runner/lockfile.py ``commit``, pipelines/runner/worker.py
``ran_with``) against what changed while they ran, on a one-stage DVC repository: a `dvc repro` holding DVC's lock,
a protocol file edited mid-run, a params.yaml comment, and the leftovers of stages dvc.yaml no longer defines."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from pipelines.runner import worker
from tests.conftest import REPO

DVC_YAML = {
    "stages": {
        "cell": {
            "cmd": "echo",
            "deps": ["protocol/t.json"],
            "params": ["a"],
            "outs": ["out.txt"],
        }
    }
}
PARAMS = "a: 1  # a value the stage declares\nb: 2\n"


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "DVC_NO_ANALYTICS": "1"}


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A git + DVC repository with one stage ``cell`` (params ``a``, input protocol/t.json, output out.txt) whose
    output exists, as after its run; cwd."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, env=env(), check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    (tmp_path / "params.yaml").write_text(PARAMS)
    (tmp_path / "protocol").mkdir()
    (tmp_path / "protocol/t.json").write_text('{"coef": 0.1}\n')
    (tmp_path / "out.txt").write_text("result\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def commit(repo: Path, ran_with: dict, *stages: str) -> subprocess.CompletedProcess:
    """`python -m pipelines.runner.lockfile commit --ran-with=FILE STAGE...`, as the runner's Recorder starts it."""
    path = repo / "ran-with.json"
    path.write_text(json.dumps({s: ran_with for s in stages}))
    cmd = [sys.executable, "-m", "pipelines.runner.lockfile", "commit", f"--ran-with={path}", *stages]
    return subprocess.run(cmd, cwd=repo, env=env(), capture_output=True, text=True, timeout=900)


def recorded(repo: Path) -> dict:
    lock = repo / "dvc.lock"
    return yaml.safe_load(lock.read_text())["stages"] if lock.exists() else {}


def as_read(repo: Path) -> dict:
    """What the stage read: params.yaml's text and the protocol file's md5, both as they are now."""
    files = {"protocol/t.json": md5(repo / "protocol/t.json")}
    return worker.ran_with((repo / "params.yaml").read_text(), files, files)


def test_a_stage_that_read_what_is_there_now_is_recorded(repo):
    out = commit(repo, as_read(repo), "cell")
    assert out.returncode == 0 and "not recorded" not in out.stdout, out
    assert recorded(repo)["cell"]["deps"][0]["md5"] == md5(repo / "protocol/t.json")


def test_a_protocol_edit_after_the_cell_read_it_is_not_recorded(repo):
    """Issue 30: the cell ran with coef 0.1; the protocol now says 0.2. Recording it would claim 0.2."""
    read = as_read(repo)  # unchanged while it ran
    (repo / "protocol/t.json").write_text('{"coef": 0.2}\n')  # then edited, before the recording
    out = commit(repo, read, "cell")
    assert out.returncode == 0 and "not recorded: cell: protocol/t.json changed after it started" in out.stdout, out
    assert "cell" not in recorded(repo)


def test_a_protocol_edit_while_the_cell_ran_is_caught_by_the_worker(repo):
    before = worker._md5s()
    (repo / "protocol/t.json").write_text('{"coef": 0.3}\n')
    read = worker.ran_with(PARAMS, before, worker._md5s())
    assert read == {"params": PARAMS, "files": {"protocol/t.json": None}}  # changed: unknown what the cell read
    out = commit(repo, read, "cell")
    assert "not recorded: cell: protocol/t.json changed after it started" in out.stdout, out


def test_a_params_comment_or_an_undeclared_value_leaves_the_stage_recorded(repo):
    """Issue 30: any edit of params.yaml (a comment) left every running stage unrecorded; now only a change of a
    value the stage declares does."""
    read = as_read(repo)
    (repo / "params.yaml").write_text("# a comment\n" + PARAMS.replace("b: 2", "b: 3"))
    out = commit(repo, read, "cell")
    assert out.returncode == 0 and "not recorded" not in out.stdout, out
    assert "cell" in recorded(repo)
    (repo / "params.yaml").write_text(PARAMS.replace("a: 1", "a: 5"))
    out = commit(repo, read, "cell")
    assert "not recorded: cell: a changed after it started" in out.stdout, out


def test_the_worker_reports_the_params_text_it_read_even_if_the_file_changed_later(repo):
    """A comment added to params.yaml while a cell runs: before, the worker reported None (left stale)."""

    def cell(params, c):
        (repo / "params.yaml").write_text(PARAMS + "# edited while the cell ran\n")
        return {"wall_s": 0.0}

    (repo / "params.yaml").write_text((REPO / "params.yaml").read_text())
    text = (repo / "params.yaml").read_text()
    summary = worker.cell_in_worker(str(repo), object(), cell)
    assert summary[worker.RAN_WITH]["params"] == text


def test_the_recording_waits_for_a_dvc_command_that_holds_the_lock(repo):
    """Issue 30: a `dvc repro` beside the runner holds DVC's repository lock; the runner's recording then failed
    with LockError (3 s of retries) and the runner stopped its unfinished cells. Now it waits its turn."""
    import zc.lockfile

    held = zc.lockfile.LockFile(str(repo / ".dvc/tmp/lock"))
    release = threading.Timer(8.0, held.close)  # longer than DVC's own 3 s of retries
    release.start()
    try:
        start = time.monotonic()
        out = commit(repo, as_read(repo), "cell")
    finally:
        release.cancel()
        held.close()
    assert out.returncode == 0, out
    assert time.monotonic() - start >= 7.0 and "cell" in recorded(repo)


def test_recording_removes_the_entries_of_stages_dvc_yaml_no_longer_defines(repo):
    """Issue 30: dvc.lock held 826 entries for 625 stages (leftovers of earlier designs and profiles)."""
    assert commit(repo, as_read(repo), "cell").returncode == 0
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    lock["stages"]["grammar_fixed@100-reward_k1-0.1-0"] = lock["stages"]["cell"]  # a stage of an earlier design
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    out = commit(repo, as_read(repo), "cell")
    assert "removed 1 entries of stages dvc.yaml no longer defines" in out.stdout, out
    assert set(recorded(repo)) == {"cell"}


def test_the_runners_dvc_calls_wait_for_a_dvc_command_that_holds_the_lock(repo):
    """The runner's `dvc status` between its waves and its `dvc repro` of the calibrate and analysis stages."""
    import zc.lockfile

    from pipelines.runner import dvccli
    from pipelines.runner.signals import Signals

    held = zc.lockfile.LockFile(str(repo / ".dvc/tmp/lock"))
    release = threading.Timer(8.0, held.close)
    release.start()
    try:
        start = time.monotonic()
        status = dvccli.dvc(["status", "--json"], env(), Signals(), capture=True)
    finally:
        release.cancel()
        held.close()
    assert time.monotonic() - start >= 7.0 and "cell" in json.loads(status)
