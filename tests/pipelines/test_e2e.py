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

from tests.ablations.synthetic import comparison_names
from tests.pipelines.tiny import (
    ALL_CELLS,
    CAL_CELLS,
    PLAN_CELLS,
    TINY,
    cell_stages,
    sh,
    stage_env,
    visible_runs,
    write_params,
)

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
    chains = (
        "5 upstream chains to build: grammar_calibration_data@0, grammar_plan_data@1, grammar_plan_data@2, "
        "grammar_data@10, grammar_data@11"
    )
    assert chains in out.stdout, out.stdout
    assert "dvc.lock: recorded" in out.stdout and "Running stage" not in out.stdout  # all in the pool, none by DVC
    # the calibration wave, then the calibrate stage (in a worker), the planning wave, then the planning stage
    # (ditto), the evaluation wave, then the analysis (ditto)
    n_cal, n_plan, n_eval = len(CAL_CELLS), len(PLAN_CELLS), len(cell_stages())  # 7, 30, 28
    waves = [
        f"{n_cal} of {n_cal} calibration cells to run",
        f"[{n_cal + 1}/{n_cal + 1}] grammar_calibrate: (",
        f"{n_plan} of {n_plan} planning cells to run",
        f"[{n_plan + 1}/{n_plan + 1}] grammar_planning: (",
        f"{n_eval} of {n_eval} grid cells to run",
        f"[{n_eval + 1}/{n_eval + 1}] grammar_analysis: (",
    ]
    at = [out.stdout.index(w) for w in waves]
    assert at == sorted(at), out.stdout
    for n in (n_cal, n_plan, n_eval):  # one line per finished cell, numbered with its wave's tail stage
        finished = [line for line in out.stdout.splitlines() if re.match(rf"\[\d+/{n + 1}\] \S+: gold ", line)]
        assert len(finished) == n, out.stdout
    stats = json.loads((repo / "reports/grammar/stats.json").read_text())
    assert stats["n_runs"] == n_eval and list(stats["primary"]) == comparison_names()
    plan = json.loads((repo / "protocol/grammar.plan.json").read_text())
    assert plan["plan_instances"] == [1, 2] and set(plan["comparisons"]) == set(comparison_names())
    assert all(c["cap"] % 2 == 0 and c["cap"] <= 4 for c in plan["comparisons"].values())  # batches of 2, max 4
    assert (repo / "reports/grammar/report.md").read_text().strip()
    assert (repo / "reports/grammar/answer.md").read_text().strip()
    assert ran["status"] == {}, ran["status"]
    assert "Running stage" not in ran["again"], ran["again"]
    runs = ran["runs"]
    upstream = {f"grammar_{s}@{i}" for s in ("sft", "rm") for i in (10, 11)}
    upstream |= {"grammar_calibration_sft@0", "grammar_calibration_rm@0"}
    upstream |= {f"grammar_plan_{s}@{i}" for s in ("sft", "rm") for i in (1, 2)}
    assert set(runs) == upstream | ALL_CELLS | {"grammar_analysis"}
    assert all(len(v) == 1 and v[0].info.status == "FINISHED" for v in runs.values())
    # design cells run at the values the calibration fixed (protocol/grammar.json)
    protocol = json.loads((repo / "protocol/grammar.json").read_text())
    assert protocol["calibration_instances"] == [0] and protocol["margins"]["gold"] > 0
    assert protocol["margins"]["log_kl"] > 0 and len(protocol["levels"]) == 3
    for cell in ("reward_k1-act", "reward_k1-control", "loss_k3-tuned", "loss_k3-level2"):
        for where in ("design/10", "plan/1"):  # an evaluation and a planning instance: the same calibrated values
            summary = json.loads((repo / f"runs/grammar/{where}-{cell}-0/summary.json").read_text())
            arm, role = cell.rsplit("-", 1)
            assert summary["role"] == role and summary["arm"] == arm
            assert summary["kind"] == ("matched" if role.startswith("level") else "fixed")
            if role.startswith("level"):
                assert summary["kl_target"] == pytest.approx(protocol["levels"][1])
            else:
                want = {"act": protocol["coef"], "control": protocol["control_coef"], "tuned": protocol["tuned"][arm]}
                assert summary["coef"] == pytest.approx(want[role])
    cell = runs["grammar_design_same_beta@11-loss_k3-act-0"][0]
    assert cell.data.params["kl.estimator"] == "k3" and cell.data.tags["placement"] == "loss"
    assert "eval/gold" in cell.data.metrics and "git_commit" in cell.data.tags
    matched = runs["grammar_design_frontier_reward@10-reward_k1-level1-0"][0]
    assert float(matched.data.params["kl.adaptive_target"]) == pytest.approx(protocol["levels"][0])


def test_no_design_cell_can_run_before_the_calibration(repo, ran):
    """Every design and plan cell depends on the calibration's output: dvc.lock records protocol/grammar.json (its md5
    now) in each one's deps, so a changed protocol makes every design and plan cell (and the planning stage) stale
    and no other cell."""
    protocol = repo / "protocol/grammar.json"
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    design = {s for s in ALL_CELLS if s.startswith(("grammar_design", "grammar_plan@", "grammar_plan_"))}
    design -= {s for s in ALL_CELLS if s.startswith("grammar_plan_baseline@")}
    assert len(design) == 2 * 13 + 2 * 14
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
        assert stale == design | {"grammar_calibrate", "grammar_planning", "grammar_analysis"}, stale
    finally:
        protocol.write_text(good)
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
    # a design cell run by hand without the protocol refuses in one line (pipelines/ppo.py)
    protocol.rename(repo / "protocol.json.away")
    try:
        out = sh(repo, sys.executable, "-m", "pipelines.ppo", "grammar_design@10-reward_k1-act-0", check=False)
        assert out.returncode != 0 and "run the calibration first (dvc repro grammar_calibrate)" in out.stderr
    finally:
        (repo / "protocol.json.away").rename(protocol)


def test_adding_a_batch_runs_only_its_shared_cells_and_rerun_keeps_one_run(repo, ran):
    """A second batch (instances 12, 13) with no design group allocated there (every comparison settled or capped,
    as after `make settle`): only its no-KL baseline and the shared cells run; calibration, planning and every other
    cell stay; the analysis reruns."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["grammar"]["instances"] = [10, 11, 12, 13]
    write_params(repo, params)
    out = sh(repo, sys.executable, "-m", "pipelines.run", "--workers", "2").stdout
    assert "2 upstream chains to build: grammar_data@12, grammar_data@13\n" in out, out
    n_eval = len(cell_stages())
    assert "0 of 7 calibration cells to run" in out and "0 of 30 planning cells to run" in out, out
    assert f"6 of {n_eval + 6} grid cells to run" in out, out
    finished = {m[1] for m in re.finditer(r"^\[\d+/7\] (\S+): gold ", out, re.MULTILINE)}  # 6 cells, the analysis
    shared = ("reward_k1-act", "reward_k1-control")
    assert finished == {
        f"grammar_{c}-0" for i in (12, 13) for c in (f"baseline@{i}", *(f"design@{i}-{e}" for e in shared))
    }
    ran = re.findall(r"^\[\d+/7\] (grammar_\w+): \(", out, re.MULTILINE)
    assert ran == ["grammar_analysis"] and "Running stage" not in out, out  # calibrate and planning did not rerun
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
    # Re-running a cell by force leaves exactly one visible MLflow run for it.
    sh(repo, sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "grammar_baseline@12-0")
    assert len(visible_runs(repo)["grammar_baseline@12-0"]) == 1
    # Removing the batch drops it from the analysis.
    params["grammar"]["instances"] = [10, 11]
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
