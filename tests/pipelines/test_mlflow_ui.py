"""What a user sees in the MLflow UI, started as the README says, over runs logged the way the stages log them.

Logs stage runs with ``pipelines.tracking`` into a temporary sqlite store (an SFT run, a few grid cells of
different arms with their tags and ``eval/*``/``train/*`` curves, and the analysis run through
``pipelines.analysis.log_to_mlflow`` on the committed ``reports/``), starts
``mlflow ui --backend-store-uri sqlite:///<tmp>/mlflow.db --host 127.0.0.1`` on a free port and drives headless
Chromium through: the runs table with the experiment description; the chart view as it opens by default; the
training-curves view that ``make ui`` prints; a run's "Model metrics" tab; the analysis run's comparisons table.
Needs Debian's ``chromium`` and ``chromium-driver`` (/usr/bin/chromium, /usr/bin/chromedriver); skipped without
them. Slow (a few minutes on a busy 2-core machine, most of it the server's start-up and page loads): run with
`make test-all`. Screenshots of every page are left in the module's temporary folder (`pytest --basetemp=DIR` to
keep them somewhere known); docs/mlflow_ui.png is ``curves_view.png``.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from ablations.tasks import TASKS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
EXPERIMENT = "kl-placement"  # as in params.yaml, for the screenshot
# (arm, coef, instance) of the grid cells, run as today's DVC stages name them; "none" is the no-KL baseline. Tags as
# pipelines/ppo.py sets them (cell_axes).
CELLS = [("reward_k1", 0.03, 100), ("reward_k1", 0.03, 101), ("loss_k1", 0.03, 100), ("loss_k3", 0.03, 100),
         ("none", 0.0, 100)]  # fmt: skip
OTHER_TASK_CELL = ("reward_k3", 0.1, 200)  # a cell of another task (arithmetic), which the grammar view leaves out
RERUN = ("loss_k1", 0.03, 100)  # run twice: the first run stays in the store, superseded, out of the saved view
EVAL_KEYS = ["gold", "proxy", "kl", "entropy", "length", "illegal"]  # rlhf/evaluate.py
TRAIN_KEYS = ["kl_coef", "pg_loss", "vf_loss", "score", "gold_train"]
ITERATIONS = 7  # eval steps per cell
SERVER_START_S = 120  # `mlflow ui` imports a lot; on a busy 2-core machine it takes ~20-60 s to answer
PAGE_S = 60  # per-page wait for the single-page app to fetch and render

# Routes and selectors of MLflow 3.17's UI, found by inspecting its DOM; a UI upgrade may need them updated.
RUNS_PAGE = "#/experiments/{exp_id}/runs?workflowType=machine_learning"  # runs table, "Model training" workflow
RUN_LINK = 'a[href$="#/experiments/{exp_id}/runs/{run_id}"]'  # run-name cell of the runs table
CHART_CARD = '[data-testid="experiment-view-compare-runs-card"]'  # one chart card (chart view, model-metrics tab)
PLOT_POINT = ".js-plotly-plot .scatterlayer path.point"  # plotly marker of one logged step
PLOT_LINE = ".js-plotly-plot .scatterlayer path.js-line"  # plotly line of one trace
EXPAND = 'button[data-component-id$="runnamecellrenderer.tsx_46"]'  # the +/- before a parent run's name
CLOSE_ASSISTANT = '[data-component-id="mlflow.assistant.chat_panel.close"]'  # side panel, only for screenshots

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(
        f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)", allow_module_level=True
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e .[dev])")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


def stage_of(arm: str, coef: float, instance: int) -> str:
    task = "arithmetic" if instance >= 200 else "grammar"
    return f"{task}_baseline@{instance}-0" if arm == "none" else f"{task}_design@{instance}-{arm}-act-0"


def cell_curves(arm: str, k: int) -> tuple[list[dict], list[dict]]:
    """Made-up but typical curves: without KL gold rises then falls as KL grows; other arms differ a little."""
    strength = {"none": 0.0, "reward_k1": 1.0, "loss_k1": 0.6, "loss_k3": 0.8, "reward_k3": 0.9}[arm]
    evals, history = [], []
    for i in range(ITERATIONS):
        kl = (0.4 + 0.6 * (1 - strength)) * i * i / 4
        gold = 0.05 * i - 0.012 * (1 - strength) * i * i - 0.01 * k
        evals.append(
            {"iteration": 5 * i, "gold": gold, "proxy": 0.08 * i, "kl": kl, "entropy": 1.2 - 0.05 * i}
            | {"length": 8 + 0.1 * i, "illegal": 0.02 * kl}
        )
        history.append({"iteration": 5 * i, "kl_coef": 0.1 * strength, "pg_loss": -0.01, "vf_loss": 0.1 / (1 + i)})
        history[-1] |= {"score": 0.08 * i, "gold_train": gold + 0.01 * math.sin(i)}
    return evals, history


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """A sqlite store as one sweep (`make repro`) leaves it: the sweep's run, each task's group run under it, and one
    finished run per stage under its task's group: an SFT run, the CELLS (RERUN twice: its first run superseded),
    another task's cell, and the analysis (logged from the reports and views of a synthetic grammar grid, as the
    analysis stage writes them). Returns {"db", "dir", "experiment_id", "runs": {stage: run_id},
    "superseded": run_id, "sweep": run_id}."""

    from pipelines import analysis, tracking

    tmp = tmp_path_factory.mktemp("mlflow_ui")
    db = tmp / "mlflow.db"
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
        mp.setattr(tracking, "ROOT", tmp)  # artifact location
        client, exp_id = tracking.experiment_client(EXPERIMENT)
        sweep = client.create_run(exp_id, run_name="sweep 2026-12-03 08:00:00", tags={"sweep": "runner"}).info.run_id
        mp.setenv(tracking.PARENT_ENV, sweep)
        tags = {"task": "grammar", "instance": 100, "kind": "sft"}
        with tracking.stage_run("grammar_sft@100", EXPERIMENT, {"sft": {"steps": 40}}, tags=tags) as (client, rid):
            tracking.log_metrics(client, rid, [{"step": i, "train_loss": 3 / (1 + i)} for i in range(40)], "", "step")
            runs["grammar_sft@100"] = rid
        for k, (arm, coef, instance) in enumerate([RERUN, *CELLS, OTHER_TASK_CELL]):
            stage = stage_of(arm, coef, instance)
            placement = "none" if arm == "none" else arm.split("_")[0]
            tags = {
                "task": "arithmetic" if instance >= 200 else "grammar",
                "kind": "baseline" if arm == "none" else "fixed",
                "role": "-" if arm == "none" else "act",
                "instance": instance,
                "seed": 0,
                "arm": arm,
                "coef": coef,
                "target": "reference",
                "placement": placement,
                "estimator": arm[-2:] if arm != "none" else "-",
            }
            with tracking.stage_run(stage, EXPERIMENT, {"ppo": {"iterations": 30}}, tags=tags) as (client, rid):
                evals, history = cell_curves(arm, k)
                tracking.log_metrics(client, rid, history, prefix="train/")
                tracking.log_metrics(client, rid, evals, prefix="eval/")
                tracking.log_final(client, rid, {"final_gold": evals[-1]["gold"], "final_kl": evals[-1]["kl"]})
                if stage in runs:
                    superseded = runs[stage]
                runs[stage] = rid
        # one task's analysis outputs: a synthetic grammar grid whose loss_k3 collapses past 3 nats ("matters")
        from ablations import analysis as A
        from tests.ablations import synthetic as syn

        reports = tmp / "reports"
        exp = syn.write_runs(tmp / "synthetic", behaviours={"loss_k3": syn.Behaviour(crash_above=3.0)})
        res = A.analyse(syn.protocol(), exp, tmp / "synthetic", **syn.inputs())
        analysis.write_views(res.tasks["grammar"], syn.calibrated(), reports)  # metrics.json among them
        A.write_task(res, "grammar", reports)
        written = sorted(p for p in reports.rglob("*") if p.is_file())
        config = {"analysis": {"metric": "final_gold"}}
        with tracking.stage_run("grammar_analysis", EXPERIMENT, config, tags={"task": "grammar"}) as (client, rid):
            analysis.log_to_mlflow(client, rid, reports, written)
            runs["grammar_analysis"] = rid
        client.set_terminated(sweep, "FINISHED")
        groups = {r.data.tags[tracking.TASK_GROUP_TAG]: r.info.run_id
                  for r in client.search_runs([exp_id], f"tags.{tracking.TASK_GROUP_TAG} IS NOT NULL")}  # fmt: skip
    return {"db": db, "dir": tmp, "experiment_id": exp_id, "runs": runs, "superseded": superseded, "sweep": sweep,
            "groups": groups}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_log(folder: Path) -> str:
    return (folder / "mlflow_ui.log").read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def mlflow_ui(store):
    """`mlflow ui` on 127.0.0.1:<free port> over the store; yields its base URL and is always stopped."""
    folder, port = store["dir"], free_port()
    log = (folder / "mlflow_ui.log").open("w")
    env = {
        **os.environ,
        # the background job runner (GenAI judges, trace roll-ups) is not needed for runs and metric charts;
        # without it the server starts faster and leaves no huey processes behind
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{store['db']}"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    # own process group: `mlflow ui` runs uvicorn as a child, and both must go at the end
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop():
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()

    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"mlflow ui exited with {proc.returncode}:\n{server_log(folder)}")
            try:
                with urllib.request.urlopen(url + "health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"mlflow ui did not answer within {SERVER_START_S} s:\n{server_log(folder)}")
            time.sleep(0.5)
        yield url
    finally:
        stop()


@pytest.fixture
def browser(store):
    """A fresh headless Chromium per test: a new profile, as a user who never opened the UI before."""
    options = webdriver.ChromeOptions()
    for arg in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1600,1000",
    ]:
        options.add_argument(arg)
    profile = store["dir"] / f"chromium-profile-{time.monotonic_ns()}"
    options.add_argument(f"--user-data-dir={profile}")
    options.binary_location = str(CHROMIUM)
    # an explicit driver path: Selenium Manager never tries to download one
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(PAGE_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def screenshot(driver, store, name: str) -> None:
    """Closes the 'MLflow Assistant' side panel (it opens on a fresh profile) and saves the page as ``name``."""
    for button in driver.find_elements(By.CSS_SELECTOR, CLOSE_ASSISTANT):
        with contextlib.suppress(WebDriverException):  # already gone
            driver.execute_script("arguments[0].click();", button)
    time.sleep(1)
    driver.save_screenshot(str(store["dir"] / name))


def card_title(card) -> str:
    return card.text.split("\n", 1)[0].strip()


def drawn_cards(driver, n: int, has_lines: bool = True):
    """The first ``n`` chart cards in page order once each shows its title and (for line charts) a drawn line;
    False while the page is still rendering (for WebDriverWait)."""
    cards = driver.find_elements(By.CSS_SELECTOR, CHART_CARD)[:n]
    if len(cards) < n or not all(card_title(c) for c in cards):
        return False
    if has_lines and not all(c.find_elements(By.CSS_SELECTOR, PLOT_LINE) for c in cards):
        return False
    return cards


def test_runs_table_lists_stage_runs_under_the_description(store, mlflow_ui, browser):
    """The runs table opens on the sweep's run, its task group runs nested under it (named after the task) and each
    stage's run under its task's group; above it, the description's first line points to the report and links the
    training-curves view."""
    from pipelines import tracking

    exp_id, runs = store["experiment_id"], store["runs"]
    wait = WebDriverWait(browser, PAGE_S)
    browser.get(mlflow_ui + RUNS_PAGE.format(exp_id=exp_id))
    link = wait.until(
        lambda d: d.find_element(By.CSS_SELECTOR, RUN_LINK.format(exp_id=exp_id, run_id=store["sweep"])),
        "no link to the sweep's run in the runs table",
    )
    assert link.text.strip().startswith("sweep ")

    def run_link(run_id):
        return wait.until(lambda d: d.find_element(By.CSS_SELECTOR, RUN_LINK.format(exp_id=exp_id, run_id=run_id)),
                          f"no link to run {run_id} in the runs table")  # fmt: skip

    def expand(link):
        cell = link.find_element(By.XPATH, "./ancestor::div[@role='gridcell']")
        browser.execute_script("arguments[0].click();", cell.find_element(By.CSS_SELECTOR, EXPAND))

    expand(link)  # the sweep's run: one run per task under it
    assert {t: run_link(rid).text.strip() for t, rid in store["groups"].items()} == {
        "grammar": "grammar",
        "arithmetic": "arithmetic",
    }
    expand(run_link(store["groups"]["grammar"]))  # the task's run: its stage runs, the superseded one kept
    for stage, run_id in runs.items():
        if stage.startswith("grammar"):
            assert run_link(run_id).text.strip() == stage
    assert run_link(store["superseded"]).text.strip() == stage_of(*RERUN)
    curves = wait.until(
        lambda d: d.find_element(By.LINK_TEXT, "grammar"), "no link to the grammar curves in the description"
    )
    assert curves.is_displayed()  # in the description's first paragraph, shown without expanding it
    assert curves.get_attribute("href").endswith(tracking.view_path(exp_id, "grammar"))
    line = curves.find_element(By.XPATH, "./ancestor::p").text
    assert "Answer: reports/<task>/report.md" in line and f"Training curves by arm: {', '.join(TASKS)}" in line
    screenshot(browser, store, "runs_table.png")


def test_default_chart_view_opens_on_the_sweeps_answer(store, mlflow_ui, browser):
    """The chart view as MLflow builds it by default draws the runs of the table: the sweep's run, its runs folded
    under it. So it opens on the sweep's answer, one bar chart per primary comparison's estimate (and the number of
    instances), not on one chart per comparison; the training curves are in each task's saved view."""
    exp_id = store["experiment_id"]
    browser.get(mlflow_ui + RUNS_PAGE.format(exp_id=exp_id) + "&compareRunsMode=CHART")
    WebDriverWait(browser, PAGE_S).until(
        lambda d: drawn_cards(d, 3, has_lines=False), "the chart view does not open on the sweep's estimates"
    )
    from mlflow.tracking import MlflowClient

    titles = [card_title(c) for c in browser.find_elements(By.CSS_SELECTOR, CHART_CARD) if card_title(c)]
    answer = sorted(MlflowClient(tracking_uri=f"sqlite:///{store['db']}").get_run(store["sweep"]).data.metrics)
    assert len(answer) > 3 and all(k.endswith(("_estimate", "_n_instances")) for k in answer), answer
    # the cards in view (the page draws those it shows): the sweep's estimates, in MLflow's order (by name)
    assert titles and titles == answer[: len(titles)], (titles, answer)
    screenshot(browser, store, "default_chart_view.png")


def test_curves_view_shows_gold_and_kl_first_grouped_by_arm(store, mlflow_ui, browser):
    """The view `make ui` prints for a task: first eval/gold, then eval/kl, one mean curve per arm of that task
    (runs filtered by the task tag, grouped by the arm tag), then the other eval/* charts."""
    from pipelines import tracking

    exp_id = store["experiment_id"]
    browser.get(mlflow_ui + tracking.view_path(exp_id, "grammar"))
    cards = WebDriverWait(browser, PAGE_S).until(
        lambda d: drawn_cards(d, len(EVAL_KEYS)), "the training-curves view shows no drawn line charts"
    )
    titles = [card_title(c) for c in cards]
    assert titles[:2] == list(tracking.FIRST_CHARTS) == ["eval/gold", "eval/kl"]
    assert sorted(titles) == sorted(f"eval/{k}" for k in EVAL_KEYS)
    arms = sorted({arm for arm, _, _ in CELLS})
    legend = cards[0].text
    assert all(f"{arm} (eval/gold)" in legend for arm in arms), legend  # one trace per arm, named by its group
    assert len(cards[0].find_elements(By.CSS_SELECTOR, PLOT_LINE)) >= len(arms)
    page = browser.find_element(By.TAG_NAME, "body").text
    groups = [line for line in page.splitlines() if line.startswith("Group:")]  # the runs list, grouped by task, arm
    assert all(any(arm in g for g in groups) for arm in arms), groups
    lines = page.splitlines()
    assert lines[lines.index(f"Group: {RERUN[0]}") + 1] == "1"  # its superseded first run is left out
    other = OTHER_TASK_CELL[0]
    assert other not in legend and not any(other in g for g in groups), (legend, groups)  # one task's runs only
    assert "Training curves by arm: grammar" in page  # the saved view's name, on the Views button
    browser.execute_script("window.scrollTo(0, 0);")
    screenshot(browser, store, "curves_view.png")


def test_run_metrics_tab_draws_every_logged_step(store, mlflow_ui, browser):
    """A run's "Model metrics" tab draws eval/gold with one marker per logged iteration."""
    exp_id, stage = store["experiment_id"], stage_of(*CELLS[0])
    browser.get(f"{mlflow_ui}#/experiments/{exp_id}/runs/{store['runs'][stage]}/model-metrics")

    def gold_card(d):
        cards = [c for c in d.find_elements(By.CSS_SELECTOR, CHART_CARD) if "(eval/gold)" in c.text]
        return cards[0] if cards and len(cards[0].find_elements(By.CSS_SELECTOR, PLOT_POINT)) == ITERATIONS else False

    card = WebDriverWait(browser, PAGE_S).until(gold_card, f"no eval/gold chart with {ITERATIONS} points")
    assert f"{stage} (eval/gold)" in card.text  # legend names the run and the metric
    assert card.find_element(By.CSS_SELECTOR, PLOT_LINE).get_attribute("d").startswith("M")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", card)
    screenshot(browser, store, "run_metric_chart.png")


def test_analysis_run_shows_the_comparisons_as_a_table(store, mlflow_ui, browser):
    """The analysis run's Artifacts tab shows comparisons.json as a table: one row per comparison, label and
    verdict first; and the run carries a few headline scalars, not one metric per comparison."""
    from mlflow.tracking import MlflowClient

    exp_id, run_id = store["experiment_id"], store["runs"]["grammar_analysis"]
    comparisons = pd.read_csv(store["dir"] / "reports" / "comparisons.csv")
    browser.get(f"{mlflow_ui}#/experiments/{exp_id}/runs/{run_id}/artifacts/comparisons.json")
    first = comparisons["label"].iloc[0]
    WebDriverWait(browser, PAGE_S).until(
        lambda d: first in d.find_element(By.TAG_NAME, "body").text, f"no row {first!r} in the comparisons table"
    )
    headers = [h.text.strip() for h in browser.find_elements(By.CSS_SELECTOR, '[role="table"] [role="columnheader"]')]
    headers = [h for h in headers if h]
    assert headers[:2] == ["label", "verdict"], headers
    screenshot(browser, store, "comparisons_table.png")

    client = MlflowClient(tracking_uri=f"sqlite:///{store['db']}")
    run = client.get_run(run_id)
    assert run.data.tags["headline"] == "matters" and run.data.tags["same_beta_verdict"] == "material difference"
    assert run.data.tags["same_beta_label"] == "material difference"
    want = {"same_beta_estimate", "same_beta_lo", "same_beta_hi", "same_beta_n", "same_beta_cap", "beta", "margin_gold"}
    assert want | {"kl_level_1", "margin_log_kl"} <= set(run.data.metrics)
    assert not any("/" in key for key in run.data.metrics)  # filed under "Model metrics", after the curves
    sweep = client.get_run(store["sweep"])  # the sweep's run carries each task's headline and links to the report
    assert sweep.data.tags["grammar_headline"] == "matters" and "grammar_camps_estimate" in sweep.data.metrics
    assert f"runs/{run_id}/artifacts/report.md" in sweep.data.tags["mlflow.note.content"]
