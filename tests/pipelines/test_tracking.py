"""Fast checks of what pipelines.tracking writes for the MLflow UI (the browser test, test_mlflow_ui.py, is slow).

No MLflow store here: ``describe`` is driven with a stand-in client that records the experiment tags it sets.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

from ablations.tasks import TASKS
from pipelines import tracking


class TagRecorder:
    """The one MlflowClient method ``describe`` calls, recording its calls and keeping the experiment's tags."""

    def __init__(self, experiment):
        self.experiment, self.calls = experiment, []

    def set_experiment_tag(self, experiment_id, key, value):
        assert experiment_id == self.experiment.experiment_id
        self.calls.append(key)
        self.experiment.tags[key] = value


def saved_view(tags: dict, task: str = "grammar") -> tuple[dict, dict]:
    """(envelope, UI state) of a task's training-curves view, decoded as the MLflow 3.17 web app does
    (savedViewEnvelope.ts: a JSON object with a string ``name``, a number ``createdAt`` and a string ``state``)."""
    envelope = json.loads(tags[tracking.VIEW_TAG_PREFIX + tracking.view_id(task)])
    assert isinstance(envelope["name"], str) and isinstance(envelope["createdAt"], int)
    return envelope, json.loads(envelope["state"])


def test_describe_sets_description_and_curves_view_once():
    exp = SimpleNamespace(experiment_id="7", tags={})
    client = TagRecorder(exp)
    tracking.describe(client, exp)
    views = [tracking.VIEW_TAG_PREFIX + tracking.view_id(t) for t in TASKS]
    assert sorted(client.calls) == sorted([tracking.DESCRIPTION_TAG, *views])  # one view per registered task
    tracking.describe(client, exp)  # what every later stage does: nothing to write
    assert len(client.calls) == 1 + len(TASKS)
    exp.tags[tracking.DESCRIPTION_TAG] = "edited by hand"
    tracking.describe(client, exp)  # a stale description is brought up to date
    assert client.calls[1 + len(TASKS) :] == [tracking.DESCRIPTION_TAG]
    assert exp.tags[tracking.DESCRIPTION_TAG] != "edited by hand"


def test_curves_view_opens_on_gold_and_kl_grouped_by_arm_of_one_task():
    exp = SimpleNamespace(experiment_id="7", tags={})
    tracking.describe(TagRecorder(exp), exp)
    envelope, state = saved_view(exp.tags)
    assert envelope["name"] == "Training curves by arm: grammar"
    assert state["searchFilter"] == "tags.task = 'grammar' AND tags.superseded IS NULL"  # the task's current runs
    assert saved_view(exp.tags, "arithmetic")[1]["searchFilter"].startswith("tags.task = 'arithmetic' AND ")
    sections = state["compareRunSections"]
    assert [s["name"] for s in sections][:2] == ["eval", "train"] and state["isAccordionReordered"]
    first = [c for c in state["compareRunCharts"] if c["metricSectionId"] == sections[0]["uuid"]]
    assert [c["metricKey"] for c in first] == ["eval/gold", "eval/kl"]
    assert all(c["type"] == "LINE" and c["xAxisKey"] == "step" for c in first)
    uuids = [c["uuid"] for c in state["compareRunCharts"]] + [s["uuid"] for s in sections]
    assert len(set(uuids)) == len(uuids)
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "arm"}]
    path = tracking.view_path("7", "grammar")
    assert path.startswith("#/experiments/7/runs?") and "viewStateShareKey=training-curves-grammar" in path
    assert "searchFilter" not in path  # a search parameter in the route would make the web app ignore the view
    assert "workflowType=machine_learning" in path and "compareRunsMode=CHART" in path


def test_description_first_line_points_to_report_and_curves():
    text = tracking.description("7")
    first = text.split("\n\n")[0]
    visible = re.sub(r"[*`\[\]]", "", re.sub(r"\]\([^)]*\)", "]", first))  # as rendered: no markup, no address
    assert "reports/<task>/report.md" in first and "<task>_analysis" in first
    assert f"[grammar]({tracking.view_path('7', 'grammar')})" in first
    assert f"[arithmetic]({tracking.view_path('7', 'arithmetic')})" in first
    assert len(visible) < 160  # one line of the collapsed description in a 1600-px window
    assert "tags.arm" in text and "dvc_stage" in text


def _store(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(tracking, "ROOT", tmp_path)
    monkeypatch.delenv(tracking.PARENT_ENV, raising=False)
    return MlflowClient(tracking.tracking_uri())


def test_a_rerun_keeps_the_earlier_run_tagged_superseded(tmp_path, monkeypatch):
    """Re-running a stage gives it a new run; the earlier one stays (metrics and all), tagged superseded by the new
    one, and the filter the saved views use (CURRENT_FILTER) finds only the new one."""
    client = _store(tmp_path, monkeypatch)
    ids = []
    for gold in (0.5, 0.7):
        with tracking.stage_run("grammar_baseline@10-0", "e", {"ppo": {"lr": 0.01}}, tags={"task": "grammar"}) as (
            c,
            rid,
        ):
            tracking.log_final(c, rid, {"final_gold": gold})
            ids.append(rid)
    exp = client.get_experiment_by_name("e").experiment_id
    first, second = (client.get_run(r) for r in ids)
    assert first.info.lifecycle_stage == "active" and first.data.metrics["final_gold"] == 0.5
    assert first.data.tags[tracking.SUPERSEDED_TAG] == "true" and first.data.tags["superseded_by"] == ids[1]
    assert tracking.SUPERSEDED_TAG not in second.data.tags
    current = client.search_runs([exp], f"tags.dvc_stage = 'grammar_baseline@10-0' AND {tracking.CURRENT_FILTER}")
    assert [r.info.run_id for r in current] == [ids[1]]
    _, state = saved_view({k: v for k, v in client.get_experiment(exp).tags.items()})
    assert tracking.CURRENT_FILTER in state["searchFilter"]
    shown = client.search_runs([exp], state["searchFilter"])  # what the saved view lists: the current cell run
    assert [r.info.run_id for r in shown] == [ids[1]]


def test_a_tasks_stage_runs_nest_under_one_group_run_per_task_and_sweep(tmp_path, monkeypatch):
    """Stages of a task nest under the task's group run: under the sweep's run when the runner runs them (one group
    per task and sweep), else one top-level group per task that every plain `dvc repro` reuses."""
    client = _store(tmp_path, monkeypatch)

    def run(stage, task):
        with tracking.stage_run(stage, "e", {}, tags={"task": task}) as (_, rid):
            return client.get_run(rid).data.tags[tracking.PARENT_TAG]

    plain = {run("grammar_sft@10", "grammar"), run("grammar_baseline@10-0", "grammar")}
    assert len(plain) == 1
    (group,) = plain
    g = client.get_run(group)
    assert g.info.run_name == "grammar" and g.data.tags[tracking.TASK_GROUP_TAG] == "grammar"
    assert tracking.PARENT_TAG not in g.data.tags and g.info.status == "FINISHED"
    assert run("arithmetic_sft@10", "arithmetic") != group
    exp = client.get_experiment_by_name("e").experiment_id
    sweep = client.create_run(exp, run_name="sweep").info.run_id
    monkeypatch.setenv(tracking.PARENT_ENV, sweep)
    in_sweep = {run("grammar_baseline@10-0", "grammar"), run("grammar_baseline@11-0", "grammar")}
    assert len(in_sweep) == 1 and in_sweep != plain
    assert client.get_run(in_sweep.pop()).data.tags[tracking.PARENT_TAG] == sweep
    with tracking.stage_run("no_task_stage", "e", {}) as (_, rid):  # a stage without a task nests under the sweep
        assert client.get_run(rid).data.tags[tracking.PARENT_TAG] == sweep
