"""The runner's use of MLflow (every MLflow call of pipelines.runner is here; the stages' own logging is
pipelines.tracking): the store and experiment made ready once per worker, and runs left RUNNING marked FAILED."""

from __future__ import annotations

import fcntl

from pipelines import tracking
from pipelines.runner.dvccli import STATE
from pipelines.runner.signals import last_line

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
