"""The repository as the runner finds it: one runner at a time (its lock), and the repairs of what a killed run
left behind."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from pipelines import tracking
from pipelines.leftovers import clean_temp
from pipelines.runner import lockfile, mlflow_runs
from pipelines.runner.dvccli import STATE
from pipelines.runner.signals import RunnerError


@contextmanager
def runner_lock(state: Path = STATE):
    """One runner per repository: an exclusive flock on .dvc/tmp/runner/lock, which the kernel releases when the
    runner exits, however it exits. The file holds the holder's pid, for the refusal message."""
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            raise RunnerError(
                f"another runner (pid {pid}) is working in this repository; wait for it, or stop it with `kill {pid}`",
                2,
            ) from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def prepare(experiment: str) -> None:
    """Repairs what a killed run left behind. Only under the runner lock: no other runner is working here; and
    only if no DVC command is (a plain `dvc repro` beside the runner is refused, as the runner is beside it)."""
    dvc_pid = lockfile.dvc_busy()
    if dvc_pid is not None:
        raise RunnerError(
            f"a DVC command (pid {dvc_pid}) is working in this repository (it holds {lockfile.DVC_LOCK}); wait for it "
            "to end, then run again",
            2,
        )
    try:
        notes = [lockfile.repair(), lockfile.repair_rwlock()]
    except lockfile.BrokenLockError as e:
        raise RunnerError(str(e), 2) from None
    for note in filter(None, notes):
        print(note, flush=True)
    tracking_problem = tracking.store_problem()
    if tracking_problem:
        raise RunnerError(tracking_problem, 2)
    removed = clean_temp()
    if removed:
        print(f"removed {len(removed)} temporary files left by killed stages, e.g. {removed[0]}", flush=True)
    stale = mlflow_runs.fail_runs(experiment, "its process was gone when the grid runner started")
    if stale:
        print(f"marked {len(stale)} MLflow runs left RUNNING by a killed run FAILED: {', '.join(stale)}", flush=True)
