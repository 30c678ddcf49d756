"""MLflow logging for the stages: one current run per DVC stage, marked FAILED if the stage dies; earlier runs kept.

Tracking URI: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<repo>/mlflow.db``; artifacts in
``<repo>/mlartifacts``. Browse with ``make ui``, which prints the address of the experiment's training-curves view
(``python -m pipelines.tracking``).

What a user sees first is set up server-side, as experiment tags the MLflow 3.17 UI reads (see ``describe``): the
experiment description (``mlflow.note.content``, markdown, shown above the runs table) and a saved view
(``mlflow.sharedViewState.<id>``, listed under *Views*) whose chart view starts with ``eval/gold`` and ``eval/kl``,
runs grouped by arm. Without it the UI orders charts alphabetically, by section (the metric key up to its last
``/``; keys without one go to "Model metrics", shown last) and by key within a section. Sources, in mlflow's
``mlflow/server/js/src/experiment-tracking/components/``: ``runs-charts/runs-charts.types.ts``
(``getBaseChartAndSectionConfigs``: the default charts), ``experiment-page/utils/savedViewEnvelope.ts`` and
``experiment-page/hooks/useSharedExperimentViewState.ts`` (saved views); checked against the 3.17.2 build by
tests/pipelines/test_mlflow_ui.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ablations.tasks import TASKS

STAGE_TAG = "dvc_stage"
REPO_TAG = "repo_root"  # the repository a run belongs to: one MLflow store may serve several (MLFLOW_TRACKING_URI)
ROOT = Path.cwd()  # stages run from the repo root (dvc.yaml's wdir)
RUNNER_LOCK = Path(".dvc/tmp/runner/lock")  # pipelines.runner.repo runner_lock: held by the grid runner while it works
RUNNER_ENV = "RLHF_RUNNER_PID"  # set by the runner for its workers and DVC calls
# The run id of the sweep (one grid-runner invocation) a stage's run nests under, set by the runner for its workers
# and DVC calls (pipelines/runner/mlflow_runs.py); a stage run by plain `dvc repro` logs a top-level run.
PARENT_ENV = "RLHF_MLFLOW_PARENT_RUN"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag of a nested run (mlflow.utils.mlflow_tags.MLFLOW_PARENT_RUN_ID)
RUN_NOTE_TAG = "mlflow.note.content"  # a run's description (markdown), shown on its page
# A re-run stage's earlier runs are kept, tagged superseded=true and superseded_by=<the new run's id>; the saved views
# show current runs only (CURRENT_FILTER).
SUPERSEDED_TAG = "superseded"
CURRENT_FILTER = f"tags.{SUPERSEDED_TAG} IS NULL"
# One run per task groups that task's stage runs (their parent), so a task's runs are one row to expand and compare:
# under a sweep's run, one per task and sweep; for stages run by plain `dvc repro`, one top-level run per task.
TASK_GROUP_TAG = "task_group"
GROUP_LOCK = Path(".dvc/tmp/mlflow-groups.lock")  # parallel stages of one task create its group run once


def flock_holder(path: Path) -> str | None:
    """The first word of ``path`` (its holder's pid) if another process holds an flock on it, else None."""
    try:
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return (f.read().split() or ["unknown"])[0]
    except FileNotFoundError:
        return None
    return None


def runner_holding() -> str | None:
    """The pid of the grid runner working in this repository (it holds RUNNER_LOCK), or None."""
    return flock_holder(ROOT / RUNNER_LOCK)


def refuse_beside_runner() -> None:
    """A stage that a plain `dvc repro` starts while the grid runner works here would delete or fail the runner's
    MLflow runs and race its outputs: it stops first, in one line (the runner's own stages pass)."""
    holder = runner_holding()
    if holder is not None and os.environ.get(RUNNER_ENV) != holder:
        sys.exit(
            f"error: the grid runner (pid {holder}) is working in this repository; `dvc repro` beside it is refused: "
            f"wait for it, or stop it with `kill {holder}`"
        )


def _ours(run) -> bool:
    """A run of this repository: tagged with its root, or untagged in the repository's own store."""
    tag = run.data.tags.get(REPO_TAG)
    return tag == str(ROOT) if tag is not None else _own_store()


def _own_store() -> bool:
    uri = tracking_uri()
    path = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    return path is not None and path.resolve().is_relative_to(ROOT.resolve())


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


def experiment_client(experiment: str):
    """(MlflowClient of the tracking URI, id of ``experiment``), creating the experiment and describing it."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(tracking_uri())
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        client.create_experiment(experiment, artifact_location=(ROOT / "mlartifacts").as_uri())
        exp = client.get_experiment_by_name(experiment)
    describe(client, exp)
    return client, exp.experiment_id


def _raise_on_term(signum, frame):
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def task_group(client, exp_id: str, task: str) -> str:
    """The id of the run that groups ``task``'s stage runs (created once, FINISHED at once: it only holds them):
    nested under the sweep's run when the grid runner runs the stage (``PARENT_ENV``), else a top-level run of this
    repository that every plain `dvc repro` of the task reuses. Named after the task, tagged ``task_group``."""
    sweep = os.environ.get(PARENT_ENV)
    where = f"tags.`{PARENT_TAG}` = '{sweep}'" if sweep else f"tags.`{PARENT_TAG}` IS NULL"
    lock = ROOT / GROUP_LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the parallel cells of a task: the first creates the group, the others find it
        found = client.search_runs([exp_id], f"tags.{TASK_GROUP_TAG} = '{task}' AND {where}", max_results=100)
        for run in found:
            if _ours(run):
                return run.info.run_id
        tags = {TASK_GROUP_TAG: task, REPO_TAG: str(ROOT), **({PARENT_TAG: sweep} if sweep else {})}
        tags[RUN_NOTE_TAG] = (
            f"Groups the stage runs of task `{task}`" + (" in this sweep" if sweep else " run by plain `dvc repro`")
            + f": expand it, or select its runs and *Compare*. Answer: `reports/{task}/report.md`."
        )  # fmt: skip
        run_id = client.create_run(exp_id, run_name=task, tags=tags).info.run_id
        client.set_terminated(run_id, "FINISHED")
        return run_id


def supersede(client, exp_id: str, stage: str, new_run_id: str) -> list[str]:
    """Tags this repository's earlier current runs of ``stage`` superseded (by ``new_run_id``); returns their ids.
    They stay in the store, with their metrics and artifacts; the saved views leave them out (CURRENT_FILTER)."""
    earlier = client.search_runs([exp_id], f"tags.{STAGE_TAG} = '{stage}' AND {CURRENT_FILTER}", max_results=1000)
    done = []
    for old in earlier:
        if old.info.run_id != new_run_id and _ours(old):  # never another repository's run of the same stage name
            client.set_tag(old.info.run_id, SUPERSEDED_TAG, "true")
            client.set_tag(old.info.run_id, "superseded_by", new_run_id)
            done.append(old.info.run_id)
    return done


@contextmanager
def stage_run(stage: str, experiment: str, config: dict, tags: dict | None = None):
    """Opens the MLflow run of ``stage``: a new run, nested under its task's group run (``task_group``) when
    ``tags`` name a task, else under the sweep's run if any; earlier runs of the same stage are kept and tagged
    superseded; the resolved config is logged as params, and the run ends FINISHED, or FAILED if the block raises
    or the process gets SIGTERM/SIGINT. Yields (client, run_id)."""
    refuse_beside_runner()
    client, exp_id = experiment_client(experiment)
    from pipelines import cpu

    all_tags = {STAGE_TAG: stage, REPO_TAG: str(ROOT), "git_commit": git_commit()}
    all_tags |= {k: str(v) for k, v in (tags or {}).items()}
    all_tags |= {f"determinism.{k}": v for k, v in cpu.settings().items()}  # what decides the float results
    task = (tags or {}).get("task")
    parent = task_group(client, exp_id, str(task)) if task else os.environ.get(PARENT_ENV)
    all_tags |= {PARENT_TAG: parent} if parent else {}
    run = client.create_run(exp_id, run_name=stage, tags=all_tags)
    run_id = run.info.run_id
    supersede(client, exp_id, stage, run_id)
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


def fault_line(e: BaseException) -> str | None:
    """One line with the way out for the faults a stage cannot fix itself (a full disk, a corrupt MLflow store),
    from any exception whose chain names one; None for anything else."""
    chain, x = [], e
    while x is not None and len(chain) < 10:
        chain.append(f"{type(x).__name__}: {x}")
        x = x.__cause__ or x.__context__
    text = " ".join(chain)
    if "No space left on device" in text or "database or disk is full" in text:
        return (
            "disk full (No space left on device); free space and rerun: cells recorded in dvc.lock are kept, the "
            "others run again"
        )
    if "DatabaseError" in text or "malformed" in text or "not a database" in text:
        uri = tracking_uri()
        store = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else uri
        return (
            f"the MLflow store {store} is corrupt ({'DatabaseError' if 'DatabaseError' in text else 'malformed'}); "
            f"results are safe in DVC (dvc.lock, runs/, reports/): move {Path(store).name} aside and rerun; MLflow "
            "then logs the runs of the stages that run from now on"
        )
    return None


def store_problem() -> str | None:
    """fault_line of the MLflow store if it exists and cannot be read (None if it reads, or does not exist)."""
    uri = _existing_store()
    if uri is None:
        return None
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as e:
        return fault_line(e) or f"the MLflow store {uri} cannot be read ({type(e).__name__}: {str(e)[:200]})"
    return None


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
            if _ours(run) and (stages is None or stage in stages):
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


def log_final(client, run_id: str, values: dict) -> None:
    log_metrics(
        client,
        run_id,
        [{"step": 0, **{k: v for k, v in values.items() if isinstance(v, (int, float))}}],
        step_key="step",
    )


# --- What a user sees first in the MLflow UI (experiment tags read by MLflow 3.17's web app) ---

DESCRIPTION_TAG = "mlflow.note.content"  # the experiment description, markdown
VIEW_TAG_PREFIX = "mlflow.sharedViewState."  # + view id: a saved view of the runs page (UI state as JSON)
CURVES_VIEW = "training-curves"  # + "-<task>": id of a task's saved view, opened by view_path()
CURVES_VIEW_NAME = "Training curves by arm"  # + ": <task>"
FIRST_CHARTS = ("eval/gold", "eval/kl")  # first charts of the saved view, in this order
GROUP_BY_TAGS = ("arm",)  # run tags a task's saved view groups its runs by (mean curve per group)
# Chart sections of the saved view, in order: MLflow files a metric under its key up to the last "/" ("Model
# metrics" when there is none); sections it finds later (new metric prefixes) are appended after these.
SECTIONS = ("eval", "train", "Model metrics", "System metrics")


def view_id(task: str) -> str:
    return f"{CURVES_VIEW}-{task}"


def view_path(experiment_id: str, task: str) -> str:
    """The web app's route (after the server address) of a task's training-curves view: the *Model training*
    workflow (the bare experiment route opens the GenAI overview), chart mode, the task's saved view (its runs
    filter is in the view: a search parameter in the route would make the web app ignore the saved view)."""
    return (
        f"#/experiments/{experiment_id}/runs?workflowType=machine_learning&compareRunsMode=CHART"
        f"&viewStateShareKey={view_id(task)}"
    )


def description(experiment_id: str, tasks=TASKS) -> str:
    """The experiment description (markdown). The UI shows only its first paragraph until expanded, so that one
    fits a line: where the answer is, and a link to each task's training-curves view."""
    views = ", ".join(f"[{task}]({view_path(experiment_id, task)})" for task in tasks)
    return f"""**Does it matter where the KL penalty goes?** Answer: `reports/<task>/report.md` (`<task>_analysis` \
runs). Training curves by arm: {views}.

- **Runs**: one per DVC stage run (the data stages log none), named after the stage (`dvc.yaml`; tag \
`dvc_stage`), nested under its task's run (named after the task, tag `task_group`: expand it, or select its runs and \
*Compare*), which nests under the run of the sweep (`make repro`, tag `sweep`: each task's headline as metrics) that \
ran it; stages run by plain `dvc repro` nest under one top-level run per task. Re-running a stage gives it a new run \
and keeps the earlier one, tagged `superseded` (the saved views show current runs only: \
`tags.superseded IS NULL`); a stage that died leaves its run *Failed*. Filter one task with `tags.task = "grammar"`.
- **Tags**: a grid cell's axes (`task`, `kind`, `instance`, `arm`, `coef`, `kl_target`, `placement`, `estimator`, \
`target`, ...) and `git_commit`. \
Filter with e.g. `tags.arm = "loss_k3"`, or *Group by* a tag.
- **Metrics** by PPO iteration: `eval/*`, the held-out measurement every arm shares (gold reward, exact \
KL(π‖π_ref), proxy reward, entropy, length, share of ungrammatical words), and `train/*`, each arm's own training \
statistics; `final_*`/`peak_*`, a cell's summary; the `<task>_analysis` runs' headline metrics \
(`reports/<task>/metrics.json`: each primary question's estimate, CI and n; verdicts as tags).
- **Artifacts**: each cell's `curves.png`; each `<task>_analysis` run's report, figures (`figures/arms.png`: gold by \
arm with an instance band; `figures/frontier.png`: gold against KL per placement; `figures/differences.png`: each \
primary question's paired differences) and every comparison as a table (`comparisons.json`: *View as table*).
- **Params**: the stage's resolved configuration from `params.yaml`.
"""


def curves_view_state(task: str) -> dict:
    """The runs-page state of a task's training-curves view, in the MLflow 3.17 web app's format (the search facet
    ``searchFilter`` and fields of its ``ExperimentPageUIState``; the web app fills in every field left out with its
    default): chart mode is set by the URL, this sets the task's current runs (superseded ones left out), the
    charts, their sections and the grouping by arm, so the first chart compares the arms of one task."""
    sections = [
        {"uuid": f"section-{i}", "name": name, "display": True, "isReordered": True, "deleted": False}
        for i, name in enumerate(SECTIONS)
    ]
    charts = [
        {
            "uuid": f"chart-{key}",
            "type": "LINE",
            "isGenerated": False,
            "deleted": False,
            "metricSectionId": sections[0]["uuid"],
            "metricKey": key,
            "selectedMetricKeys": [key],
            "xAxisKey": "step",
            "xAxisScaleType": "linear",
            "scaleType": "linear",
            "lineSmoothness": 0,
            "selectedXAxisMetricKey": "",
            "useGlobalXaxisKey": False,
            "useGlobalLineSmoothing": False,
            "runsCountToCompare": 10,
        }
        for key in FIRST_CHARTS
    ]
    return {
        "searchFilter": f"tags.task = '{task}' AND {CURRENT_FILTER}",
        "compareRunCharts": charts,
        "compareRunSections": sections,
        "isAccordionReordered": True,  # keep SECTIONS' order (the web app would sort them by name)
        "groupBy": {
            "aggregateFunction": "average",
            "groupByKeys": [{"mode": "tag", "groupByData": t} for t in GROUP_BY_TAGS],
        },
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
    }


def describe(client, experiment, tasks=TASKS) -> None:
    """Sets the experiment's description and each task's training-curves view; writes only what differs, so the
    parallel stages of a grid, which all call this, write nothing once the first one has."""
    tags = {DESCRIPTION_TAG: description(experiment.experiment_id, tasks)}
    for task in tasks:  # a saved view: {"name", "createdAt" (ms), "state": the UI state as a JSON string}
        view = {"name": f"{CURVES_VIEW_NAME}: {task}", "createdAt": 0, "state": json.dumps(curves_view_state(task))}
        tags[VIEW_TAG_PREFIX + view_id(task)] = json.dumps(view)
    for key, value in tags.items():
        if experiment.tags.get(key) != value:
            client.set_experiment_tag(experiment.experiment_id, key, value)


def log_csv_table(client, run_id: str, csv_path: Path, artifact_file: str, first: tuple[str, ...] = ()) -> None:
    """Logs a CSV file as an MLflow table artifact (JSON, shown as a table on the run's Artifacts tab and in the
    runs page's artifact view), with its columns named in ``first`` moved to the front."""
    import pandas as pd

    table = pd.read_csv(csv_path)
    front = [c for c in first if c in table.columns]
    client.log_table(
        run_id, data=table[front + [c for c in table.columns if c not in front]], artifact_file=artifact_file
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m pipelines.tracking [params.yaml] [--url http://127.0.0.1:5000]``, run by ``make ui`` before the
    server starts: brings the description and the training-curves view of the experiment named in params.yaml up
    to date (a store written before they existed gets them too) and prints the address of that view."""
    import argparse

    from ablations.experiment import PARAMS_FILE, load_experiment

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("params", nargs="?", default=PARAMS_FILE)
    ap.add_argument("--url", default="http://127.0.0.1:5000")
    args = ap.parse_args(argv)
    name = load_experiment(args.params).mlflow.experiment
    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        print(f"no MLflow store at {uri} yet: run the pipeline first (`make repro`)")
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        print(f"no experiment {name!r} in {uri} yet: run the pipeline first (`make repro`)")
        return
    describe(client, exp)
    for task in TASKS:
        url = f"{args.url.rstrip('/')}/{view_path(exp.experiment_id, task)}"
        print(f"Experiment {name!r}, training curves by arm of task {task}: {url}")


if __name__ == "__main__":
    main()
