"""One MLflow parent run per sweep: the stages a runner invocation runs nest under it, through one run per task;
plain `dvc repro` stages nest under a top-level run of their task."""

from __future__ import annotations

import os

import pytest
from mlflow.tracking import MlflowClient

from pipelines import tracking
from pipelines.runner import mlflow_runs
from pipelines.runner.dvccli import STATE
from pipelines.runner.signals import Interrupted


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / STATE).mkdir(parents=True)
    return tmp_path


def stage(name: str) -> str:
    with tracking.stage_run(name, "sweeps", {"lr": 0.1}, tags={"task": name.split("_")[0]}) as (_, run_id):
        return run_id


def test_stages_of_a_sweep_nest_under_its_parent_run_and_plain_stages_do_not(workdir):
    env: dict[str, str] = {}
    with mlflow_runs.sweep("sweeps", env) as parent:
        assert env[tracking.PARENT_ENV] == os.environ[tracking.PARENT_ENV] == parent  # workers and DVC inherit it
        nested = stage("grammar_sft@0")
    alone = stage("arithmetic_sft@0")  # as by plain `dvc repro`: no runner, no parent
    client = MlflowClient(tracking.tracking_uri())
    group = client.get_run(client.get_run(nested).data.tags[tracking.PARENT_TAG])  # the task's run, in the sweep
    assert group.info.run_name == "grammar" and group.data.tags[tracking.PARENT_TAG] == parent
    assert client.get_run(nested).data.tags["task"] == "grammar"  # the task filter: tags.task = "grammar"
    top = client.get_run(client.get_run(alone).data.tags[tracking.PARENT_TAG])  # a top-level run of the task
    assert top.info.run_name == "arithmetic" and tracking.PARENT_TAG not in top.data.tags
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and run.data.tags["sweep"] == "runner"
    assert run.info.run_name.startswith("sweep ") and tracking.PARENT_ENV not in os.environ


def test_a_stopped_sweep_ends_killed_and_a_failed_one_failed(workdir):
    ids = []
    for error, status in ((Interrupted(15, "stopped"), "KILLED"), (RuntimeError("boom"), "FAILED")):
        with pytest.raises(type(error)), mlflow_runs.sweep("sweeps", {}) as parent:
            ids.append((parent, status))
            raise error
    client = MlflowClient(tracking.tracking_uri())
    assert [client.get_run(p).info.status for p, _ in ids] == [s for _, s in ids]
