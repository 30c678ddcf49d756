"""What runs in a worker process, local (pipelines.runner.local) or Ray (pipelines.runner.ray): one cell or one
upstream stage, with the params.yaml text it ran with."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from tqdm import tqdm

from ablations.config import PARAMS_FILE, load_params
from ablations.grid import Cell, find_cell
from pipelines.runner import mlflow_runs
from pipelines.runner.plan import Upstream
from pipelines.runner.signals import EXIT

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _exit_on_term(signum, frame) -> None:
    os._exit(EXIT[signal.SIGTERM])


def init_worker(parent: int, gpus=None) -> None:
    """Pool worker setup. Ctrl-C is the runner's to handle (a terminal sends it to every process of the foreground
    group), so workers ignore it. SIGTERM ends an idle worker at once; during a cell, tracking.stage_run turns it
    into KeyboardInterrupt first, which marks the cell's MLflow run FAILED. And the kernel kills the worker when the
    runner dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG; SIGKILL because an idle worker's main thread, blocked
    in the task queue's semaphore, may never run a Python handler): the next runner start marks its MLflow run
    FAILED and removes its temporary files.

    ``gpus``: on GPUs, a queue holding one CUDA_VISIBLE_DEVICES entry per worker slot (LocalPool); the worker takes
    one, so each GPU gets exactly the workers placed on it (a pool never replaces a worker: a dead one breaks it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by LocalPool.submit until now
    signal.signal(signal.SIGTERM, _exit_on_term)
    # tqdm's default lock is a multiprocessing semaphore, which a stopped worker never unlinks (then Python's
    # resource tracker warns at exit); one process needs only a thread lock.
    tqdm.set_lock(threading.RLock())
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the runner died before prctl took effect
        os._exit(EXIT[signal.SIGTERM])
    if gpus is not None:  # this worker's GPU for its whole life, before anything can start CUDA in it
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus.get()


RAN_WITH = "ran_with"  # a worker's summary key: the params.yaml text the cell ran with (None: it changed meanwhile)


def _params_text() -> str | None:
    try:
        return PARAMS_FILE.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def cell_in_worker(root: str, cell: Cell, run_cell) -> dict:
    """One cell in a worker process (local or Ray): torch threads are set per process by run_cell. The cell is
    taken from params.yaml as it is now (its arm's KL spec may have changed since the runner started), and the
    summary carries the params.yaml text it ran with (``RAN_WITH``; None if the file changed while it ran), which
    the recording compares with what DVC records (pipelines/runner/lockfile.py ``commit``)."""
    os.chdir(root)  # Ray workers need the repository on a shared filesystem at the same path
    try:
        before = _params_text()
        params = load_params()
        if isinstance(cell, Cell):
            cell = find_cell(params, cell.stage)
        summary = run_cell(params, cell)
    except KeyError as e:  # the cell was removed from params.yaml after the runner started
        raise RuntimeError(e.args[0]) from None
    except KeyboardInterrupt:  # SIGTERM during the cell: its MLflow run is marked FAILED by now
        os._exit(EXIT[signal.SIGTERM])
    return {**summary, RAN_WITH: before if _params_text() == before else None}


def ppo_cell(params, cell: Cell) -> dict:
    from pipelines.ppo import run_cell

    mlflow_runs.ready(params.mlflow.experiment)
    return run_cell(params, cell)


def upstream_stage(params, up: Upstream) -> dict:
    """Runs upstream stage ``up.stage`` in this worker exactly as its dvc.yaml command does: `python -m
    pipelines.<kind> <task> <instance>` is ``pipelines.<kind>.main([task, instance])`` (tests/pipelines/test_run.py
    checks dvc.yaml's commands). In the worker, not a subprocess, so that a stopped worker stops the stage with it
    and tracking.stage_run marks its MLflow run FAILED, as for a cell. The stage writes its outputs atomically."""
    import importlib

    group, instance = up.stage.split("@")
    task, kind = group.rsplit("_", 1)
    task = task.removesuffix("_calibration").removesuffix("_plan")  # grammar_calibration_sft@0: grammar's sft stage
    mlflow_runs.ready(params.mlflow.experiment)
    start = time.perf_counter()
    try:
        importlib.import_module(f"pipelines.{kind}").main([task, instance])
    except SystemExit as e:  # a stage's one-line refusal
        raise RuntimeError(str(e)) from None
    return {"wall_s": time.perf_counter() - start}
