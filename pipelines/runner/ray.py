"""Cells and upstream stages as Ray tasks, by value: no node needs the repository (pip install -e '.[ray]').

Each task gets its stage, the params.yaml text, and the upstream outputs the stage reads (``inputs``), each file put
in Ray's object store once per run and handed to every task that reads it (a real model is read from the repository
once, not once per cell); the code travels as the runtime environment's ``py_modules`` (this repository's rlhf,
ablations and pipelines, as they are when the runner starts). The task (pipelines.runner.remote) runs the stage in a
scratch directory on its node and returns the files it wrote and its MLflow runs; ``result`` writes them into the
repository (a cell's folder replaced whole, as its stage replaces it) and this repository's MLflow store, and the
runner records the stage in dvc.lock as it records a local one.

Failures: a task whose worker or node dies is retried elsewhere (Ray's ``max_retries``, system failures only); a stage
that raises is not retried (``retry_exceptions=False``; the task returns the error) and is reported in one line.
Stopping cancels every task (``ray.cancel(force=True)`` kills its worker) before the runner exits; a task's files
reach the repository only through ``result``, so a stopped or lost task leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from contextlib import suppress
from pathlib import Path

from ablations.config import PARAMS_FILE
from ablations.grid import Cell, protocol_path
from ablations.tasks import TASKS
from pipelines import tracking
from pipelines.cpu import PIN_ENV, THREADS_ENV
from pipelines.runner import mlflow_runs
from pipelines.runner.plan import Upstream
from pipelines.runner.remote import Job, run
from pipelines.runner.signals import RunnerError, StageError, last_line

PACKAGES = ("rlhf", "ablations", "pipelines")  # the code a node runs (the runner's own): the runtime env's py_modules
MAX_RETRIES = 3  # re-runs of a task whose worker process or node died (Ray's default for tasks)
ENV = (THREADS_ENV, PIN_ENV, "TQDM_DISABLE", tracking.PARENT_ENV)  # the runner's settings that a stage reads


def ray_resources(cluster_gpus: float, workers_per_gpu: int | None, threads: int) -> dict:
    """What one cell asks Ray for: ``threads`` CPUs (its torch threads) and, on a cluster with GPUs, 1/N of a GPU
    (N cells per GPU at once, N = ``workers_per_gpu``, default 1). Ray then sets the task's CUDA_VISIBLE_DEVICES."""
    if workers_per_gpu is not None and not cluster_gpus:
        raise RunnerError(f"--workers-per-gpu {workers_per_gpu}: the Ray cluster has no GPUs", 2)
    return {"num_cpus": threads, "num_gpus": 1 / (workers_per_gpu or 1) if cluster_gpus else 0}


def inputs(item) -> list[Path]:
    """The upstream outputs a cell or an upstream stage reads (its dvc.yaml deps other than code): the instance's
    task.pt, sft.pt, rm.pt (a learned-reward task) and eval0.json for a cell, and protocol/<task>.json for a design
    cell; none for a data stage, its task.pt for an SFT stage, both for a reward model, and task.pt, sft.pt and rm.pt
    (a learned-reward task) for the iteration-0 evaluation (tests/pipelines/test_remote.py checks them against
    DVC's)."""
    from pipelines.common import data_path, eval0_path, model_path

    def models(task: str, i: int) -> list[Path]:
        rm = [model_path(task, i, "rm")] if TASKS[task].learned_reward else []
        return [data_path(task, i), model_path(task, i, "sft"), *rm]

    if isinstance(item, Upstream):
        group, instance = item.stage.split("@")
        task, kind = group.rsplit("_", 1)
        task, i = task.removesuffix("_calibration"), int(instance)
        sft = [data_path(task, i), model_path(task, i, "sft")]
        return {"data": [], "sft": sft[:1], "rm": sft, "eval0": models(task, i)}[kind]
    if not isinstance(item, Cell):
        raise TypeError(f"no Ray task for {item!r}")
    found = [*models(item.task, item.instance), eval0_path(item.task, item.instance)]
    return found + ([protocol_path(item.task)] if item.kind == "design" else [])


def deliver(outputs: dict[str, bytes], folders: list[Path]) -> None:
    """Writes a task's ``outputs`` into the repository: the files under each of ``folders`` (a cell's run folder)
    replace that folder whole, every other file replaces its file; each atomically (pipelines.common)."""
    from pipelines.common import atomic_dir, write_atomic

    rest = dict(outputs)
    for folder in folders:
        mine = {rel: rest.pop(rel) for rel in list(rest) if Path(rel).is_relative_to(folder)}
        with atomic_dir(folder) as tmp:
            for rel, data in mine.items():
                write_atomic(tmp / Path(rel).relative_to(folder), data)
    for rel, data in rest.items():
        write_atomic(Path(rel), data)


def check_reachable(address: str, timeout: float = 10.0) -> None:
    """RunnerError (one line) if ``address`` is HOST:PORT and nothing listens there: ray.init would retry for
    minutes. 'auto', 'local' and ray:// addresses are left to Ray."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout).close()
    except OSError as e:
        raise RunnerError(f"--ray-address {address}: no Ray head answers there ({e.strerror or e})", 2) from None


class RayPool:
    """Cells and upstream stages as Ray tasks (``ray_resources`` each), by value."""

    def __init__(self, address: str, workers_per_gpu: int | None, experiment: str):
        import ray

        self.ray, self.experiment, self.commit = ray, experiment, tracking.git_commit()
        env = {k: os.environ[k] for k in ENV if k in os.environ}
        runtime_env = {
            "py_modules": [importlib.util.find_spec(p).submodule_search_locations[0] for p in PACKAGES],
            "excludes": ["__pycache__", "*.pyc"],
            "env_vars": env,
            "worker_process_setup_hook": "pipelines.runner.remote.setup",
        }
        check_reachable(address)
        try:
            ray.init(address=address, runtime_env=runtime_env)
        except Exception as e:  # no cluster there, a version mismatch, a refused token: one line
            raise RunnerError(f"--ray-address {address}: cannot connect to Ray ({last_line(e)})", 2) from None
        try:
            res = ray_resources(ray.cluster_resources().get("GPU", 0), workers_per_gpu, int(env[THREADS_ENV]))
        except RunnerError:
            ray.shutdown()
            raise
        print(f"Ray: each cell asks for {res['num_cpus']} CPU and {res['num_gpus']:g} GPU", flush=True)
        self.remote = ray.remote(**res, max_retries=MAX_RETRIES, retry_exceptions=False)(run)
        self.objects: dict[tuple, object] = {}  # (path, size, mtime) -> its bytes in Ray's object store
        self.items: dict = {}  # a submitted task's result (ObjectRef) -> its item

    def _put(self, path: Path):
        st = path.stat()
        key = (path.as_posix(), st.st_size, st.st_mtime_ns)
        if key not in self.objects:
            self.objects[key] = self.ray.put(path.read_bytes())
        return self.objects[key]

    def submit(self, root: str, item, fn):
        files = [p for p in inputs(item) if p.is_file()]  # a missing one fails in the stage, naming the file
        job = Job(item, fn, PARAMS_FILE.read_text(encoding="utf-8"), tuple(p.as_posix() for p in files))
        handle = self.remote.remote(job, *(self._put(p) for p in files))
        self.items[handle] = item
        return handle

    def wait(self, pending: set, timeout: float) -> set:
        return set(self.ray.wait(list(pending), num_returns=1, timeout=timeout)[0])

    def result(self, handle) -> dict:
        """The stage's summary, once its files are in the repository and its MLflow runs in the store."""
        item, out = self.items.pop(handle), self.ray.get(handle)
        mlflow_runs.import_runs(self.experiment, out["runs"], self.commit, out["node"])
        if out["error"] is not None:
            raise StageError(out["error"])
        deliver(out["outputs"], [item.out_dir] if isinstance(item, Cell) else [])
        return out["summary"]

    def close(self) -> None:
        self.objects.clear()
        self.ray.shutdown()

    def stop(self, pending) -> None:
        for ref in pending:
            with suppress(Exception):
                self.ray.cancel(ref, force=True)
        self.objects.clear()
        self.ray.shutdown()
