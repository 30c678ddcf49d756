"""What a Ray worker runs: one cell or upstream stage by value, on a node without the repository.

The runner (pipelines.runner.ray) ships a ``Job``: the stage (a cell or an upstream stage), the function that runs
it, the params.yaml text, and the bytes of the upstream outputs it reads (its instance's task.pt, sft.pt, rm.pt, and
protocol/<task>.json for a design cell), as Ray task arguments (objects put in Ray's object store once each). The
code travels as the runtime environment's ``py_modules`` (the runner's rlhf, ablations and pipelines). Here the job
runs in this worker process's scratch directory, laid out as the repository would be, exactly as a local worker runs
it (pipelines.runner.worker ``cell_in_worker``), and the task returns the files it wrote under the output folders
(pipelines.leftovers ``OUTPUT_DIRS``) as bytes, with its MLflow runs (pipelines.runner.mlflow_runs ``export_runs``):
the runner writes both into the repository and its MLflow store, and records the stage in dvc.lock as it records a
local one. Nothing on the node outlives the task but this process's MLflow scratch store.

``setup`` is the runtime environment's ``worker_process_setup_hook``: it runs once in each Ray worker process before
any task, so that the stages' notion of the repository root (pipelines.tracking ``ROOT``, the working directory
when it is imported) is this process's scratch directory.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipelines.leftovers import OUTPUT_DIRS

PREFIX = "kl-placement-ray-"  # + "<pid>-<random>": a worker process's scratch directory, under the node's temp dir
MLFLOW_DB = "mlflow.db"  # this process's MLflow scratch store, in its scratch directory


@dataclass(frozen=True)
class Job:
    """One stage for a Ray worker: ``fn(params, item)`` (a cell's or an upstream stage's worker function) with the
    params.yaml text ``params`` and the files ``inputs`` (paths relative to the repository; their bytes are the
    task's further arguments, in this order)."""

    item: object
    fn: Callable
    params: str
    inputs: tuple[str, ...]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def setup() -> None:
    """worker_process_setup_hook: makes a scratch directory for this worker process (and removes those of worker
    processes that are gone: a worker killed by Ray leaves its own), works in it, and logs MLflow runs to a store of
    its own there."""
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob(f"{PREFIX}*"):
        pid = old.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    atexit.register(shutil.rmtree, root, True)
    os.chdir(root)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / MLFLOW_DB}"


def _clear(root: Path) -> None:
    """Empties the scratch directory but for the MLflow scratch store (made once per process: its schema
    migrations cost seconds)."""
    for p in root.iterdir():
        if p.name.startswith(MLFLOW_DB):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    (root / ".dvc/tmp/runner").mkdir(parents=True)  # pipelines.runner.dvccli.STATE: mlflow_runs.ready's lock file


def _outputs(root: Path, inputs: set[str]) -> dict[str, bytes]:
    """The files the stage wrote under the output folders, by path relative to the root."""
    out = {}
    for top in OUTPUT_DIRS:
        for p in sorted((root / top).rglob("*")) if (root / top).is_dir() else ():
            rel = p.relative_to(root).as_posix()
            if p.is_file() and rel not in inputs:
                out[rel] = p.read_bytes()
    return out


def _node() -> str | None:
    """The id of the Ray node this runs on (None outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def run(job: Job, *contents: bytes) -> dict:
    """The Ray task: ``job`` in this process's scratch directory. Returns ``summary`` (the worker's summary, with
    the params.yaml text it ran with), ``outputs`` ({path: bytes}), ``runs`` (its MLflow runs), ``error`` (the
    stage's failure in one line, or None) and ``node`` (the Ray node it ran on). A stage that raises is reported,
    never retried: the result carries the error (and its FAILED MLflow run) instead of raising."""
    root = Path.cwd()
    _clear(root)
    (root / "params.yaml").write_text(job.params, encoding="utf-8")
    for rel, data in zip(job.inputs, contents, strict=True):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    from pipelines import tracking
    from pipelines.runner import mlflow_runs
    from pipelines.runner.signals import last_line
    from pipelines.runner.worker import cell_in_worker

    summary, error = None, None
    try:
        summary = cell_in_worker(str(root), job.item, job.fn)
    except Exception as e:
        error = tracking.fault_line(e) or last_line(e)
    outputs = _outputs(root, set(job.inputs)) if error is None else {}
    return {"summary": summary, "outputs": outputs, "runs": mlflow_runs.export_runs(), "error": error, "node": _node()}
