"""The MLflow UI, as the README tells users to start it, lists the stage runs and draws their metric charts.

Logs two fake stage runs with ``pipelines.tracking`` into a temporary sqlite store, starts
``mlflow ui --backend-store-uri sqlite:///<tmp>/mlflow.db --host 127.0.0.1`` on a free port and drives headless
Chromium through the runs table and a run's "Model metrics" tab. Needs Debian's ``chromium`` and
``chromium-driver`` (/usr/bin/chromium, /usr/bin/chromedriver); skipped without them. Slow (about a minute, most
of it the server's start-up): run with `make test-all`. Screenshots of both pages are left in tmp_path
(`pytest --basetemp=DIR` to keep them somewhere known).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
EXPERIMENT = "ui-check"
STAGES = ["ppo@reward_k1-0.1-0", "baseline@0"]
ITERATIONS = 5
SERVER_START_S = 90  # `mlflow ui` imports a lot; on a 2-core machine it takes ~20-40 s to answer
PAGE_S = 30  # per-page wait for the single-page app to fetch and render

# Routes and selectors of MLflow 3.17's UI, found by inspecting its DOM; a UI upgrade may need them updated.
RUN_LINK = 'a[href$="#/experiments/{exp_id}/runs/{run_id}"]'  # run-name cell of the runs table
CHART_CARD = '[data-testid="experiment-view-compare-runs-card"]'  # one chart card on the model-metrics tab
PLOT_POINT = ".js-plotly-plot .scatterlayer path.point"  # plotly marker of one logged step
CLOSE_ASSISTANT = '[data-component-id="mlflow.assistant.chat_panel.close"]'  # side panel, only for the screenshot

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(
        f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)", allow_module_level=True
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e .[dev])")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def store(tmp_path, monkeypatch) -> dict:
    """A sqlite store in tmp_path with one finished run per stage, each with ITERATIONS steps of eval/gold and
    eval/kl. Returns {"db": path, "experiment_id": ..., "runs": {stage: run_id}}."""
    from pipelines import tracking

    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.setattr(tracking, "ROOT", tmp_path)  # artifact location
    monkeypatch.chdir(tmp_path)
    runs = {}
    for k, stage in enumerate(STAGES):
        with tracking.stage_run(stage, EXPERIMENT, {"stage": stage, "ppo": {"iterations": ITERATIONS}}) as (c, rid):
            rows = [{"iteration": i, "gold": 0.1 * i * (k + 1), "kl": 0.01 * i * i} for i in range(ITERATIONS)]
            tracking.log_metrics(c, rid, rows, prefix="eval/")
            runs[stage] = rid
    exp_id = c.get_experiment_by_name(EXPERIMENT).experiment_id
    return {"db": db, "experiment_id": exp_id, "runs": runs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_ui(store, tmp_path):
    """`mlflow ui` on 127.0.0.1:<free port> over the store; yields its base URL and is always stopped."""
    port = free_port()
    log = (tmp_path / "mlflow_ui.log").open("w")
    env = {
        **os.environ,
        # the background job runner (GenAI judges, trace roll-ups) is not needed for runs and metric charts;
        # without it the server starts faster and leaves no huey processes behind
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        f"sqlite:///{store['db']}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # own process group: `mlflow ui` runs uvicorn as a child, and both must go at the end
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

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
                raise AssertionError(f"mlflow ui exited with {proc.returncode}:\n{server_log(tmp_path)}")
            try:
                with urllib.request.urlopen(url + "health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"mlflow ui did not answer within {SERVER_START_S} s:\n{server_log(tmp_path)}")
            time.sleep(0.5)
        yield url
    finally:
        stop()


def server_log(tmp_path: Path) -> str:
    return (tmp_path / "mlflow_ui.log").read_text(errors="replace")[-3000:]


@pytest.fixture
def browser(tmp_path):
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
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ]:
        options.add_argument(arg)
    options.binary_location = str(CHROMIUM)
    # an explicit driver path: Selenium Manager never tries to download one
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(PAGE_S)
    try:
        yield driver
    finally:
        driver.quit()


def close_assistant_panel(driver) -> None:
    """The 'MLflow Assistant' side panel opens on a fresh profile; close it so the screenshot shows the charts."""
    for button in driver.find_elements(By.CSS_SELECTOR, CLOSE_ASSISTANT):
        if button.is_displayed():
            button.click()


def rendered_points(card) -> int:
    return len(card.find_elements(By.CSS_SELECTOR, PLOT_POINT))


def test_runs_and_metric_chart_show_in_mlflow_ui(store, mlflow_ui, browser, tmp_path):
    exp_id, runs = store["experiment_id"], store["runs"]
    wait = WebDriverWait(browser, PAGE_S)

    # 1. The experiment's runs table (the "Model training" view; the bare experiment URL opens the GenAI
    # overview) lists both stage runs by name, each linking to its run page.
    browser.get(f"{mlflow_ui}#/experiments/{exp_id}/runs?workflowType=machine_learning")
    for stage, run_id in runs.items():
        link = wait.until(
            lambda d, rid=run_id: d.find_element(By.CSS_SELECTOR, RUN_LINK.format(exp_id=exp_id, run_id=rid)),
            f"no link to run {stage} ({run_id}) in the runs table",
        )
        assert link.text.strip() == stage
    browser.save_screenshot(str(tmp_path / "mlflow_runs.png"))

    # 2. A run's "Model metrics" tab draws a plotly chart of eval/gold with one marker per logged iteration.
    stage = STAGES[0]
    browser.get(f"{mlflow_ui}#/experiments/{exp_id}/runs/{runs[stage]}/model-metrics")
    close_assistant_panel(browser)

    def gold_card(d):
        cards = [c for c in d.find_elements(By.CSS_SELECTOR, CHART_CARD) if "(eval/gold)" in c.text]
        return cards[0] if cards and rendered_points(cards[0]) == ITERATIONS else False

    card = wait.until(gold_card, f"no eval/gold chart with {ITERATIONS} plotted points on the run's metrics tab")
    assert f"{stage} (eval/gold)" in card.text  # legend names the run and the metric
    line = card.find_element(By.CSS_SELECTOR, ".js-plotly-plot .scatterlayer path.js-line")
    assert line.get_attribute("d").startswith("M"), "the eval/gold trace has no line"
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", card)
    browser.save_screenshot(str(tmp_path / "mlflow_metric_chart.png"))  # docs/mlflow_ui.png is one of these
