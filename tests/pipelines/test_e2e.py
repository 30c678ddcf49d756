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
    "grammar": {
        "instances": [0, 1],
        "coefs": [0.1],
        "kl_targets": [0.05],
        "task": {
            "n_words": 8,
            "n_successors": 3,
            "max_new_tokens": 6,
            "n_demos": 700,
            "n_train_prompts": 64,
            "n_eval_prompts": 32,
        },
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
        "sft": {"steps": 30, "batch_size": 32, "n_heldout": 100},
        "rm": {"n_pairs": 64, "n_heldout_pairs": 32, "steps": 20, "batch_size": 16},
        "ppo": {"iterations": 3, "batch_size": 8, "minibatch_size": 4, "epochs": 1, "eval_every": 1},
    },
    "grid": {
        "arms": {
            "reward_k1": {"target": "reference", "placement": "reward", "estimator": "k1"},
            "loss_k3": {"target": "reference", "placement": "loss", "estimator": "k3"},
        },
        "seeds": [0],
        "matched": {"init_coef": 0.1, "horizon": 100},
    },
    "arithmetic": {  # RLVR: no reward-model stage
        "instances": [0],
        "coefs": [0.1],
        "kl_targets": [0.05],
        "task": {"n_digits": 2, "max_new_tokens": 4, "n_demos": 400, "n_train_prompts": 64, "n_eval_prompts": 32},
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
        "sft": {"steps": 30, "batch_size": 32, "n_heldout": 100},
        "ppo": {"iterations": 3, "batch_size": 8, "minibatch_size": 4, "epochs": 1, "eval_every": 1},
    },
    "analysis": {"reference_arm": "reward_k1"},
    "mlflow": {"experiment": "e2e"},
}
ARMS = ("reward_k1", "loss_k3")


def cell_stages(instances=(0, 1), task="grammar") -> set[str]:
    out = set()
    for i in instances:
        out |= {f"{task}_baseline@{i}-0"} | {f"{task}_fixed@{i}-{a}-0.1-0" for a in ARMS}
        out |= {f"{task}_matched@{i}-{a}-0.05-0" for a in ARMS}
    return out


ALL_CELLS = cell_stages() | cell_stages((0,), "arithmetic")  # 10 + 5


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
    assert "3 upstream chains to build: grammar_data@0, grammar_data@1, arithmetic_data@0" in out.stdout, out.stdout
    assert "dvc.lock: recorded" in out.stdout and "Running stage 'grammar_sft" not in out.stdout  # built by the pool
    assert "15 of 15 grid cells to run" in out.stdout
    finished = [line for line in out.stdout.splitlines() if re.match(r"\[\d+/15\] \S+: gold ", line)]
    assert len(finished) == 15, out.stdout  # one line per finished cell
    stats = json.loads((repo / "reports/grammar/stats.json").read_text())
    assert stats and (repo / "reports/grammar/report.md").read_text().strip()
    status = sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout
    assert json.loads(status or "{}") == {}, status
    again = sh(repo, sys.executable, "-m", "dvc", "repro").stdout
    assert "Running stage" not in again, again
    runs = visible_runs(repo)
    upstream = {f"grammar_{s}@{i}" for s in ("sft", "rm") for i in (0, 1)} | {"arithmetic_sft@0"}
    assert set(runs) == upstream | ALL_CELLS | {"grammar_analysis", "arithmetic_analysis"}  # no arithmetic_rm
    arith = json.loads((repo / "runs/arithmetic/fixed/0-loss_k3-0.1-0/summary.json").read_text())
    assert {"final_gold", "final_ood_gold", "final_accuracy", "final_kl"} <= set(arith) and "final_proxy" not in arith
    assert all(len(v) == 1 and v[0].info.status == "FINISHED" for v in runs.values())
    cell = runs["grammar_fixed@1-loss_k3-0.1-0"][0]
    assert cell.data.params["kl.estimator"] == "k3" and cell.data.tags["placement"] == "loss"
    assert "eval/gold" in cell.data.metrics and "git_commit" in cell.data.tags
    matched = runs["grammar_matched@0-reward_k1-0.05-0"][0]
    assert matched.data.params["kl.adaptive_target"] == "0.05"


def test_adding_an_instance_runs_only_its_stages_and_rerun_keeps_one_run(repo):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["grammar"]["instances"] = [0, 1, 2]
    write_params(repo, params)
    out = sh(repo, sys.executable, "-m", "dvc", "repro")
    ran = sorted(line.split("'")[1] for line in out.stdout.splitlines() if line.startswith("Running stage"))
    new = {f"grammar_{s}@2" for s in ("data", "sft", "rm")} | (cell_stages((0, 1, 2)) - cell_stages())
    assert ran == sorted(new | {"grammar_analysis"}), out.stdout
    # Re-running a cell by force leaves exactly one visible MLflow run for it.
    sh(repo, sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "grammar_baseline@2-0")
    assert len(visible_runs(repo)["grammar_baseline@2-0"]) == 1
    # Removing the instance drops it from the analysis.
    params["grammar"]["instances"] = [0, 1]
    write_params(repo, params)
    sh(repo, sys.executable, "-m", "dvc", "repro")
    assert json.loads((repo / "reports/grammar/stats.json").read_text())["n_runs"] == len(cell_stages())


def test_bad_params_fail_before_any_compute_and_write_nothing(repo):
    """One runner-level check (tests/ablations/test_config.py has every kind of bad value, fast)."""
    good = (repo / "params.yaml").read_text()
    params = yaml.safe_load(good)
    params["grid"]["arms"]["reward_k1"]["placement"] = "rewrad"
    write_params(repo, params)
    before = sorted(p for p in repo.rglob("*") if ".git" not in p.parts and p.name != "mlflow.db")
    try:
        out = sh(repo, sys.executable, "-m", "pipelines.run", check=False)
        assert out.returncode == 2 and "'reward', 'loss' or 'both'" in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1  # one message
        after = sorted(p for p in repo.rglob("*") if ".git" not in p.parts and p.name != "mlflow.db")
        assert after == before
    finally:
        (repo / "params.yaml").write_text(good)


def test_killed_cell_leaves_nothing_complete_and_is_redone(repo):
    stage, out_dir = "grammar_baseline@0-0", repo / "runs/grammar/baseline/0-0"
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["grammar"]["ppo"]["iterations"] = 400  # long enough to be killed mid-run
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
    params["grammar"]["ppo"]["iterations"] = 3
    write_params(repo, params)
    sh(repo, sys.executable, "-m", "dvc", "repro")
    assert (out_dir / "summary.json").exists()
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
