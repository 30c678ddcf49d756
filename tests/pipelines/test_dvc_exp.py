"""`dvc exp` on this pipeline: the analysis stages declare each task's headline metrics (reports/<task>/stats.json),
so `dvc exp show` lists them, and `dvc exp run -S <key>=<value>` accepts params.yaml keys (queued, not run)."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from ablations.tasks import TASKS
from tests.conftest import repo_params
from tests.helpers import REPO
from tests.pipelines.tiny import TINY, make_repo, sh


def test_each_analysis_stage_declares_its_stats_as_metrics():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for task in TASKS:
        metrics = [next(iter(m)) if isinstance(m, dict) else m for m in stages[f"{task}_analysis"]["metrics"]]
        assert f"reports/{task}/stats.json" in metrics


@pytest.mark.slow
def test_exp_show_lists_the_headline_and_exp_run_accepts_a_params_key(tmp_path):
    repo = make_repo(tmp_path, repo_params(TINY))
    stats = repo / "reports" / "grammar" / "stats.json"
    stats.parent.mkdir(parents=True)
    stats.write_text(json.dumps({"headline": "not settled", "n_instances": 2, "primary": {"Q1": {"n": 2}}}))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    sh(repo, *git, "add", "-A")
    sh(repo, *git, "commit", "-qm", "tiny")
    shown = json.loads(sh(repo, sys.executable, "-m", "dvc", "exp", "show", "--json").stdout)
    assert "not settled" in json.dumps(shown) and "n_instances" in json.dumps(shown)
    # --queue: the experiment is set up (params.yaml changed by -S in its own commit) and not run
    queued = sh(repo, sys.executable, "-m", "dvc", "exp", "run", "--queue", "-S", "grammar.ppo.lr=0.002", check=False)
    assert queued.returncode == 0, queued.stderr
    shown = json.dumps(json.loads(sh(repo, sys.executable, "-m", "dvc", "exp", "show", "--json").stdout))
    assert '"lr": 0.002' in shown, shown[:3000]
    sh(repo, sys.executable, "-m", "dvc", "queue", "remove", "--all")
