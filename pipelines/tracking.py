"""MLflow logging for every stage: one visible run per DVC stage, marked FAILED if the stage dies.

Tracking URI: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<repo>/mlflow.db``; artifacts in
``<repo>/mlartifacts``. Browse with ``mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

STAGE_TAG = "dvc_stage"
ROOT = Path.cwd()  # stages run from the repo root (dvc.yaml's wdir)


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(flatten(v, key + ".") if isinstance(v, dict) else {key: str(v)})
    return out


def _client(experiment: str):
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(tracking_uri())
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        exp_id = client.create_experiment(experiment, artifact_location=(ROOT / "mlartifacts").as_uri())
    else:
        exp_id = exp.experiment_id
    return client, exp_id


def _raise_on_term(signum, frame):
    raise KeyboardInterrupt(f"stopped by signal {signum}")


@contextmanager
def stage_run(stage: str, experiment: str, config: dict, tags: dict | None = None):
    """Opens the MLflow run of ``stage``: earlier runs of the same stage are deleted first (re-running a cell
    leaves one visible run), the resolved config is logged as params, and the run ends FINISHED, or FAILED
    if the block raises or the process gets SIGTERM/SIGINT. Yields (client, run_id)."""
    client, exp_id = _client(experiment)
    for old in client.search_runs([exp_id], filter_string=f"tags.{STAGE_TAG} = '{stage}'"):
        client.delete_run(old.info.run_id)
    all_tags = {STAGE_TAG: stage, "git_commit": git_commit(), **{k: str(v) for k, v in (tags or {}).items()}}
    run = client.create_run(exp_id, run_name=stage, tags=all_tags)
    run_id = run.info.run_id
    from mlflow.entities import Param

    params = [Param(k, v[:6000]) for k, v in flatten(config).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i : i + 100])
    previous = signal.signal(signal.SIGTERM, _raise_on_term)
    try:
        yield client, run_id
    except BaseException:  # errors, Ctrl-C and SIGTERM alike
        client.set_terminated(run_id, "FAILED")
        raise
    else:
        client.set_terminated(run_id, "FINISHED")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _existing_store() -> str | None:
    """The tracking URI, or None when it names a sqlite file that does not exist (nothing was ever logged)."""
    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    return uri


def fail_running(experiment: str, reason: str, stages: set[str] | None = None) -> list[str]:
    """Marks FAILED the runs of ``experiment`` still RUNNING whose process is gone (killed, or stopped by the
    runner), only those of ``stages`` if given, with the tag ``failure: reason``. Returns their stage names.
    Creates nothing: no store or no experiment means no runs. The caller must know that no stage is running
    (the grid runner holds its repository lock and has stopped its workers)."""
    uri = _existing_store()
    if uri is None:
        return []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    failed, token = [], None
    while True:
        page = client.search_runs(
            [exp.experiment_id], "attributes.status = 'RUNNING'", max_results=1000, page_token=token
        )
        for run in page:
            stage = run.data.tags.get(STAGE_TAG, run.info.run_name)
            if stages is None or stage in stages:
                client.set_tag(run.info.run_id, "failure", reason)
                client.set_terminated(run.info.run_id, "FAILED")
                failed.append(stage)
        token = page.token
        if not token:
            return failed


def log_metrics(client, run_id: str, rows: list[dict], prefix: str = "", step_key: str = "iteration") -> None:
    """Logs a list of per-step dicts (e.g. PPO history) as metrics with ``step``, in batches."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [
        Metric(f"{prefix}{k}", float(v), now, int(row[step_key]))
        for row in rows
        for k, v in row.items()
        if k != step_key and v is not None
    ]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000])


def flatten_numbers(d: dict, prefix: str = "") -> dict[str, float]:
    """Nested dict -> {"a.b": number} for its int/float leaves, keys made valid MLflow metric names."""
    out = {}
    for k, v in d.items():
        key = re.sub(r"[^\w\-. :/]", "_", f"{prefix}{k}")
        if isinstance(v, dict):
            out.update(flatten_numbers(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def log_final(client, run_id: str, values: dict) -> None:
    log_metrics(
        client,
        run_id,
        [{"step": 0, **{k: v for k, v in values.items() if isinstance(v, (int, float))}}],
        step_key="step",
    )
