"""Every benchmark script runs: one tiny iteration each, in a copy of the project with toy sizes in params.yaml (so
that nothing of this checkout is written). A script that does not fit a fast test is marked slow, with why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import repo_params
from tests.helpers import REPO, copy_code, copy_params

TOY_GRAMMAR = {
    "task": {"n_words": 8, "n_successors": 3, "max_new_tokens": 6, "n_demos": 700},
    "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
    "sft": {"steps": 2, "batch_size": 16, "n_heldout": 100},
    "rm": {"n_pairs": 64, "n_heldout_pairs": 32, "steps": 2, "batch_size": 16},
    "ppo": {"iterations": 4, "batch_size": 8, "minibatch_size": 4, "epochs": 1, "eval_every": 2},
}
TOY_GRAMMAR["task"] |= {"n_train_prompts": 64, "n_eval_prompts": 32}
# script: its smoke arguments (each script's own flags)
SMOKE = {
    "arithmetic_calibration.py": ["--smoke", "--seeds", "0", "--runs", "loss_k3@0.3", "--out", "arithmetic.json"],
    "bench_algorithms.py": ["--iterations", "3", "--repeats", "1", "--group-size", "2"],
    "bench_backends.py": ["--repeats", "1", "--backends", "tiny"],
    "bench_cell.py": ["--cells", "grammar_calibration_baseline@0-0", "--rounds", "1", "--baseline", "HEAD"],
    "bench_population.py": [
        "--device",
        "cpu",
        "--smoke",
        "--backends",
        "tiny",
        "hf-llama",
        "hf-gpt2",
        "--out",
        "population.json",
    ],
    "bench_gpu.py": ["--device", "cpu", "--backends", "tiny", "--workers", "1", "--iterations", "1"],
    "bench_ppo.py": ["--repeats", "1", "--iterations", "4", "--d-model", "8", "--baseline", "HEAD"],
    "bench_workers.py": ["--cells", "1", "--repeats", "1", "--workers", "1"],
    "compare_lock.py": ["--self-test"],
    "cross_machine.py": ["--smoke"],
    "diagnostics_table.py": ["--warmup", "1", "--n-true", "16", "--n-minibatches", "2"],
    "no_kl_baselines.py": ["grammar", "0"],
    "overoptimisation.py": ["--seeds", "0"],
    "repro_wait.py": ["--lock", str(REPO / "dvc.lock"), "--cores", "2", "64", "--up-to", "127"],
    "skew_simulation.py": ["--smoke", "--fixture", str(REPO / "tests" / "ablations" / "data" / "v3_differences.csv")],
}
# bench_workers times the runner on a finished pipeline's outputs (data/, models/, runs/), which the toy project does
# not have: here it must refuse in one line, naming what to run first (a real run takes minutes)
NEEDS_REPRO = {"bench_workers.py": "run `make repro` first"}
SLOW: set[str] = set()


def test_every_benchmark_script_has_smoke_arguments():
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}  # _x: a helper
    assert scripts == set(SMOKE)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A git repository with this checkout's code and toy sizes (bench_ppo's baseline is its HEAD)."""
    root = copy_params(tmp_path_factory.mktemp("bench"), repo_params({"grammar": TOY_GRAMMAR}))
    copy_code(root)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "toy"]):
        subprocess.run(git + cmd, cwd=root, check=True, capture_output=True)
    return root


@pytest.mark.parametrize("script", [pytest.param(s, marks=[pytest.mark.slow] * (s in SLOW)) for s in sorted(SMOKE)])
def test_benchmark_script_runs_one_tiny_iteration(project, script):
    env = {**os.environ, "PYTHONPATH": str(project), "TQDM_DISABLE": "1", "MPLBACKEND": "Agg"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{project / 'mlflow.db'}"
    cmd = [sys.executable, str(project / "benchmarks" / script), *SMOKE[script]]
    out = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    if script in NEEDS_REPRO:
        assert out.returncode != 0 and NEEDS_REPRO[script] in out.stderr and "Traceback" not in out.stderr, out.stderr
        return
    assert out.returncode == 0, f"{script}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def test_repro_wait_runs_a_chain_as_one_job_longest_first_and_each_wave_after_the_last():
    import importlib.util

    spec = importlib.util.spec_from_file_location("repro_wait", REPO / "benchmarks" / "repro_wait.py")
    rw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rw)
    stages = ["grammar_data@5", "grammar_sft@5", "grammar_rm@5", "grammar_eval0@5", "grammar_calibration_sft@0",
              "grammar_calibration@0-reward_k1-0.1-0", "grammar_calibrate", "grammar_plan@3-x-0", "grammar_planning",
              "grammar_design@124-reward_k1-act-0", "grammar_baseline@124-0", "grammar_analysis"]  # fmt: skip
    assert [rw.wave(s) for s in stages] == [0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
    seconds = dict.fromkeys(stages, 1.0) | {"grammar_sft@5": 10.0}
    jobs, tails = rw.jobs(stages, seconds)
    assert sorted(jobs[0]) == [1.0, 13.0]  # instance 5's chain (1 + 10 + 1 + 1) and the calibration instance's
    assert jobs[3] == [1.0, 1.0] and tails[3] == [1.0] and tails[1] == [1.0]  # the analysis after the cells
    assert rw.wave_seconds([5, 1, 1], [2, 3], 64) == 8  # the longest job, then the tails side by side
    assert rw.makespan([1, 1, 2], 2) == 2  # longest first (in the given order: 1 and 1, then 2 after one: 3)
    assert rw.makespan([3, 3, 2, 2, 2], 2) == 7  # list scheduling, not the optimum (6): within 4/3 of it
    assert rw.makespan([5, 1, 1], 64) == 5
    assert rw.stage_seconds(["a@1", "a@2"], {"a@1": 4.0}) == ({"a@1": 4.0, "a@2": 4.0}, {"a": 1})
    assert [rw.instance(s) for s in ("grammar_design@139-x-0", "grammar_sft@0", "grammar_analysis")] == [139, 0, None]
