"""DVC's show commands on this pipeline: each task's metrics.json is the only metrics file (cells' summaries are plain
outputs), the top-level plots draw each task's views, and a variation runs as a DVC experiment through the grid
runner (`python -m pipelines.exp`), shown by `dvc exp show` beside the workspace."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from ablations.tasks import TASKS
from tests.conftest import repo_params
from tests.helpers import REPO
from tests.pipelines.tiny import TINY, cell_stages, make_repo, sh, stage_env

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def declared(entries) -> list[str]:
    return [next(iter(m)) if isinstance(m, dict) else m for m in entries or []]


def test_only_each_tasks_metrics_json_is_declared_as_metrics_and_its_views_as_top_level_plots():
    doc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    metrics = [m for stage in doc["stages"].values() for m in declared(stage.get("metrics"))]
    assert sorted(metrics) == sorted(f"reports/{t}/metrics.json" for t in TASKS)
    assert not any(stage.get("plots") for stage in doc["stages"].values())  # no per-cell single-run plots
    plots = {next(iter(p)): next(iter(p.values())) for p in doc["plots"]}
    assert set(plots) == {f"{t}_{v}" for t in TASKS for v in ("arms", "frontier", "differences")}
    for name, spec in plots.items():
        task, view = name.rsplit("_", 1)
        assert list(spec["y"]) == [f"reports/{task}/plots/{view}.json"]
        assert (REPO / ".dvc" / "plots" / f"{spec['template']}.json").is_file()
    for t in TASKS:
        outs = declared(doc["stages"][f"{t}_analysis"]["outs"])
        assert {f"reports/{t}/stats.json", f"reports/{t}/plots"} <= set(outs)


def exp_rows(repo) -> dict[str, dict]:
    """`dvc exp show --json` as {experiment name or "workspace": {"params": ..., "metrics": ...}}."""
    rows = {}
    for commit in json.loads(sh(repo, sys.executable, "-m", "dvc", "exp", "show", "--json").stdout):
        for exp in [commit] + [e for x in commit.get("experiments") or [] for e in x.get("revs") or []]:
            data = exp.get("data") or {}
            name = exp.get("name") or data.get("name") or data.get("rev")
            params = (data.get("params") or {}).get("params.yaml", {}).get("data", {})
            metrics = {k: v.get("data", {}) for k, v in (data.get("metrics") or {}).items()}
            rows[name] = {"params": params, "metrics": metrics}
    return rows


@pytest.mark.slow
def test_exp_run_by_the_runner_runs_only_the_new_cells_and_shows_beside_the_workspace(tmp_path):
    """The tiny grid, committed; then `python -m pipelines.exp run -S 'grammar.coefs=[0.3]'` runs only the 8 new
    exploratory cells (4 arms x 2 instances) and the analysis, in parallel, and saves a DVC experiment that
    `dvc exp show` lists beside the workspace with the headline metrics; a queued variation runs from the commit's
    state with `start`. `dvc exp show` fits an 80-column terminal with the headline in view."""
    repo = make_repo(tmp_path, repo_params(TINY))
    run = [sys.executable, "-m", "pipelines.run", "--workers", "2"]
    sh(repo, *run)
    sh(repo, *GIT, "add", "-A")
    sh(repo, *GIT, "commit", "-qm", "tiny grid")
    out = sh(repo, sys.executable, "-m", "pipelines.exp", "run", "-n", "coef03", "-S", "grammar.coefs=[0.3]", "--",
             "--workers", "2")  # fmt: skip
    n_arms, n_grid = len(TINY["grid"]["arms"]), len(cell_stages())
    new = f"{2 * n_arms} of {n_grid + 2 * n_arms} grid cells to run"  # every arm at 0.3 on instances 10 and 11
    assert "0 of 7 calibration cells to run" in out.stdout and "0 of 30 planning cells to run" in out.stdout
    assert new in out.stdout, out.stdout
    finished = re.findall(rf"^\[\d+/{2 * n_arms + 1}\] (\S+): gold ", out.stdout, re.MULTILINE)  # cells + analysis
    assert sorted(finished) == sorted(f"grammar_fixed@{i}-{a}-0.3-0" for i in (10, 11) for a in TINY["grid"]["arms"])
    rows = exp_rows(repo)
    assert rows["coef03"]["params"]["grammar"]["coefs"] == [0.3]
    base = next(v for k, v in rows.items() if k not in ("workspace", "coef03"))
    assert base["params"]["grammar"]["coefs"] == []
    for row in (rows["coef03"], base):
        m = row["metrics"]["reports/grammar/metrics.json"]
        assert m["headline"] and m["n_instances"] == 2 and "same_beta_verdict" in m and "same_beta_n" in m
        assert "beta" in m and "kl_level_1" in m and "frontier_level2_cap" in m
    # the queue: each variation from the commit's state, the runner for each
    sh(repo, sys.executable, "-m", "pipelines.exp", "run", "--queue", "-n", "kl2", "-S", "grammar.kl_targets=[2.0]")
    assert "kl2: -S grammar.kl_targets=[2.0]" in sh(repo, sys.executable, "-m", "pipelines.exp", "queue").stdout
    out = sh(repo, sys.executable, "-m", "pipelines.exp", "start", "--", "--workers", "2").stdout
    assert new in out, out  # each arm steered to 2 nats; coefs back to the commit's []
    rows = exp_rows(repo)
    assert rows["kl2"]["params"]["grammar"]["kl_targets"] == [2.0] and rows["kl2"]["params"]["grammar"]["coefs"] == []
    # the table as `dvc exp show` prints it (in a terminal through `less -RS`): its first screen, 160 columns, shows
    # each experiment with the task's headline and the first primary comparison
    env = {**stage_env(repo), "COLUMNS": "160"}
    table = subprocess.run([sys.executable, "-m", "dvc", "exp", "show"], cwd=repo, env=env, capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    screen = [line[:160] for line in table.splitlines()]
    header = next(line for line in screen if "Experiment" in line).split()
    assert header[:4] == ["Experiment", "Created", "headline", "same_beta_verdict"], header
    for name in ("coef03", "kl2", "workspace"):
        row = next(line for line in screen if name in line)
        assert any(v in row for v in ("matters", "not settled", "does not matter")), row
    sh(repo, sys.executable, "-m", "pipelines.profile", "--reset")
    assert yaml.safe_load((repo / "params.yaml").read_text())["grammar"]["kl_targets"] == []
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
    queue = repo / ".dvc/tmp/exps-queue.jsonl"
    assert not os.path.exists(queue) or not queue.read_text()  # the queue is done
