"""Faults named in one line with the way out, and the runner beside other writers (issue 20, item 4): DVC's rwlock
cut by a killed DVC, `dvc repro` and the runner at once, a corrupt MLflow store, a full disk, one MLflow store
shared by two repositories."""

from __future__ import annotations

import fcntl
import os
import sqlite3

import pytest
import yaml

from pipelines import tracking
from pipelines.runner import cli, lockfile, record
from pipelines.runner.repo import runner_lock
from pipelines.runner.signals import RunnerError
from tests.pipelines.tiny import TINY

from ..conftest import repo_params


@pytest.fixture
def repo(tmp_path, monkeypatch):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(repo_params(TINY), sort_keys=False))
    (tmp_path / ".dvc" / "tmp").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("text", ["", '{"read": {}, "wri', "\x00\x00", "[1, 2]"])
def test_a_cut_rwlock_is_removed_at_start_with_one_line(repo, text):
    (repo / lockfile.RWLOCK).write_text(text)
    note = lockfile.repair_rwlock()
    assert note.startswith(".dvc/tmp/rwlock was cut or corrupt") and "\n" not in note
    assert not (repo / lockfile.RWLOCK).exists()  # DVC starts a new one


def test_a_whole_rwlock_is_left_alone(repo):
    (repo / lockfile.RWLOCK).write_text('{"read": {}, "write": {}}')
    assert lockfile.repair_rwlock() is None and (repo / lockfile.RWLOCK).exists()


def test_the_runner_refuses_to_start_beside_a_dvc_command(repo, capsys):
    with open(repo / lockfile.DVC_LOCK, "w") as f:  # as zc.lockfile does for `dvc repro`: flock, pid inside
        f.write(" 4242\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert cli.main(["--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        err == "error: a DVC command (pid 4242) is working in this repository (it holds .dvc/tmp/lock); wait "
        "for it to end, then run again\n"
    ), err


def test_a_stage_of_a_plain_dvc_repro_is_refused_beside_the_runner(repo, monkeypatch):
    monkeypatch.setattr(tracking, "ROOT", repo)
    monkeypatch.delenv(tracking.RUNNER_ENV, raising=False)
    tracking.refuse_beside_runner()  # no runner: nothing to refuse
    with runner_lock(repo / ".dvc/tmp/runner"):
        with pytest.raises(SystemExit, match=rf"^error: the grid runner \(pid {os.getpid()}\) is working in this"):
            tracking.refuse_beside_runner()
        monkeypatch.setenv(tracking.RUNNER_ENV, str(os.getpid()))  # the runner's own stages pass
        tracking.refuse_beside_runner()


def truncated_store(path):
    db = sqlite3.connect(path)
    db.execute("create table t (x text)")
    db.executemany("insert into t values (?)", [("x" * 1000,)] * 50)
    db.commit()
    db.close()
    with open(path, "r+b") as f:
        f.truncate(4096)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_mlflow_store_is_named_in_one_line_with_the_way_out(repo, monkeypatch, capsys, damage):
    store = repo / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    if damage == "garbage":
        store.write_bytes(os.urandom(8192))
    else:
        truncated_store(store)
    line = tracking.store_problem()
    assert line.startswith(f"the MLflow store {store} is corrupt") and "\n" not in line, line
    assert "results are safe in DVC" in line and "move mlflow.db aside and rerun" in line
    assert cli.main(["--workers", "1"]) == 2  # before any compute
    assert capsys.readouterr().err == f"error: {line}\n"


def test_a_full_disk_is_named_in_one_line():
    try:
        raise RuntimeError("MlflowException: (sqlite3.OperationalError) database or disk is full")
    except RuntimeError as e:
        assert tracking.fault_line(e).startswith("disk full")
    e = OSError(28, "No space left on device")
    assert tracking.fault_line(e).startswith("disk full (No space left on device); free space and rerun")
    assert tracking.fault_line(ValueError("other")) is None


def test_runs_of_another_repository_in_a_shared_store_are_never_touched(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'shared' / 'mlflow.db'}")  # outside ROOT
    (tmp_path / "shared").mkdir()
    monkeypatch.setattr(tracking, "ROOT", tmp_path / "repo_a")
    client = MlflowClient(tracking.tracking_uri())
    exp = client.create_experiment("e")
    tag = {tracking.STAGE_TAG: "s"}
    mine = client.create_run(exp, tags={**tag, tracking.REPO_TAG: str(tmp_path / "repo_a")}).info.run_id
    theirs = client.create_run(exp, tags={**tag, tracking.REPO_TAG: str(tmp_path / "repo_b")}).info.run_id
    untagged = client.create_run(exp, tags=tag).info.run_id  # in a shared store: nobody's to clean
    assert tracking.fail_running("e", "gone") == ["s"]
    status = {r: client.get_run(r).info.status for r in (mine, theirs, untagged)}
    assert status == {mine: "FAILED", theirs: "RUNNING", untagged: "RUNNING"}
    with tracking.stage_run("s", "e", {}):  # a rerun of stage s supersedes only this repository's earlier run
        pass
    assert tracking.SUPERSEDED_TAG not in client.get_run(theirs).data.tags
    assert client.get_run(mine).data.tags[tracking.SUPERSEDED_TAG] == "true"
    assert client.get_run(mine).info.lifecycle_stage == "active"  # kept


def test_a_cell_whose_params_changed_is_left_stale_with_one_line(repo, capsys):
    from ablations.config import load_params
    from ablations.grid import cells

    grid = cells(load_params())
    recorder = record.Recorder({}, every_s=0)
    recorder.add(grid[0], {"params": None, "files": {}})  # params.yaml changed while the cell read it
    assert recorder.waiting == [] and recorder.stale == [grid[0].stage]
    assert (
        capsys.readouterr().out
        == f"not recorded: {grid[0].stage}: params.yaml changed while it was read; it stays stale\n"
    )
    with pytest.raises(RunnerError, match=r"^params.yaml or a protocol file changed while the runner ran: 1 finished"):
        record.check_stale(recorder)
    log = f"{lockfile.REFUSED}{grid[1].stage}: grammar.ppo changed after it started\nsomething else\n"
    assert lockfile.refused(log) == [grid[1].stage]


def test_the_recorded_params_are_compared_with_the_text_the_cell_ran_with():
    class Dep(lockfile_params_dependency()):
        def __init__(self, values):
            self.hash_info = type("H", (), {"value": values})()

    stage = type("S", (), {"deps": [Dep({"grammar.ppo": {"lr": 0.003}, "grid.arms.a": {"x": 1}})]})()
    ran = "grammar:\n  ppo: {lr: 0.002}\ngrid:\n  arms:\n    a: {x: 1}\n"
    assert lockfile.changed_params(stage, ran) == "grammar.ppo"
    assert lockfile.changed_params(stage, ran.replace("0.002", "0.003")) is None
    assert lockfile.changed_params(stage, None) == "params.yaml"


def lockfile_params_dependency():
    from dvc.dependency.param import ParamsDependency

    return ParamsDependency
