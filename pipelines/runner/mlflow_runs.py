"""The runner's use of MLflow (every MLflow call of pipelines.runner is here; the stages' own logging is
pipelines.tracking): the sweep's parent run, the store and experiment made ready once per worker, and runs left
RUNNING marked FAILED.

One parent run per sweep (one runner invocation: `make repro`), named ``sweep <start time>`` and tagged
``sweep=runner``; every stage the sweep runs (in its workers, or by DVC: the calibrate stages, the analysis) nests
under it (tracking.PARENT_ENV, MLflow's ``mlflow.parentRunId``). It ends FINISHED, FAILED, or KILLED when the runner
is stopped; a runner killed outright leaves it RUNNING, and the next runner marks it FAILED with the stages.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shlex
import sys
import time
from contextlib import contextmanager

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
