"""The runner's use of MLflow (every MLflow call of pipelines.runner is here; the stages' own logging is
pipelines.tracking): the sweep's parent run, the store and experiment made ready once per worker, and runs left
RUNNING marked FAILED.

One parent run per sweep (one runner invocation: `make repro`), named ``sweep <start time>`` and tagged
``sweep=runner``; every stage the sweep runs in its workers nests under it (tracking.PARENT_ENV, MLflow's
``mlflow.parentRunId``). It ends FINISHED, FAILED, or KILLED when the runner is stopped; a runner killed outright
leaves it RUNNING, and the next runner marks it FAILED with the stages.

A stage run on a Ray node (pipelines.runner.remote) logs to a store of its worker process; ``export_runs`` takes its
runs out of that store as plain data, and the runner logs them into this repository's store (``import_runs``): no
node writes the repository's sqlite file, and nothing but the runner needs to reach it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shlex
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse

from pipelines import tracking
from pipelines.runner.dvccli import STATE
from pipelines.runner.signals import Interrupted, last_line

_READY: set[str] = set()


def ready(experiment: str) -> None:
    """Creates MLflow's store and the experiment (tracking.experiment_client) one worker at a time, once per worker:
    on a fresh sqlite store, stages that start together would race in its table creation and in
    create_experiment."""
    if experiment not in _READY:
        with open(STATE / "mlflow.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            tracking.experiment_client(experiment)
        _READY.add(experiment)


def fail_runs(experiment: str, reason: str, stages: set[str] | None = None) -> list[str]:
    """Marks MLflow runs left RUNNING FAILED (tracking.fail_running). MLflow is only a mirror: a problem with it
    is a note, not a failure (the next start tries again)."""
    try:
        return tracking.fail_running(experiment, reason, stages)
    except Exception as e:
        print(f"note: could not mark MLflow runs left RUNNING FAILED ({last_line(e)})", flush=True)
        return []


def _start_sweep(experiment: str) -> str | None:
    """Creates the sweep's parent run; None (and a note) if MLflow cannot: MLflow is only a mirror."""
    import mlflow  # noqa: F401  (it sets up its loggers when imported)

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # the runner's stderr is its one-line outcome
    try:
        with open(STATE / "mlflow.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            client, exp_id = tracking.experiment_client(experiment)
        tags = {tracking.REPO_TAG: str(tracking.ROOT), "sweep": "runner", "git_commit": tracking.git_commit()}
        tags["command"] = shlex.join(["python", "-m", "pipelines.run", *sys.argv[1:]])
        run = client.create_run(exp_id, run_name=f"sweep {time.strftime('%Y-%m-%d %H:%M:%S')}", tags=tags)
        return run.info.run_id
    except Exception as e:
        print(f"note: no MLflow parent run for this sweep ({last_line(e)}); its stages log top-level runs", flush=True)
        return None


def _end_sweep(experiment: str, run_id: str, status: str) -> None:
    try:
        tracking.experiment_client(experiment)[0].set_terminated(run_id, status)
    except Exception as e:
        print(f"note: could not end the sweep's MLflow run ({last_line(e)})", flush=True)


@contextmanager
def sweep(experiment: str, env: dict[str, str]):
    """The sweep's parent run around the block: its id in this process's environment (the workers inherit it) and
    in ``env`` (DVC's calls), ended FINISHED, KILLED (stopped by a signal) or FAILED as the block ends."""
    run_id = _start_sweep(experiment)
    if run_id is None:
        yield None
        return
    os.environ[tracking.PARENT_ENV] = env[tracking.PARENT_ENV] = run_id
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    except Interrupted:
        status = "KILLED"
        raise
    finally:
        os.environ.pop(tracking.PARENT_ENV, None)
        _end_sweep(experiment, run_id, status)


def _hard_delete(client, run_id: str) -> None:
    """Deletes a run from a scratch store for good (what `mlflow gc` does, through the store's ``_hard_delete_run``);
    where the store has none, the run is only marked deleted."""
    client.delete_run(run_id)
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    if hasattr(store, "_hard_delete_run"):
        store._hard_delete_run(run_id)


def export_runs() -> list[dict]:
    """The runs of this process's MLflow store (a Ray worker's scratch store) as plain data for ``import_runs``: name,
    status, start and end times, tags, params, every metric value (key, value, timestamp, step) and every artifact's
    bytes; they are removed from the store. [] if the store was never created (the stage logged nothing)."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    uri = tracking.tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return []
    client = MlflowClient(tracking_uri=uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    out = []
    for run in client.search_runs(ids, run_view_type=ViewType.ACTIVE_ONLY, max_results=1000) if ids else []:
        rid, data = run.info.run_id, run.data
        history = [m for key in data.metrics for m in client.get_metric_history(rid, key)]
        art = Path(unquote(urlparse(run.info.artifact_uri).path))
        files = sorted(p for p in art.rglob("*") if p.is_file()) if art.is_dir() else []
        out.append(
            {
                "name": run.info.run_name,
                "status": run.info.status,
                "start_time": run.info.start_time,
                "end_time": run.info.end_time,
                "tags": dict(data.tags),
                "params": dict(data.params),
                "metrics": [(m.key, m.value, m.timestamp, m.step) for m in history],
                "artifacts": {p.relative_to(art).as_posix(): p.read_bytes() for p in files},
            }
        )
        _hard_delete(client, rid)
    return out


_CLIENTS: dict[str, tuple] = {}
RAY_NODE_TAG = "ray_node"  # the id of the Ray node a stage ran on


def import_runs(experiment: str, runs: list[dict], commit: str, node: str | None = None) -> None:
    """Logs runs a Ray worker exported (``export_runs``) into this repository's store as the stage would have logged
    them here (tracking.stage_run): earlier runs of the same stage of this repository deleted, the repository's root
    and ``commit`` (the runner's git commit: the node has no repository) as tags, and the Ray ``node`` it ran on
    (``RAY_NODE_TAG``), everything else as it was logged. MLflow is only a mirror: a failure is a note, not a failed
    stage."""
    from mlflow.entities import Metric, Param

    for rec in runs:
        try:
            key = f"{tracking.tracking_uri()} {experiment}"
            if key not in _CLIENTS:
                _CLIENTS[key] = tracking.experiment_client(experiment)
            client, exp_id = _CLIENTS[key]
            stage = rec["tags"].get(tracking.STAGE_TAG, rec["name"])
            for old in client.search_runs([exp_id], filter_string=f"tags.{tracking.STAGE_TAG} = '{stage}'"):
                if tracking._ours(old):  # as tracking.stage_run: never another repository's run of the stage
                    client.delete_run(old.info.run_id)
            tags = {k: v for k, v in rec["tags"].items() if k != "mlflow.runName"}
            tags |= {tracking.REPO_TAG: str(tracking.ROOT), "git_commit": commit} | (
                {RAY_NODE_TAG: node} if node else {}
            )
            rid = client.create_run(exp_id, start_time=rec["start_time"], tags=tags, run_name=rec["name"]).info.run_id
            params = [Param(k, v) for k, v in rec["params"].items()]
            metrics = [Metric(*m) for m in rec["metrics"]]
            for i in range(0, len(params), 100):
                client.log_batch(rid, params=params[i : i + 100])
            for i in range(0, len(metrics), 1000):
                client.log_batch(rid, metrics=metrics[i : i + 1000])
            if rec["artifacts"]:
                with tempfile.TemporaryDirectory() as tmp:
                    for rel, data in rec["artifacts"].items():
                        (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                        (Path(tmp) / rel).write_bytes(data)
                    client.log_artifacts(rid, tmp)
            client.set_terminated(rid, rec["status"], end_time=rec["end_time"])
        except Exception as e:
            print(
                f"note: could not log the MLflow run of {rec['name']} from its Ray worker ({last_line(e)})", flush=True
            )
