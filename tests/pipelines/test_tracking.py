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
    assert state["searchFilter"] == "tags.task = 'grammar'"  # the task's runs only
    assert saved_view(exp.tags, "arithmetic")[1]["searchFilter"] == "tags.task = 'arithmetic'"
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
