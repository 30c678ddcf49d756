"""What runs in a worker process, local (pipelines.runner.local) or Ray (pipelines.runner.ray): one cell, one
upstream stage or one stage after a wave (calibrate, analysis: local workers only), with what it ran with (the
params.yaml text and the protocol files it read)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import runpy
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import yaml
from tqdm import tqdm

from ablations.config import PARAMS_FILE, load_params
from ablations.grid import PROTOCOL_DIR, Cell, find_cell
from pipelines.runner import mlflow_runs
from pipelines.runner.plan import Tail, Upstream
from pipelines.runner.signals import EXIT

PR_SET_PDEATHSIG = 1  # linux/prctl.h
DVC_YAML = Path("dvc.yaml")


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


RAN_WITH = "ran_with"  # a worker's summary key: what the cell ran with (``ran_with``), which dvc.lock must record
INPUT_FILES = f"{PROTOCOL_DIR.as_posix()}/*.json"  # what a cell reads beside params.yaml and may change mid-run


def _params_text() -> str | None:
    try:
        return PARAMS_FILE.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _md5s() -> dict[str, str]:
    """{path: md5} of INPUT_FILES as they are now (DVC's md5 of a file dependency is that of its bytes)."""
    return {p.as_posix(): hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(Path().glob(INPUT_FILES))}


def ran_with(params_text: str | None, before: dict[str, str], after: dict[str, str]) -> dict:
    """What a stage ran with, for the recording (pipelines/runner/lockfile.py ``commit``): {"params": the params.yaml
    text it read (None when the file changed while it was read), "files": {path: md5 of each INPUT_FILES file as
    the stage read it, None when it changed while the stage ran}}. The recording refuses a stage whose declared
    params values or file dependencies differ from these, and only those: a comment added to params.yaml, or an
    edit of a value or a file the stage does not depend on, leaves it recorded."""
    files = {p: (md5 if after.get(p) == md5 else None) for p, md5 in before.items()}
    return {"params": params_text, "files": files}


def cell_in_worker(root: str, cell: Cell, run_cell) -> dict:
    """One cell in a worker process (local or Ray): torch threads are set per process by run_cell. The cell is
    taken from params.yaml as it is now (its arm's KL spec may have changed since the runner started), and the
    summary carries what it ran with (``RAN_WITH``, ``ran_with``), which the recording compares with what DVC
    records (pipelines/runner/lockfile.py ``commit``)."""
    os.chdir(root)  # Ray workers need the repository on a shared filesystem at the same path
    try:
        before, files = _params_text(), _md5s()
        params = load_params()
        if _params_text() != before:  # changed while it was read: which values the cell took is unknown
            before = None
        if isinstance(cell, Cell):
            cell = find_cell(params, cell.stage)
        summary = run_cell(params, cell)
    except KeyError as e:  # the cell was removed from params.yaml after the runner started
        raise RuntimeError(e.args[0]) from None
    except KeyboardInterrupt:  # SIGTERM during the cell: its MLflow run is marked FAILED by now
        os._exit(EXIT[signal.SIGTERM])
    return {**summary, RAN_WITH: ran_with(before, files, _md5s())}


def ppo_cell(params, cell: Cell) -> dict:
    from pipelines.ppo import run_cell

    mlflow_runs.ready(params.mlflow.experiment)
    return run_cell(params, cell)


def upstream_mains() -> dict:
    """{stage kind: its script's main}, for the upstream stages (dvc.yaml: `python -m pipelines.<kind>`). Imported
    here, in the worker, not by the runner: they load torch."""
    from pipelines import data, eval0, rm, sft

    return {"data": data.main, "sft": sft.main, "rm": rm.main, "eval0": eval0.main}


def upstream_stage(params, up: Upstream) -> dict:
    """Runs upstream stage ``up.stage`` in this worker exactly as its dvc.yaml command does: `python -m
    pipelines.<kind> <task> <instance>` is ``pipelines.<kind>.main([task, instance])`` (tests/pipelines/test_run.py
    checks dvc.yaml's commands). In the worker, not a subprocess, so that a stopped worker stops the stage with it
    and tracking.stage_run marks its MLflow run FAILED, as for a cell. The stage writes its outputs atomically."""
    group, instance = up.stage.split("@")
    task, kind = group.rsplit("_", 1)
    task = task.removesuffix("_calibration")  # grammar_calibration_sft@0: the grammar task's sft stage
    mlflow_runs.ready(params.mlflow.experiment)
    start = time.perf_counter()
    try:
        upstream_mains()[kind]([task, instance])
    except SystemExit as e:  # a stage's one-line refusal
        raise RuntimeError(str(e)) from None
    return {"wall_s": time.perf_counter() - start}


def _declared(stage: str) -> tuple[list[str], list[Path]]:
    """(argv, outputs) of dvc.yaml's plain stage ``stage``: its ``cmd`` (``python -m MODULE ARGS...``) and every path
    it declares as an out, metric or plot."""
    spec = yaml.safe_load(DVC_YAML.read_text(encoding="utf-8"))["stages"][stage]
    argv = shlex.split(spec["cmd"])
    if argv[:2] != ["python", "-m"]:
        raise RuntimeError(f"{stage}: its dvc.yaml command is not `python -m MODULE ...` ({spec['cmd']!r})")
    entries = [e for key in ("outs", "metrics", "plots") for e in spec.get(key, [])]
    return argv[2:], [Path(next(iter(e)) if isinstance(e, dict) else e) for e in entries]


def tail_stage(params, tail: Tail) -> dict:
    """Runs ``<task>_calibrate`` or ``<task>_analysis`` in this worker as `dvc repro` runs it: its declared outputs
    removed first (DVC's ``Stage.remove_outs``: no file of an earlier run outlives this one), then its dvc.yaml
    command, ``python -m MODULE ARGS`` as ``runpy`` runs it (its ``__main__`` block included: a refusal is its one
    line). The stage writes its outputs atomically; the runner records it in dvc.lock like a cell."""
    argv, outs = _declared(tail.stage)
    for path in outs:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    mlflow_runs.ready(params.mlflow.experiment)
    start, saved = time.perf_counter(), sys.argv
    sys.argv = list(argv)  # runpy sets argv[0] to the module's file, as `python -m` does
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(str(e.code)) from None
    finally:
        sys.argv = saved
    return {"wall_s": time.perf_counter() - start}
