"""End to end on a tiny grid in a temporary git repository: DVC stages, the parallel runner, MLflow runs.

Slow (about two minutes): run with `make test-all`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.pipelines.tiny import ALL_CELLS, TINY, cell_stages, sh, stage_env, visible_runs, write_params

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def md5(path: Path) -> str:
    import hashlib

    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ran(repo) -> dict:
    """The tiny grid run once by the runner in the module's repository, and what it left right after: the runner's
    stdout, `dvc status`, what a second `dvc repro` runs, the MLflow runs. Every test of this module that needs
    results depends on it, so each passes alone and in any order (issue 30)."""
    out = sh(repo, sys.executable, "-m", "pipelines.run", "--workers", "2")
    status = json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}")
    again = sh(repo, sys.executable, "-m", "dvc", "repro").stdout
    return {"out": out, "status": status, "again": again, "runs": visible_runs(repo)}


def test_runner_then_dvc_is_clean_and_mlflow_has_one_run_per_stage(repo, ran):
    out = ran["out"]
    chains = "3 upstream chains to build: grammar_calibration_data@0, grammar_data@10, grammar_data@11"
    assert chains in out.stdout, out.stdout
    assert "dvc.lock: recorded" in out.stdout and "Running stage" not in out.stdout  # all in the pool, none by DVC
    # the calibration wave, then the calibrate stage (in a worker), the evaluation wave, then the analysis (ditto)
    waves = [
        "7 of 7 calibration cells to run",
        "[8/8] grammar_calibrate: (",
        "18 of 18 grid cells to run",
        "[19/19] grammar_analysis: (",
    ]
    at = [out.stdout.index(w) for w in waves]
    assert at == sorted(at), out.stdout
    for n in (7, 18):  # one line per finished cell; each wave's count includes its tail (calibrate, analysis)
        finished = [line for line in out.stdout.splitlines() if re.match(rf"\[\d+/{n + 1}\] \S+: gold ", line)]
        assert len(finished) == n, out.stdout
    stats = json.loads((repo / "reports/grammar/stats.json").read_text())
    assert stats["n_runs"] == 18 and set(stats["primary"]) == {"Q1", "Q2", "Q3", "Q4"}
    assert (repo / "reports/grammar/report.md").read_text().strip()
    assert (repo / "reports/grammar/answer.md").read_text().strip()
    assert ran["status"] == {}, ran["status"]
    assert "Running stage" not in ran["again"], ran["again"]
    runs = ran["runs"]
    upstream = {f"grammar_{s}@{i}" for s in ("sft", "rm") for i in (10, 11)}
    upstream |= {"grammar_calibration_sft@0", "grammar_calibration_rm@0"}
    assert set(runs) == upstream | ALL_CELLS | {"grammar_analysis"}
    assert all(len(v) == 1 and v[0].info.status == "FINISHED" for v in runs.values())
    # design cells run at the values the calibration fixed (protocol/grammar.json)
    protocol = json.loads((repo / "protocol/grammar.json").read_text())
    assert protocol["calibration_instances"] == [0] and protocol["margins"]["gold"] > 0
    for cell in ("reward_k1-coef", "reward_k1-control", "loss_k3-tuned", "loss_k3-target"):
        summary = json.loads((repo / f"runs/grammar/design/10-{cell}-0/summary.json").read_text())
        arm, role = cell.rsplit("-", 1)
        assert summary["role"] == role and summary["arm"] == arm
        assert summary["kind"] == ("matched" if role == "target" else "fixed")
        if role == "target":
            assert summary["kl_target"] == pytest.approx(protocol["kl_target"])
        else:
            want = {"coef": protocol["coef"], "control": protocol["control_coef"], "tuned": protocol["tuned"][arm]}
            assert summary["coef"] == pytest.approx(want[role])
    cell = runs["grammar_design@11-loss_k3-coef-0"][0]
    assert cell.data.params["kl.estimator"] == "k3" and cell.data.tags["placement"] == "loss"
    assert "eval/gold" in cell.data.metrics and "git_commit" in cell.data.tags
    matched = runs["grammar_design@10-reward_k3-target-0"][0]
    assert float(matched.data.params["kl.adaptive_target"]) == pytest.approx(protocol["kl_target"])


def test_no_design_cell_can_run_before_the_calibration(repo, ran):
    """Every design cell depends on the calibration's output: dvc.lock records protocol/grammar.json (its md5 now)
    in each design cell's deps, so a changed protocol makes every design cell stale and no other evaluation cell."""
    protocol = repo / "protocol/grammar.json"
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    design = {s for s in ALL_CELLS if s.startswith("grammar_design@")}
    assert len(design) == 16
    for stage in design:
        deps = {d["path"]: d for d in lock[stage]["deps"]}
        assert deps["protocol/grammar.json"]["md5"] == md5(protocol), stage
    for stage in ALL_CELLS - design:  # baselines and calibration cells do not depend on it
        assert "protocol/grammar.json" not in {d["path"] for d in lock[stage]["deps"]}, stage
    assert lock["grammar_calibrate"]["outs"][0]["path"] == "protocol/grammar.json"
    good = protocol.read_text()
    try:
        protocol.write_text(good.replace('"coef": ', '"coef":  ', 1))
        stale = set(json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}"))
        assert stale == design | {"grammar_calibrate", "grammar_analysis"}, stale
    finally:
        protocol.write_text(good)
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
    # a design cell run by hand without the protocol refuses in one line (pipelines/ppo.py)
    protocol.rename(repo / "protocol.json.away")
    try:
        out = sh(repo, sys.executable, "-m", "pipelines.ppo", "grammar_design@10-reward_k1-coef-0", check=False)
        assert out.returncode != 0 and "run the calibration first (dvc repro grammar_calibrate)" in out.stderr
    finally:
        (repo / "protocol.json.away").rename(protocol)


def test_adding_an_instance_runs_only_its_stages_and_rerun_keeps_one_run(repo, ran):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["grammar"]["instances"] = [10, 11, 12]
    params["analysis"]["sequential"]["batch_size"] = 1  # whole batches; the cells do not depend on it
    write_params(repo, params)
    out = sh(repo, sys.executable, "-m", "pipelines.run", "--workers", "2").stdout
    assert "1 upstream chains to build: grammar_data@12\n" in out, out
    assert "0 of 7 calibration cells to run" in out and "9 of 27 grid cells to run" in out, out
    finished = {m[1] for m in re.finditer(r"^\[\d+/10\] (\S+): gold ", out, re.MULTILINE)}  # 9 cells + analysis
    assert finished == cell_stages((12,)), out
    ran = re.findall(r"^\[\d+/10\] (grammar_\w+): \(", out, re.MULTILINE)
    assert ran == ["grammar_analysis"] and "Running stage" not in out, out  # the calibration stage did not rerun
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
    # Re-running a cell by force leaves exactly one visible MLflow run for it.
    sh(repo, sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "grammar_baseline@12-0")
    assert len(visible_runs(repo)["grammar_baseline@12-0"]) == 1
    # Removing the instance drops it from the analysis.
    params["grammar"]["instances"] = [10, 11]
    params["analysis"]["sequential"]["batch_size"] = TINY["analysis"]["sequential"]["batch_size"]
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


def test_killed_cell_leaves_nothing_complete_and_is_redone(repo, ran):
    stage, out_dir = "grammar_baseline@10-0", repo / "runs/grammar/baseline/10-0"
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
    params["grammar"]["ppo"]["iterations"] = TINY["grammar"]["ppo"]["iterations"]
    write_params(repo, params)
    sh(repo, sys.executable, "-m", "dvc", "repro")
    assert (out_dir / "summary.json").exists()
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
