"""End to end on a tiny grid in a temporary git repository: DVC stages, the parallel runner, MLflow runs.

Slow (about two minutes): run with `make test-all`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ..conftest import repo_params

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

TINY = {
    "task": {
        "n_words": 8,
        "n_successors": 3,
        "max_new_tokens": 6,
        "n_demos": 700,
        "n_train_prompts": 64,
        "n_eval_prompts": 32,
    },
    "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
    "sft": {"steps": 30, "batch_size": 32},
    "rm": {"n_pairs": 64, "n_heldout_pairs": 32, "steps": 20, "batch_size": 16},
    "ppo": {"iterations": 3, "batch_size": 8, "minibatch_size": 4, "epochs": 1, "eval_every": 1},
    "grid": {
        "arms": {
            "reward_k1": {"target": "reference", "placement": "reward", "estimator": "k1"},
            "loss_k3": {"target": "reference", "placement": "loss", "estimator": "k3"},
        },
        "coefs": [0.1],
        "seeds": [0, 1],
    },
    "analysis": {"reference_arm": "reward_k1", "kl_budgets": [0.01, 0.02]},
    "mlflow": {"experiment": "e2e"},
}


def stage_env(repo: Path) -> dict:
    """DVC runs stage commands as `python ...`: put this interpreter first on PATH."""
    return {
        **os.environ,
        "TQDM_DISABLE": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def sh(repo: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    env = stage_env(repo)
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    if check and out.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def write_params(repo: Path, params: dict) -> None:
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def visible_runs(repo: Path, experiment: str = "e2e") -> dict[str, list]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    runs: dict[str, list] = {}
    for r in client.search_runs([exp.experiment_id], max_results=1000):
        runs.setdefault(r.data.tags["dvc_stage"], []).append(r)
    return runs


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("e2e")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if f.startswith(("rlhf/", "pipelines/", "ablations/", ".dvc/config", ".dvcignore")) or f in (
            "dvc.yaml",
            ".gitignore",
        ):
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / f, repo / f)
    write_params(repo, repo_params(TINY))
    sh(repo, "git", "init", "-q")
    sh(repo, sys.executable, "-m", "dvc", "init", "-q", "--force")
    sh(repo, sys.executable, "-m", "dvc", "config", "core.analytics", "false")
    return repo


def test_runner_then_dvc_is_clean_and_mlflow_has_one_run_per_stage(repo):
    out = sh(repo, sys.executable, "-m", "pipelines.run", "--workers", "2")
    assert "6 of 6 grid cells to run" in out.stdout
    finished = [line for line in out.stdout.splitlines() if re.match(r"\[\d/6\] \S+: gold ", line)]
    assert len(finished) == 6, out.stdout  # one line per finished cell
    stats = json.loads((repo / "reports/stats.json").read_text())
    assert stats and (repo / "reports/report.md").read_text().strip()
    status = sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout
    assert json.loads(status or "{}") == {}, status
    again = sh(repo, sys.executable, "-m", "dvc", "repro").stdout
    assert "Running stage" not in again, again
    runs = visible_runs(repo)
    expected = {"sft", "rm", "analysis", "baseline@0", "baseline@1"} | {
        f"ppo@{a}-0.1-{s}" for a in ("reward_k1", "loss_k3") for s in (0, 1)
    }
    assert set(runs) == expected
    assert all(len(v) == 1 and v[0].info.status == "FINISHED" for v in runs.values())
    cell = runs["ppo@loss_k3-0.1-1"][0]
    assert cell.data.params["kl.estimator"] == "k3" and cell.data.tags["placement"] == "loss"
    assert "eval/gold" in cell.data.metrics and "git_commit" in cell.data.tags


def test_adding_a_seed_runs_only_new_cells_and_rerun_keeps_one_run(repo):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["grid"]["seeds"] = [0, 1, 2]
    write_params(repo, params)
    out = sh(repo, sys.executable, "-m", "dvc", "repro")
    ran = sorted(line.split("'")[1] for line in out.stdout.splitlines() if line.startswith("Running stage"))
    assert ran == ["analysis", "baseline@2", "ppo@loss_k3-0.1-2", "ppo@reward_k1-0.1-2"], out.stdout
    # Re-running a cell by force leaves exactly one visible MLflow run for it.
    sh(repo, sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "baseline@2")
    assert len(visible_runs(repo)["baseline@2"]) == 1
    # Removing the seed drops it from the analysis.
    params["grid"]["seeds"] = [0, 1]
    write_params(repo, params)
    sh(repo, sys.executable, "-m", "dvc", "repro")
    assert json.loads((repo / "reports/stats.json").read_text())["n_runs"] == 6


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p["grid"]["arms"]["reward_k1"].update(placement="rewrad"), "'reward', 'loss' or 'both'"),
        (lambda p: p["grid"]["arms"]["loss_k3"].update(estimator="k4"), "'k1', 'k2', 'k3' or 'full'"),
        (lambda p: p["grid"].update(coefs=[-0.1]), "grid.coefs"),
        (lambda p: p["grid"].update(seeds=[]), "grid.seeds"),
        (lambda p: p["grid"].update(seeds=[1, 1]), "duplicate seed 1"),
        (lambda p: p["ppo"].update(learning_rate=1.0), "unknown key 'ppo.learning_rate'"),
        (lambda p: p["grid"]["arms"].update(bad={"placement": "none", "estimator": "k1"}), "no-KL baseline"),
    ],
)
def test_bad_params_fail_before_any_compute(repo, mutate, message):
    good = (repo / "params.yaml").read_text()
    params = yaml.safe_load(good)
    mutate(params)
    write_params(repo, params)
    before = sorted(p for p in repo.rglob("*") if ".git" not in p.parts and p.name != "mlflow.db")
    try:
        out = sh(repo, sys.executable, "-m", "pipelines.run", check=False)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1  # one message
        after = sorted(p for p in repo.rglob("*") if ".git" not in p.parts and p.name != "mlflow.db")
        assert after == before
    finally:
        (repo / "params.yaml").write_text(good)


def test_killed_cell_leaves_nothing_complete_and_is_redone(repo):
    stage, out_dir = "baseline@0", repo / "runs/baseline/0"
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["ppo"]["iterations"] = 400  # long enough to be killed mid-run
    write_params(repo, params)
    env = stage_env(repo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro", "--single-item", stage],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not [r for r in visible_runs(repo).get(stage, []) if r.info.status == "RUNNING"]:
        time.sleep(0.5)
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    assert not (out_dir / "summary.json").exists()
    assert stage in json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}")
    (run,) = visible_runs(repo)[stage]
    assert run.info.status == "FAILED"
    params["ppo"]["iterations"] = 3
    write_params(repo, params)
    sh(repo, sys.executable, "-m", "dvc", "repro")
    assert (out_dir / "summary.json").exists()
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
