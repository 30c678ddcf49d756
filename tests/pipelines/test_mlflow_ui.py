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
# (arm, coef, seed) of the grid cells; "none" is the no-KL baseline. Tags as pipelines/ppo.py sets them.
CELLS = [("reward_k1", 0.1, 0), ("reward_k1", 0.1, 1), ("loss_k1", 0.1, 0), ("loss_k2", 0.1, 0), ("none", 0.0, 0)]
OTHER_TASK_CELL = ("arith_k1", 0.3, 0)  # a cell of another task, which the grammar view must leave out
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


def cell_curves(arm: str, k: int) -> tuple[list[dict], list[dict]]:
    """Made-up but typical curves: without KL gold rises then falls as KL grows; other arms differ a little."""
    strength = {"none": 0.0, "reward_k1": 1.0, "loss_k1": 0.6, "loss_k2": 0.8, "arith_k1": 0.9}[arm]
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
    """A sqlite store with one finished run per stage: sft, the CELLS, and analysis (logged from the committed
    reports/). Returns {"db", "dir", "experiment_id", "runs": {stage: run_id}}."""
    from pipelines import analysis, tracking

    tmp = tmp_path_factory.mktemp("mlflow_ui")
    db = tmp / "mlflow.db"
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
        mp.setattr(tracking, "ROOT", tmp)  # artifact location
        with tracking.stage_run("sft", EXPERIMENT, {"sft": {"steps": 40}}) as (client, rid):
            tracking.log_metrics(client, rid, [{"step": i, "train_loss": 3 / (1 + i)} for i in range(40)], "", "step")
            runs["sft"] = rid
        for k, (arm, coef, seed) in enumerate([*CELLS, OTHER_TASK_CELL]):
            stage = f"baseline@{seed}" if arm == "none" else f"ppo@{arm}-{coef}-{seed}"
            tags = {
                "task": "arithmetic" if (arm, coef, seed) == OTHER_TASK_CELL else "grammar",
                "arm": arm,
                "coef": coef,
                "seed": seed,
                "target": "reference",
                "placement": "reward",
            }
            with tracking.stage_run(stage, EXPERIMENT, {"ppo": {"iterations": 30}}, tags=tags) as (client, rid):
                evals, history = cell_curves(arm, k)
                tracking.log_metrics(client, rid, history, prefix="train/")
                tracking.log_metrics(client, rid, evals, prefix="eval/")
                tracking.log_final(client, rid, {"final_gold": evals[-1]["gold"], "final_kl": evals[-1]["kl"]})
                runs[stage] = rid
        reports = tmp / "reports"
        shutil.copytree(REPO / "reports" / "grammar", reports)  # one task's analysis outputs
        written = sorted(p for p in reports.rglob("*") if p.is_file())
        with tracking.stage_run("analysis", EXPERIMENT, {"analysis": {"metric": "final_gold"}}) as (client, rid):
            analysis.log_to_mlflow(client, rid, reports, written)
            runs["analysis"] = rid
    exp_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    return {"db": db, "dir": tmp, "experiment_id": exp_id, "runs": runs}


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
    """The runs table lists each stage's run by name; above it, the description's first line points to the
    report and links the training-curves view."""
    from pipelines import tracking

    exp_id, runs = store["experiment_id"], store["runs"]
    wait = WebDriverWait(browser, PAGE_S)
    browser.get(mlflow_ui + RUNS_PAGE.format(exp_id=exp_id))
    for stage, run_id in runs.items():
        link = wait.until(
            lambda d, rid=run_id: d.find_element(By.CSS_SELECTOR, RUN_LINK.format(exp_id=exp_id, run_id=rid)),
            f"no link to run {stage} ({run_id}) in the runs table",
        )
        assert link.text.strip() == stage
    curves = wait.until(
        lambda d: d.find_element(By.LINK_TEXT, "grammar"), "no link to the grammar curves in the description"
    )
    assert curves.is_displayed()  # in the description's first paragraph, shown without expanding it
    assert curves.get_attribute("href").endswith(tracking.view_path(exp_id, "grammar"))
    line = curves.find_element(By.XPATH, "./ancestor::p").text
    assert "Answer: reports/<task>/report.md" in line and f"Training curves by arm: {', '.join(TASKS)}" in line
    screenshot(browser, store, "runs_table.png")


def test_default_chart_view_opens_on_the_held_out_curves(store, mlflow_ui, browser):
    """The chart view as MLflow builds it by default (alphabetical sections, "Model metrics" last) starts with
    the eval/* curves: the analysis run adds no section of its own before them (it used to add 81 bar charts)."""
    exp_id = store["experiment_id"]
    browser.get(mlflow_ui + RUNS_PAGE.format(exp_id=exp_id) + "&compareRunsMode=CHART")
    n = len(EVAL_KEYS)
    cards = WebDriverWait(browser, PAGE_S).until(
        lambda d: drawn_cards(d, n), f"the chart view does not open on {n} drawn line charts"
    )
    assert [card_title(c) for c in cards] == sorted(f"eval/{k}" for k in EVAL_KEYS)
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
    other = OTHER_TASK_CELL[0]
    assert other not in legend and not any(other in g for g in groups), (legend, groups)  # one task's runs only
    assert "Training curves by arm: grammar" in page  # the saved view's name, on the Views button
    browser.execute_script("window.scrollTo(0, 0);")
    screenshot(browser, store, "curves_view.png")


def test_run_metrics_tab_draws_every_logged_step(store, mlflow_ui, browser):
    """A run's "Model metrics" tab draws eval/gold with one marker per logged iteration."""
    exp_id, stage = store["experiment_id"], "ppo@reward_k1-0.1-0"
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

    exp_id, run_id = store["experiment_id"], store["runs"]["analysis"]
    comparisons = pd.read_csv(REPO / "reports" / "grammar" / "comparisons.csv")
    browser.get(f"{mlflow_ui}#/experiments/{exp_id}/runs/{run_id}/artifacts/comparisons.json")
    first = comparisons["label"].iloc[0]
    WebDriverWait(browser, PAGE_S).until(
        lambda d: first in d.find_element(By.TAG_NAME, "body").text, f"no row {first!r} in the comparisons table"
    )
    headers = [h.text.strip() for h in browser.find_elements(By.CSS_SELECTOR, '[role="table"] [role="columnheader"]')]
    headers = [h for h in headers if h]
    assert headers[:2] == ["label", "verdict"], headers
    screenshot(browser, store, "comparisons_table.png")

    run = MlflowClient(tracking_uri=f"sqlite:///{store['db']}").get_run(run_id)
    assert run.data.tags["headline"]
    assert 0 < len(run.data.metrics) < len(comparisons)
    assert not any("/" in key for key in run.data.metrics)  # filed under "Model metrics", after the curves
