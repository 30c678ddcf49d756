"""Run everything with every core: `dvc repro`, with the stale grid cells run concurrently.

    python -m pipelines.run                      # local process pool: one worker per core (per GPU with CUDA)
    python -m pipelines.run --workers 1          # one cell at a time (CPU)
    python -m pipelines.run --gpus 0,1 --workers-per-gpu 2   # 4 workers, 2 on each of GPUs 0 and 1
    python -m pipelines.run --ray-address auto   # cells as Ray tasks (pip install -e '.[ray]'), shared filesystem
    python -m pipelines.run --gpus 0 --population 256   # up to 256 cells of one structure per worker, batched
                                                        # (pipelines/population.py; the CPU default stays 1 cell)

Placement. Without CUDA (torch sees no device; `CUDA_VISIBLE_DEVICES=` hides them) workers are CPU processes, one
per core or --workers. With CUDA each worker owns one GPU for its life: its CUDA_VISIBLE_DEVICES is set to that
GPU's entry before CUDA starts in it, so its cells run on `cuda` (= that GPU). Default: one worker per visible
GPU; --gpus picks GPUs (entries of the runner's CUDA_VISIBLE_DEVICES if set, else device indices);
--workers-per-gpu N puts N workers (N cells at once) on each; --workers N instead spreads N workers evenly. On
Ray every cell asks for RLHF_THREADS CPUs and, when the cluster has GPUs, 1/N of a GPU (N = --workers-per-gpu,
default 1); Ray sets CUDA_VISIBLE_DEVICES. One cell is one DVC stage either way. Flags that contradict the
machine or each other are refused in one line before anything runs.

Steps: 1. validate params.yaml and check that the `python` of dvc.yaml's commands, resolved as DVC will resolve it,
is this interpreter (nothing runs if either is wrong); 2. take the repository's runner lock (one runner at a time),
restore dvc.lock from its last good copy if a killed DVC left it broken, remove the temporary files of killed
stages, mark MLflow runs left RUNNING by a killed run FAILED; 3. ask `dvc status` which upstream stages (data ->
sft -> rm, one chain per task instance) are stale and build the chains in parallel on the same workers: a chain
whose first stale stage is k runs stages k..end in order (each by its dvc.yaml command's module function in the
worker, as a cell), finished stages recorded in dvc.lock as in step 4, all of them before any cell starts; a
failed stage stops the run; 4. ask `dvc status` which calibration cells are stale and run them as in step 5, then
`dvc repro <task>_calibrate` (the protocol is fixed before any evaluation cell runs); 5. ask `dvc status` which
evaluation cells are stale and run them in parallel, each with
torch threads set to RLHF_THREADS (default 1), printing one line per finished cell, and record finished cells in
dvc.lock while the others run (a batch at most every --commit-every seconds), exactly as `dvc repro` would have;
6. `dvc repro` for the rest (the analysis).

Stopping: Ctrl-C or SIGTERM (what `timeout`, `kill` and job schedulers send) stops the workers at once (their
MLflow runs are marked FAILED), records the cells (or upstream stages) that finished, and exits with one line
(status 130 or 143).
A recording in progress always completes: it runs in its own process session, so a terminal's Ctrl-C does not
reach it, and the runner waits for it; pressing Ctrl-C again changes nothing. Workers, and DVC with the stage it
runs (the analysis), die with the runner even when it is killed with SIGKILL; the cells recorded by then are kept,
the next run redoes the others (and marks the MLflow runs the killed processes left RUNNING as FAILED).
Each cell is recorded only with the params.yaml values it ran with (lockfile.commit compares them): a cell whose
parameters changed while it ran, or before it was recorded, is left stale and named, and the run fails at the end.
DVC writes dvc.lock through pipelines.lockfile, which only ever replaces it whole.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path

from tqdm import tqdm

from ablations.config import PARAMS_FILE, ParamsError, load_params
from ablations.grid import Cell, calibrate_stages, calibration_cells, evaluation_cells, find_cell, upstream_chains
from pipelines import lockfile, tracking
from pipelines.leftovers import clean_temp

STATE = Path(".dvc/tmp/runner")  # the runner's lock file and dvc.lock's last good copy (.dvc/tmp is git-ignored)
DVC = [sys.executable, "-m", "pipelines.lockfile", "dvc"]  # DVC's CLI, dvc.lock replaced whole
COMMIT = [sys.executable, "-m", "pipelines.lockfile", "commit"]  # `dvc commit --force STAGE...`, one pass
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
GRACE_S = 10.0  # a stopped worker's time to mark its MLflow run FAILED before it is killed
POLL_S = 0.2
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class RunnerError(Exception):
    """A failure worded for the user: one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class Interrupted(RunnerError):
    def __init__(self, signum: int, message: str):
        super().__init__(f"{signal.Signals(signum).name}: {message}", EXIT[signum])


class Signals:
    """SIGINT and SIGTERM only set a flag: the runner stops where it chooses, never inside a commit."""

    def __init__(self):
        self.signum: int | None = None
        self.count = 0

    def _handle(self, signum, frame) -> None:
        self.count += 1
        self.signum = self.signum or signum

    def __enter__(self) -> Signals:
        self._old = {s: signal.signal(s, self._handle) for s in EXIT}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def check(self, message: str) -> None:
        if self.signum:
            raise Interrupted(self.signum, message)


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


def stage_env() -> dict[str, str]:
    """The environment of every DVC call: this interpreter's directory first on PATH, so that the `python` of
    dvc.yaml's commands is this one even when the environment is not activated; and this runner's pid, so that
    DVC and its stage commands die with the runner and pass tracking.refuse_beside_runner."""
    path = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), os.getenv("PATH")]))
    return {**os.environ, "PATH": path, tracking.RUNNER_ENV: str(os.getpid())}


PROBE = "python -c 'import sys; print(sys.prefix); print(sys.executable)'"


def check_interpreter(env: dict[str, str]) -> None:
    """Fails (one line) unless `python`, resolved as DVC resolves it for a stage command (the user's $SHELL with
    DVC's flags and environment fix-ups: dvc/stage/run.py ``_make_cmd``, dvc/utils ``fix_env``), runs in this
    interpreter's environment. Otherwise the stages after the grid would die with a missing package."""
    from dvc.stage.run import _make_cmd
    from dvc.utils import fix_env

    try:
        cmd = _make_cmd(env.get("SHELL") or "/bin/sh", PROBE)
        out = subprocess.run(cmd, env=fix_env(env), capture_output=True, text=True, timeout=120)
        prefix, executable = out.stdout.splitlines()[:2] if out.returncode == 0 else ("", "")
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        prefix, executable, out = "", "", e
    if not prefix or os.path.realpath(prefix) != os.path.realpath(sys.prefix):
        what = f"{executable} (environment {prefix})" if prefix else f"nothing that works ({_last_line(out)})"
        raise RunnerError(
            f"DVC's stage commands would run `python` = {what}, not this interpreter, {sys.executable} "
            f"(environment {sys.prefix}); run `make repro`, or activate the environment (`. .venv/bin/activate`)",
            2,
        )


def _last_line(x) -> str:
    """The last non-empty line of a process's output or an exception's message (with its type)."""
    text = getattr(x, "stderr", None) or str(x)
    lines = [s.strip() for s in str(text).strip().splitlines() if s.strip()]
    last = lines[-1] if lines else "no message"
    return f"{type(x).__name__}: {last}" if isinstance(x, BaseException) else last


def dvc(args: list[str], env: dict[str, str], sig: Signals, capture: bool = False) -> str:
    """Runs `dvc ARGS` in its own process session and forwards Ctrl-C and SIGTERM to it (to DVC and its stage
    command). Returns its stdout if ``capture`` (else it goes to the terminal); a failure raises RunnerError."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([*DVC, *args], env=env, stdout=out if capture else None, start_new_session=True)
        forwarded = 0
        while proc.poll() is None:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(POLL_S)
            if sig.count > forwarded:
                forwarded = sig.count
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig.signum)
        out.seek(0)
        text = out.read()
    sig.check(f"stopped during `dvc {' '.join(args)}`")
    if proc.returncode:
        raise RunnerError(f"`dvc {' '.join(args)}` failed (exit {proc.returncode}); DVC's message is above")
    return text


def stale_cells(grid: list[Cell], env: dict[str, str], sig: Signals) -> list[Cell]:
    """Grid cells whose DVC stage is changed or has never run (per `dvc status --json`; asking for the whole
    pipeline at once is ~10x faster than naming 100 stages, which DVC collects one by one)."""
    status = json.loads(dvc(["status", "--json"], env, sig, capture=True) or "{}")
    return [c for c in grid if c.stage in status]


@dataclass(frozen=True)
class Upstream:
    """One stale upstream stage (``stage``, e.g. grammar_sft@0) and the stages after it in its chain."""

    stage: str
    rest: tuple[str, ...] = ()

    @property
    def next(self) -> Upstream | None:
        return Upstream(self.rest[0], self.rest[1:]) if self.rest else None


def stale_chains(chains: list[list[str]], env: dict[str, str], sig: Signals) -> list[Upstream]:
    """The first stale stage of each chain (per one `dvc status --json`), with the rest of its chain after it:
    once a stage reruns, every stage after it must too (they depend on its outputs)."""
    status = json.loads(dvc(["status", "--json"], env, sig, capture=True) or "{}")
    firsts = [next((k for k, s in enumerate(c) if s in status), None) for c in chains]
    return [Upstream(c[k], tuple(c[k + 1 :])) for c, k in zip(chains, firsts) if k is not None]


class Recorder:
    """Records finished cells (or upstream stages: ``what``) in dvc.lock while the others run: one commit process
    at a time, a new batch when the last commit ended ``every_s`` ago. Each commit runs in its own process session,
    so a terminal's Ctrl-C does not reach it, and ``finish`` waits for it: a commit always completes."""

    def __init__(self, env: dict[str, str], every_s: float, what: str = "cells"):
        self.env, self.every_s, self.what = env, every_s, what
        self.log = STATE / "commit.log"
        self.waiting: list[Cell] = []
        self.batch: list[Cell] = []
        self.recorded: list[Cell] = []
        self.stale: list[str] = []  # finished, but params.yaml changed before they were recorded: left stale
        self.ran_with: dict[str, str] = {}
        self.proc: subprocess.Popen | None = None
        self.last = float("-inf")
        self.retried = False  # a commit killed by a signal is retried once

    def add(self, cell: Cell, ran_with: str | None) -> None:
        """Queues a finished cell for recording, unless params.yaml changed while it ran (``ran_with`` None)."""
        if ran_with is None:
            return self._left_stale(cell.stage)
        self.ran_with[cell.stage] = ran_with
        self.waiting.append(cell)

    def _left_stale(self, stage: str) -> None:
        self.stale.append(stage)
        print(f"not recorded: {stage}: params.yaml changed after it started; it stays stale", flush=True)

    def poll(self, flush: bool = False) -> None:
        """Collects a finished commit; starts the next batch when due (``flush``: as soon as possible)."""
        if self.proc is not None and self.proc.poll() is not None:
            self._collect()
        if self.proc is None and self.waiting and (flush or time.monotonic() - self.last >= self.every_s):
            self.batch, self.waiting = self.waiting, []
            self._start()

    def _start(self) -> None:
        ran_with = STATE / "commit-ran-with.json"  # what each cell of the batch ran with, for lockfile.commit
        ran_with.write_text(json.dumps({c.stage: self.ran_with.get(c.stage) for c in self.batch}))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [*COMMIT, f"--ran-with={ran_with}", *(c.stage for c in self.batch)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _collect(self) -> None:
        rc, self.proc, self.last = self.proc.returncode, None, time.monotonic()
        if rc < 0 and not self.retried:  # killed (e.g. by the OOM killer): dvc.lock is whole, record the batch again
            self.retried = True
            return self._start()
        if rc:
            why = f"killed by {signal.Signals(-rc).name}" if rc < 0 else _last_line(self.log.read_text())
            raise RunnerError(f"recording {len(self.batch)} finished {self.what} in dvc.lock failed: {why}")
        refused = lockfile.refused(self.log.read_text())
        for stage in refused:
            self._left_stale(stage)
        self.recorded += [c for c in self.batch if c.stage not in refused]
        n, total = len(self.batch) - len(refused), len(self.recorded)
        print(f"dvc.lock: recorded {n} more finished {self.what} ({total} so far)", flush=True)

    def finish(self) -> None:
        """Waits for the commit in progress, then records every cell still waiting."""
        while self.proc is not None or self.waiting:
            self.poll(flush=True)
            if self.proc is not None:
                with suppress(subprocess.TimeoutExpired):
                    self.proc.wait(POLL_S)


# ---------------------------------------------------------------- workers


def _exit_on_term(signum, frame) -> None:
    os._exit(EXIT[signal.SIGTERM])


def _init_worker(parent: int, gpus=None) -> None:
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


def _cell_in_worker(root: str, cell: Cell, run_cell) -> dict:
    """One cell in a worker process (local or Ray): torch threads are set per process by run_cell. The cell is
    taken from params.yaml as it is now (its arm's KL spec may have changed since the runner started), and the
    summary carries the params.yaml text it ran with (``RAN_WITH``; None if the file changed while it ran), which
    the recording compares with what DVC records (pipelines/lockfile.py ``commit``)."""
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


_READY: set[str] = set()


def _mlflow_ready(experiment: str) -> None:
    """Creates MLflow's store and the experiment (tracking._client) one worker at a time, once per worker: on a
    fresh sqlite store, stages that start together would race in its table creation and in create_experiment."""
    if experiment not in _READY:
        with open(STATE / "mlflow.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            tracking._client(experiment)
        _READY.add(experiment)


def ppo_cell(params, cell: Cell) -> dict:
    from pipelines.ppo import run_cell

    _mlflow_ready(params.mlflow.experiment)
    return run_cell(params, cell)


def upstream_stage(params, up: Upstream) -> dict:
    """Runs upstream stage ``up.stage`` in this worker exactly as its dvc.yaml command does: `python -m
    pipelines.<kind> <task> <instance>` is ``pipelines.<kind>.main([task, instance])`` (tests/pipelines/test_run.py
    checks dvc.yaml's commands). In the worker, not a subprocess, so that a stopped worker stops the stage with it
    and tracking.stage_run marks its MLflow run FAILED, as for a cell. The stage writes its outputs atomically."""
    import importlib

    group, instance = up.stage.split("@")
    task, kind = group.rsplit("_", 1)
    task = task.removesuffix("_calibration")  # grammar_calibration_sft@0: the grammar task's sft stage
    _mlflow_ready(params.mlflow.experiment)
    start = time.perf_counter()
    try:
        importlib.import_module(f"pipelines.{kind}").main([task, instance])
    except SystemExit as e:  # a stage's one-line refusal
        raise RuntimeError(str(e)) from None
    return {"wall_s": time.perf_counter() - start}


class LocalPool:
    """Cells in a process pool (spawned workers, one per core by default; on GPUs one per entry of ``slots``)."""

    def __init__(self, workers: int, slots: list[str] | None = None):
        """``slots``: the CUDA_VISIBLE_DEVICES of each worker (``workers`` entries), or None for CPU workers."""
        resource_tracker.ensure_running()  # before submit blocks Ctrl-C: starting it unblocks SIGINT (CPython 3.11)
        ctx = multiprocessing.get_context("spawn")
        gpus = None
        if slots is not None:
            gpus = ctx.SimpleQueue()  # put() writes to the pipe at once: every slot is there before a worker starts
            for gpu in slots:
                gpus.put(gpu)
        self.pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(os.getpid(), gpus))
        self.stopped = False

    def submit(self, *args):
        """Queues a cell; a worker spawned here starts with Ctrl-C blocked (the signal mask survives exec), so a
        Ctrl-C while it imports cannot kill it with a traceback; _init_worker ignores it, then unblocks it. The
        runner gets a Ctrl-C of these moments when the mask is restored (multiprocessing starts its resource
        tracker the same way)."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return self.pool.submit(_cell_in_worker, *args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def wait(self, pending: set, timeout: float) -> set:
        return wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)[0]

    def result(self, handle) -> dict:
        return handle.result()

    def close(self) -> None:
        if not self.stopped:
            self.pool.shutdown()

    def stop(self, pending) -> None:
        """Cancels the queued cells and stops the running ones: SIGTERM, then SIGKILL after GRACE_S."""
        self.stopped = True
        procs = multiprocessing.active_children()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def ray_resources(cluster_gpus: float, workers_per_gpu: int | None, threads: int) -> dict:
    """What one cell asks Ray for: ``threads`` CPUs (its torch threads) and, on a cluster with GPUs, 1/N of a GPU
    (N cells per GPU at once, N = ``workers_per_gpu``, default 1). Ray then sets the task's CUDA_VISIBLE_DEVICES."""
    if workers_per_gpu is not None and not cluster_gpus:
        raise RunnerError(f"--workers-per-gpu {workers_per_gpu}: the Ray cluster has no GPUs", 2)
    return {"num_cpus": threads, "num_gpus": 1 / (workers_per_gpu or 1) if cluster_gpus else 0}


class RayPool:
    """Cells as Ray tasks (``ray_resources`` each) on a cluster that shares the repository's filesystem."""

    def __init__(self, address: str, workers_per_gpu: int | None = None):
        import ray

        self.ray = ray
        env = {k: os.environ[k] for k in ("RLHF_THREADS", "TQDM_DISABLE", "MLFLOW_TRACKING_URI") if k in os.environ}
        ray.init(address=address, runtime_env={"env_vars": env})
        try:
            res = ray_resources(ray.cluster_resources().get("GPU", 0), workers_per_gpu, int(env["RLHF_THREADS"]))
        except RunnerError:
            ray.shutdown()
            raise
        print(f"Ray: each cell asks for {res['num_cpus']} CPU and {res['num_gpus']:g} GPU", flush=True)
        self.remote = ray.remote(**res)(_cell_in_worker)

    def submit(self, *args):
        return self.remote.remote(*args)

    def wait(self, pending: set, timeout: float) -> set:
        return set(self.ray.wait(list(pending), num_returns=1, timeout=timeout)[0])

    def result(self, handle) -> dict:
        return self.ray.get(handle)

    def close(self) -> None:
        self.ray.shutdown()

    def stop(self, pending) -> None:
        for ref in pending:
            with suppress(Exception):
                self.ray.cancel(ref, force=True)
        self.ray.shutdown()


def _progress(i: int, n: int, cell: Cell, s: dict, elapsed: float) -> str:
    shown = [
        ("gold", "final_gold", 3),
        ("proxy", "final_proxy", 3),
        ("ood", "final_ood_gold", 3),
        ("KL", "final_kl", 2),
    ]
    values = " ".join(f"{label} {s[k]:.{d}f}" for label, k, d in shown if isinstance(s.get(k), int | float))
    return f"[{i}/{n}] {cell.stage}: {values}{' ' if values else ''}({s.get('wall_s', 0):.0f}s, {elapsed:.0f}s elapsed)"


def run_cells(todo: list, backend, recorder: Recorder, sig: Signals, run_cell, experiment: str) -> list[str]:
    """Runs ``todo`` (cells, or Upstream stages: when one finishes, its ``next`` is queued) on ``backend``,
    recording finished ones as they finish; returns the failed stages. On a signal (or an error of the runner
    itself) stops the workers, marks the unfinished stages' MLflow runs FAILED and records every finished one
    before raising."""
    root, start, what = str(Path.cwd()), time.perf_counter(), recorder.what
    pending = {backend.submit(root, c, run_cell): c for c in todo}
    n, done = len(todo) + sum(len(getattr(c, "rest", ())) for c in todo), 0
    failed: list[str] = []
    try:
        while pending and not sig.signum:
            for handle in backend.wait(set(pending), POLL_S):
                cell, done = pending.pop(handle), done + 1
                try:
                    s = backend.result(handle)
                except Exception as e:  # report and go on: the other cells are still worth having
                    failed.append(cell.stage)
                    print(f"[{done}/{n}] FAILED {cell.stage}: {tracking.fault_line(e) or _last_line(e)}", flush=True)
                    continue
                print(_progress(done, n, cell, s, time.perf_counter() - start), flush=True)
                for member in getattr(cell, "cells", (cell,)):  # a population (pipelines/population.py): each cell
                    recorder.add(member, s.get(RAN_WITH))
                if getattr(cell, "next", None) and s.get(RAN_WITH) is not None:
                    pending[backend.submit(root, cell.next, run_cell)] = cell.next
            recorder.poll()
    finally:
        if pending:
            print(f"stopping {len(pending)} unfinished {what}; recording the finished ones ...", flush=True)
            backend.stop(list(pending))
        recorder.finish()
        if pending:
            stopped = {m.stage for c in pending.values() for m in getattr(c, "cells", (c,))}
            _fail_runs(experiment, "stopped by the grid runner", stopped)
    sig.check(
        f"{len(recorder.recorded)} finished {what} are recorded in dvc.lock, {len(pending)} were stopped "
        "(MLflow runs marked FAILED); run again to do the rest"
    )
    return failed


def check_stale(recorder: Recorder) -> None:
    """Fails (one line) if finished stages were left unrecorded because params.yaml changed under them."""
    if recorder.stale:
        n, names = len(recorder.stale), ", ".join(recorder.stale)
        raise RunnerError(
            f"params.yaml changed while the runner ran: {n} finished {recorder.what} were left stale, not recorded "
            f"({names}); run again to compute them with the current values"
        )


def _fail_runs(experiment: str, reason: str, stages: set[str] | None = None) -> list[str]:
    """Marks MLflow runs left RUNNING FAILED (tracking.fail_running). MLflow is only a mirror: a problem with it
    is a note, not a failure (the next start tries again)."""
    try:
        return tracking.fail_running(experiment, reason, stages)
    except Exception as e:
        print(f"note: could not mark MLflow runs left RUNNING FAILED ({_last_line(e)})", flush=True)
        return []


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
    stale = _fail_runs(experiment, "its process was gone when the grid runner started")
    if stale:
        print(f"marked {len(stale)} MLflow runs left RUNNING by a killed run FAILED: {', '.join(stale)}", flush=True)


def visible_gpus() -> list[str]:
    """The CUDA devices this runner may place cells on, as CUDA_VISIBLE_DEVICES entries: the runner's own
    CUDA_VISIBLE_DEVICES if set (e.g. by a job scheduler), else the indices 0..n-1; [] without CUDA.
    ``torch.cuda.device_count`` counts through NVML where it can and starts no CUDA context here."""
    import torch

    n = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in env.split(",")] if env is not None else [str(i) for i in range(n)]
    return ids[:n]


def placement(args: argparse.Namespace, visible: list[str]) -> tuple[int, list[str] | None]:
    """(number of local workers, CUDA_VISIBLE_DEVICES of each worker or None for CPU workers) from the flags and
    the ``visible`` GPUs; RunnerError (one line, exit 2) for flags that make no sense here.

    On GPUs (``--gpus``, default every visible one) there are ``--workers`` workers if given, else
    ``--workers-per-gpu`` (default 1) per GPU; worker i gets GPU i mod the number of GPUs, so the GPUs are filled
    evenly, and a pool that starts fewer workers than slots (fewer cells than workers) still spreads them."""
    if args.workers is not None and args.workers < 1:
        raise RunnerError(f"--workers must be 1 or more (got {args.workers})", 2)
    if getattr(args, "population", None) is not None and (args.population < 1 or args.ray_address):
        raise RunnerError("--population N: N must be 1 or more, and local workers only (not --ray-address)", 2)
    if args.workers_per_gpu is not None and args.workers_per_gpu < 1:
        raise RunnerError(f"--workers-per-gpu must be 1 or more (got {args.workers_per_gpu})", 2)
    if args.ray_address:
        if args.gpus is not None or args.workers is not None:
            flag = "--gpus" if args.gpus is not None else "--workers"
            raise RunnerError(f"{flag} places local workers; on Ray, Ray places the cells (see --workers-per-gpu)", 2)
        return 0, None
    if not visible:
        flag = "--gpus" if args.gpus is not None else "--workers-per-gpu" if args.workers_per_gpu is not None else None
        if flag:
            raise RunnerError(
                f"{flag}: no CUDA device is visible to this runner (torch sees none); cells run on CPU workers "
                "(--workers)",
                2,
            )
        return args.workers or os.cpu_count() or 1, None
    if args.workers is not None and args.workers_per_gpu is not None:
        raise RunnerError("give --workers (in all) or --workers-per-gpu, not both", 2)
    gpus = visible if args.gpus is None else [g.strip() for g in args.gpus.split(",")]
    bad = [g for g in gpus if g not in visible]
    if bad or len(set(gpus)) != len(gpus):
        why = f"{bad[0]!r} is not a visible GPU" if bad else "a GPU is named twice"
        raise RunnerError(f"--gpus {args.gpus}: {why}; visible: {','.join(visible)} (CUDA_VISIBLE_DEVICES entries)", 2)
    workers = args.workers or len(gpus) * (args.workers_per_gpu or 1)
    return workers, [gpus[i % len(gpus)] for i in range(workers)]


def _where(workers: int, slots: list[str] | None, ray_address: str | None) -> str:
    if ray_address:
        return f"Ray at {ray_address}"
    if not slots:
        return f"{workers} local workers"
    return f"{workers} local workers: " + ", ".join(f"{slots.count(g)} on GPU {g}" for g in dict.fromkeys(slots))


def run_wave(todo: list[Cell], backend, env, sig: Signals, args, run_cell, experiment: str) -> None:
    """Runs the stale cells ``todo`` on the workers, recording them as they finish; RunnerError if any failed."""
    if not todo:
        return
    if getattr(args, "population", None):  # groups of cells, each group one batched computation in a worker
        from pipelines import population

        todo, run_cell = population.plan(load_params(), todo, args.population), population.executor(run_cell)
    recorder = Recorder(env, args.commit_every)
    failed = run_cells(todo, backend(), recorder, sig, run_cell, experiment)
    if failed:
        n, names = len(failed), ", ".join(failed)
        raise RunnerError(f"{n} cells failed: {names}; fix and re-run (finished cells are kept)")
    check_stale(recorder)


def run(args: argparse.Namespace, sig: Signals, run_cell=ppo_cell, run_stage=upstream_stage) -> None:
    start = time.perf_counter()
    if not Path(".dvc").is_dir():
        raise RunnerError("no .dvc directory here: run the runner from the repository's root", 2)
    try:
        params = load_params()
    except ParamsError as e:
        raise RunnerError(str(e), 2) from None
    workers, slots = placement(args, [] if args.ray_address else visible_gpus())
    env = stage_env()
    check_interpreter(env)
    with runner_lock():
        os.environ[tracking.RUNNER_ENV] = str(os.getpid())  # the workers' stages pass refuse_beside_runner
        prepare(params.mlflow.experiment)
        sig.check("stopped before any compute")
        os.environ.setdefault("RLHF_THREADS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
        pool = []  # started when there is work: Ray connects to its cluster at once

        def backend():
            ray = args.ray_address
            pool[:] = pool or [RayPool(ray, args.workers_per_gpu) if ray else LocalPool(workers, slots)]
            return pool[0]

        try:
            ups = stale_chains(upstream_chains(params, evaluation=not args.calibration_only), env, sig)
            if ups:
                print(f"{len(ups)} upstream chains to build: {', '.join(u.stage for u in ups)}", flush=True)
                recorder = Recorder(env, args.commit_every, "upstream stages")
                failed = run_cells(ups, backend(), recorder, sig, run_stage, params.mlflow.experiment)
                if failed:
                    raise RunnerError(f"upstream stage failed: {', '.join(failed)}; its message is above; no cell ran")
                check_stale(recorder)
            where = _where(workers, slots, args.ray_address)
            cal = calibration_cells(params)
            todo = stale_cells(cal, env, sig)
            print(f"{len(todo)} of {len(cal)} calibration cells to run on {where}", flush=True)
            run_wave(todo, backend, env, sig, args, run_cell, params.mlflow.experiment)
            # the protocol is fixed on the calibration cells before any evaluation cell runs (dvc.yaml's DAG too)
            dvc(["repro", *calibrate_stages(params)], env, sig)
            if args.calibration_only:
                print("calibration done: protocol/<task>.json written; commit it before the evaluation", flush=True)
                return
            grid = evaluation_cells(params)
            todo = stale_cells(grid, env, sig)
            print(f"{len(todo)} of {len(grid)} grid cells to run on {where}", flush=True)
            run_wave(todo, backend, env, sig, args, run_cell, params.mlflow.experiment)
        finally:
            for b in pool:
                b.close()
        if not args.no_analysis:  # the running tasks' analyses (a task with no instances has none to run)
            dvc(["repro", *(f"{task}_analysis" for task in params.tasks())], env, sig)
    print(f"done in {time.perf_counter() - start:.0f}s", flush=True)


def main(argv: list[str] | None = None, run_cell=ppo_cell, run_stage=upstream_stage) -> int:
    """The command line; ``run_cell(params, cell) -> summary`` runs one cell in a worker, ``run_stage(params,
    upstream) -> summary`` one upstream stage (tests swap them)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, help="local processes (default: cores; with CUDA: one per GPU)")
    ap.add_argument("--gpus", help="GPUs for local workers, e.g. 0,1 (default with CUDA: every visible GPU)")
    ap.add_argument("--workers-per-gpu", type=int, help="workers (cells at once) per GPU; on Ray: 1/N GPU per cell")
    ap.add_argument("--ray-address", help="Ray cluster address ('auto', 'ray://host:10001' or 'local')")
    ap.add_argument(
        "--population",
        type=int,
        help="up to N stale cells of one structure per worker, as one batched computation",
    )
    ap.add_argument("--no-analysis", action="store_true", help="stop after the grid cells")
    ap.add_argument(
        "--calibration-only", action="store_true", help="stop once the calibration has fixed protocol/<task>.json"
    )
    ap.add_argument(
        "--commit-every", type=float, default=60.0, help="seconds between recordings of finished cells (default 60)"
    )
    args = ap.parse_args(argv)
    try:
        with Signals() as sig:
            run(args, sig, run_cell, run_stage)
    except Interrupted as e:
        print(f"stopped by {e}", file=sys.stderr, flush=True)
        return e.code
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.code
    except Exception as e:  # a full disk or a corrupt store: one line; a bug of the runner: the traceback in a file
        fault = tracking.fault_line(e)
        if fault:
            print(f"error: {fault}", file=sys.stderr, flush=True)
            return 1
        log = Path(tempfile.mkstemp(prefix="pipelines-run-", suffix=".txt")[1])
        log.write_text(traceback.format_exc())
        print(f"error: unexpected {type(e).__name__}: {_last_line(e)} (traceback in {log})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
