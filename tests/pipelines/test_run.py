"""The grid runner under signals, concurrency and leftovers (issue 9), with a fake DVC and fake cells
(tests/pipelines/fakes.py): the runner's own process handling, in seconds. tests/pipelines/test_interrupts.py
does the same with real DVC and real cells (slow)."""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ablations.config import Params
from ablations.grid import calibration_cells, cells, evaluation_cells, plan_cells, upstream_chains
from ablations.tasks import TASKS
from pipelines.runner import cli, dvccli, mlflow_runs, plan, record, worker
from pipelines.runner import ray as rayrun
from pipelines.runner.repo import runner_lock
from pipelines.runner.signals import RunnerError
from tests.conftest import REPO, repo_params
from tests.pipelines.fakes import committed, env, runner_script
from tests.pipelines.procs import HANG_S, alive, children, wait_for, worker_pids
from tests.pipelines.tiny import TINY


def start_runner(workdir: Path, **extra: str) -> subprocess.Popen:
    """The runner in its own process group (as a terminal's foreground job), recording after every cell."""
    return subprocess.Popen(
        [sys.executable, "-c", runner_script(), "--workers", "2", "--commit-every", "0", "--no-analysis"],
        cwd=workdir,
        env=env(workdir, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=HANG_S)
    return proc.returncode, out, err


PARAMS = Params.model_validate(repo_params(TINY))
GRID = cells(PARAMS)  # the calibration cells first, then the plan cells, then the evaluation cells
CAL, PLAN, EVAL = calibration_cells(PARAMS), plan_cells(PARAMS), evaluation_cells(PARAMS)
FAST = {c.stage for c in GRID[:2]}  # FAKE_FAST=2: these two finish at once, the others run for a minute


def with_outputs(workdir: Path) -> set[str]:
    return {c.stage for c in GRID if (workdir / c.out_dir / "summary.json").exists()}


def fast_cells_recorded(workdir: Path):
    def check() -> bool:
        try:
            return set(committed(workdir / "fake.lock")) >= FAST
        except ValueError:  # being written
            return False

    return check


def test_sigterm_stops_every_worker_records_finished_cells_and_exits_with_one_line(workdir):
    proc = start_runner(workdir, FAKE_FAST="2")  # two calibration cells finish at once, the others run for a minute
    wait_for(fast_cells_recorded(workdir))
    wait_for(lambda: len(worker_pids(workdir)) == 2 and all(map(alive, worker_pids(workdir))))
    proc.send_signal(signal.SIGTERM)  # `kill <pid>` / `timeout`: the runner only, not its group
    rc, out, err = finish(proc)
    assert rc == 143, (out, err)
    assert err.count("\n") == 1 and err.startswith("stopped by SIGTERM: 2 finished cells are recorded"), err
    time.sleep(0.5)
    assert not [p for p in worker_pids(workdir) if alive(p)]
    assert set(committed(workdir / "fake.lock")) == with_outputs(workdir) == FAST


def test_double_ctrl_c_during_a_commit_leaves_a_whole_lock_file(workdir):
    # The fake commit rewrites its lock in place over 1 s: had Ctrl-C reached it, the file would be cut.
    proc = start_runner(workdir, FAKE_FAST="2", FAKE_COMMIT_S="1")
    wait_for(lambda: (workdir / "fake/committing").exists())
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole foreground group
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc)
    assert rc == 130 and err.count("\n") == 1 and err.startswith("stopped by SIGINT"), (out, err)
    recorded = committed(workdir / "fake.lock")  # parses: whole
    assert recorded and set(recorded) == with_outputs(workdir)  # every finished cell, nothing else
    assert not [p for p in worker_pids(workdir) if alive(p)]


def test_ctrl_c_while_the_workers_start_ends_with_one_line(workdir):
    proc = start_runner(workdir)
    # a worker is being started: imports, not yet set up (after the sweep's MLflow parent run: a new store first)
    wait_for(lambda: children(proc.pid, b"spawn_main"), timeout=HANG_S)
    os.killpg(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc)
    assert rc == 130 and err.count("\n") == 1 and err.startswith("stopped by SIGINT"), (out, err)


def test_sigkill_of_the_runner_keeps_recorded_cells_and_takes_the_workers_with_it(workdir):
    proc = start_runner(workdir, FAKE_FAST="2")
    wait_for(fast_cells_recorded(workdir))
    wait_for(lambda: len(worker_pids(workdir)) == 2)
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc)
    wait_for(lambda: not [p for p in worker_pids(workdir) if alive(p)], timeout=10)  # PR_SET_PDEATHSIG
    assert set(committed(workdir / "fake.lock")) >= FAST


def test_a_second_runner_is_refused_naming_the_first_ones_pid(workdir, capsys):
    hold = "\n".join(["import time", "from pipelines.runner.repo import runner_lock", "with runner_lock():"]) + (
        "\n    print(1, flush=True)\n    time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold],
        cwd=workdir,
        env=env(workdir),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "1"
        called = []
        rc = cli.main(["--workers", "1"], run_cell=lambda p, c: called.append(c))
        err = capsys.readouterr().err
        assert rc == 2 and err == (
            f"error: another runner (pid {holder.pid}) is working in this repository; wait for it, or stop it with "
            f"`kill {holder.pid}`\n"
        )
        assert not called
    finally:
        holder.kill()
        holder.wait()
    with runner_lock():  # the kernel released the dead holder's lock
        pass


def test_the_interpreter_check_fails_before_any_compute(workdir, monkeypatch, capsys):
    # A shell that puts another `python` first on PATH: what DVC's stage commands would then run.
    other = workdir / "other-bin"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho /usr\necho /usr/bin/python3\n")
    (workdir / "shell").write_text(f'#!/bin/sh\nPATH="{other}:$PATH"; export PATH\nexec /bin/sh "$@"\n')
    for f in (other / "python", workdir / "shell"):
        f.chmod(0o755)
    dvccli.check_interpreter(dvccli.stage_env())  # with the user's own shell it passes
    monkeypatch.setenv("SHELL", str(workdir / "shell"))
    called = []
    rc = cli.main(["--workers", "1"], run_cell=lambda p, c: called.append(c))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "DVC's stage commands would run `python` = /usr/bin/python3 (environment /usr)" in err
    assert not called and not (workdir / ".dvc/tmp").exists()  # nothing ran, nothing was written


def test_stage_env_puts_this_interpreter_first():
    path = dvccli.stage_env()["PATH"].split(os.pathsep)
    assert path[0] == os.path.dirname(sys.executable)


def test_a_failing_dvc_ends_with_one_line_and_no_traceback(workdir, monkeypatch, capsys):
    monkeypatch.setattr(dvccli, "DVC", [sys.executable, "-c", "import sys; sys.exit(3)"])
    rc = cli.main(["--workers", "1"], run_cell=lambda p, c: None)
    err = capsys.readouterr().err
    assert rc == 1 and err == "error: `dvc status --json` failed (exit 3); DVC's message is above\n"


def test_leftover_temporary_files_are_removed_at_start_and_nothing_else(workdir, capsys, monkeypatch):
    from pipelines.common import atomic_dir, write_atomic
    from pipelines.leftovers import clean_temp, temp_sibling

    leftovers = [
        temp_sibling(workdir / "runs/ppo/reward_k1-0.1-0"),  # atomic_dir of a killed cell
        temp_sibling(workdir / "models/rm.pt"),  # save_checkpoint
        temp_sibling(workdir / "dvc.lock"),  # pipelines.runner.lockfile
        workdir / ".reports-tmp-ab12_x9z",  # tempfile.TemporaryDirectory of the analysis stage
    ]
    leftovers[0].mkdir(parents=True)
    (leftovers[0] / "summary.json").write_text("{}")
    keep = [
        workdir / "runs/ppo/reward_k1-0.1-1/summary.json",
        workdir / "runs/ppo/x.tmp-12345678",
        workdir / ".dvc/tmp/.x.tmp-12345678",
        workdir / "models/.notes",
    ]
    for p in leftovers[1:] + keep:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    with atomic_dir(workdir / "runs/ppo/reward_k1-0.1-1") as tmp:  # replacing a directory leaves nothing behind
        write_atomic(tmp / "summary.json", "{}")
    assert sorted(clean_temp(workdir)) == sorted(leftovers)
    assert all(p.exists() for p in keep) and not any(p.exists() for p in leftovers)
    # And the runner does it at start (then stops at the fake `dvc repro`).
    leftovers[1].write_text("x")
    monkeypatch.setattr(dvccli, "DVC", [sys.executable, "-c", "import sys; sys.exit(3)"])
    cli.main(["--workers", "1"], run_cell=lambda p, c: None)
    assert not leftovers[1].exists() and "removed 1 temporary files" in capsys.readouterr().out


@pytest.mark.slow  # creating an MLflow store takes ~5 s of CPU (its schema migrations)
def test_stale_running_mlflow_runs_are_marked_failed(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipelines import tracking

    client = MlflowClient(tracking.tracking_uri())
    exp = client.create_experiment("e")
    runs = {s: client.create_run(exp, tags={tracking.STAGE_TAG: s}).info.run_id for s in ("a", "b", "c")}
    client.set_terminated(runs["c"], "FINISHED")
    assert tracking.fail_running("e", "gone", stages={"a"}) == ["a"]
    assert sorted(tracking.fail_running("e", "gone")) == ["b"]
    status = {s: client.get_run(r).info.status for s, r in runs.items()}
    assert status == {"a": "FAILED", "b": "FAILED", "c": "FINISHED"}
    assert client.get_run(runs["b"]).data.tags["failure"] == "gone"
    assert tracking.fail_running("no such experiment", "gone") == []


def test_no_mlflow_store_is_created_by_the_stale_run_check(tmp_path, monkeypatch):
    from pipelines import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'absent.db'}")
    assert tracking.fail_running("e", "gone") == [] and not (tmp_path / "absent.db").exists()


def test_a_damaged_checkpoint_fails_naming_the_file(tmp_path):
    import torch

    from pipelines.common import CheckpointError, load_checkpoint, save_checkpoint

    path = tmp_path / "rm.pt"
    save_checkpoint(path, {"w": torch.zeros(100)})
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match=rf"^{path}: cannot load checkpoint \(.*\); it is damaged"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"missing\.pt: missing"):
        load_checkpoint(tmp_path / "missing.pt")


def test_a_commit_killed_by_a_signal_is_retried_once_and_then_reported(workdir, monkeypatch, capsys):
    # First call: killed by SIGKILL (as by the OOM killer); second: records.
    script = "import os, pathlib, signal, sys; m = pathlib.Path('tried'); tried = m.exists(); m.touch(); "
    kill = "tried or os.kill(os.getpid(), signal.SIGKILL)"
    monkeypatch.setattr(dvccli, "COMMIT", [sys.executable, "-c", script + kill])
    (workdir / dvccli.STATE).mkdir(parents=True)
    recorder = record.Recorder(dvccli.stage_env(), every_s=0)
    for cell in GRID[:2]:
        recorder.add(cell, "")
    recorder.finish()
    assert recorder.recorded == GRID[:2] and "recorded 2 more finished cells" in capsys.readouterr().out
    # Killed again: reported in one line, with the signal.
    monkeypatch.setattr(dvccli, "COMMIT", [sys.executable, "-c", script + "os.kill(os.getpid(), signal.SIGKILL)"])
    recorder.add(GRID[2], "")
    with pytest.raises(RunnerError, match=r"^recording 1 finished cells in dvc.lock failed: killed by SIGKILL$"):
        recorder.finish()


# ---------------------------------------------------------------- placement of cells on GPUs


def run_placed(workdir: Path, gpus: list[str], flags: list[str], together: int) -> tuple[str, dict[str, dict]]:
    """The runner with fakes.placed cells on a machine whose visible GPUs are ``gpus``; (stdout, record per cell)."""
    environ = {k: v for k, v in env(workdir, FAKE_TOGETHER=str(together)).items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            runner_script("placed", gpus=tuple(gpus)),
            *flags,
            "--commit-every",
            "0",
            "--no-analysis",
        ],
        cwd=workdir,
        env=environ,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    records = [json.loads(p.read_text()) for p in (workdir / "fake").glob("cell-*.json")]
    return out.stdout, {r["stage"]: r for r in records}


@pytest.mark.parametrize(
    ("gpus", "flags", "workers_on", "where"),
    [
        ([], ["--workers", "2"], {"unset": 2}, "2 local workers"),  # CPU: today's behaviour, no CUDA_VISIBLE_DEVICES
        (["0", "1"], [], {"0": 1, "1": 1}, "2 local workers: 1 on GPU 0, 1 on GPU 1"),  # default: one per GPU
        (
            ["1", "3", "5"],
            ["--gpus", "3,5", "--workers-per-gpu", "2"],
            {"3": 2, "5": 2},
            "4 local workers: 2 on GPU 3, 2 on GPU 5",
        ),
    ],
)
def test_each_worker_keeps_its_gpu_and_n_workers_per_gpu_run_n_cells_on_it_at_once(
    workdir, gpus, flags, workers_on, where
):
    out, records = run_placed(workdir, gpus, flags, together=sum(workers_on.values()))
    assert f"{len(CAL)} of {len(CAL)} calibration cells to run on {where}\n" in out, out
    assert f"{len(EVAL)} of {len(EVAL)} grid cells to run on {where}\n" in out, out
    assert set(records) == {c.stage for c in GRID}
    gpu_of = {}
    for r in records.values():
        assert gpu_of.setdefault(r["pid"], r["gpu"]) == r["gpu"], "a worker changed GPU"
    pids_on = {g: {p for p, x in gpu_of.items() if x == g} for g in set(gpu_of.values())}
    assert {g: len(p) for g, p in pids_on.items()} == workers_on
    for g, n in workers_on.items():  # n cells on each GPU at once, never more; every worker busy at once
        assert max(r["peak"] for r in records.values() if r["gpu"] == g) == n
    assert max(r["together"] for r in records.values()) == sum(workers_on.values())


@pytest.mark.parametrize(
    ("gpus", "argv", "message"),
    [
        ([], ["--gpus", "0"], "--gpus: no CUDA device is visible to this runner (torch sees none)"),
        ([], ["--workers-per-gpu", "2"], "--workers-per-gpu: no CUDA device is visible to this runner"),
        (["0", "1"], ["--gpus", "0,2"], "--gpus 0,2: '2' is not a visible GPU; visible: 0,1"),
        (["0", "1"], ["--gpus", "1,1"], "--gpus 1,1: a GPU is named twice; visible: 0,1"),
        (["0", "1"], ["--gpus", ""], "--gpus : '' is not a visible GPU"),
        (["0"], ["--workers-per-gpu", "0"], "--workers-per-gpu must be 1 or more (got 0)"),
        ([], ["--workers", "0"], "--workers must be 1 or more (got 0)"),
        (["0"], ["--workers", "2", "--workers-per-gpu", "2"], "give --workers (in all) or --workers-per-gpu, not both"),
        ([], ["--ray-address", "auto", "--gpus", "0"], "--gpus places local workers; on Ray, Ray places the cells"),
        ([], ["--ray-address", "auto", "--workers", "2"], "--workers places local workers; on Ray"),
    ],
)
def test_placement_flags_that_make_no_sense_are_refused_in_one_line_before_anything_runs(
    workdir, monkeypatch, capsys, gpus, argv, message
):
    monkeypatch.setattr(plan, "visible_gpus", lambda: list(gpus))
    called = []
    rc = cli.main(argv, run_cell=lambda p, c: called.append(c))
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not called and not (workdir / ".dvc/tmp").exists()  # refused before the runner lock and DVC


def placement_of(visible: list[str], *argv: str) -> tuple[int, list[str] | None]:
    ap_args = dict(workers=None, gpus=None, workers_per_gpu=None, ray_address=None)
    flags = dict(zip(argv[::2], argv[1::2]))
    for flag, value in flags.items():
        key = flag.removeprefix("--").replace("-", "_")
        ap_args[key] = value if key in ("gpus", "ray_address") else int(value)
    return plan.placement(argparse.Namespace(**ap_args), visible)


def test_placement_spreads_workers_evenly_over_the_gpus():
    assert placement_of([]) == (os.cpu_count() or 1, None)
    assert placement_of([], "--workers", "3") == (3, None)
    assert placement_of(["0", "1"]) == (2, ["0", "1"])
    assert placement_of(["0", "1"], "--workers-per-gpu", "2") == (4, ["0", "1", "0", "1"])
    assert placement_of(["0", "1"], "--workers", "3") == (3, ["0", "1", "0"])
    assert placement_of(["GPU-a", "GPU-b"], "--gpus", "GPU-b") == (1, ["GPU-b"])
    assert placement_of(["0"], "--ray-address", "auto", "--workers-per-gpu", "4") == (0, None)


def test_visible_gpus_are_the_runners_cuda_visible_devices_entries(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert plan.visible_gpus() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa, GPU-bb,7")  # CUDA stops at what it cannot use: 2 here
    assert plan.visible_gpus() == ["GPU-aa", "GPU-bb"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert plan.visible_gpus() == []


def test_ray_cells_ask_for_their_threads_and_a_share_of_a_gpu():
    assert rayrun.ray_resources(0, None, 1) == {"num_cpus": 1, "num_gpus": 0}
    assert rayrun.ray_resources(8, None, 2) == {"num_cpus": 2, "num_gpus": 1.0}
    assert rayrun.ray_resources(8, 4, 1) == {"num_cpus": 1, "num_gpus": 0.25}
    with pytest.raises(RunnerError, match=r"^--workers-per-gpu 2: the Ray cluster has no GPUs$"):
        rayrun.ray_resources(0, 2, 1)


CHAINS = upstream_chains(PARAMS)  # grammar: calibration instance 0, planning instances 1, 2, evaluation 10, 11


def run_upstream(workdir: Path, stale: list[str], **extra: str) -> subprocess.CompletedProcess:
    """The runner with fake upstream stages (``stale`` per `dvc status`) and fast fake cells."""
    return subprocess.run(
        [sys.executable, "-c", runner_script(), "--workers", "3", "--commit-every", "0", "--no-analysis"],
        cwd=workdir,
        env=env(workdir, FAKE_STALE=",".join(stale), FAKE_FAST="1000", **extra),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


def stage_records(workdir: Path) -> dict[str, dict]:
    return {p.stem.removeprefix("stage-"): json.loads(p.read_text()) for p in (workdir / "fake").glob("stage-*")}


def test_upstream_chains_match_dvc_yaml():
    assert CHAINS == [
        [
            "grammar_calibration_data@0",
            "grammar_calibration_sft@0",
            "grammar_calibration_rm@0",
            "grammar_calibration_eval0@0",
        ],
        ["grammar_plan_data@1", "grammar_plan_sft@1", "grammar_plan_rm@1", "grammar_plan_eval0@1"],
        ["grammar_plan_data@2", "grammar_plan_sft@2", "grammar_plan_rm@2", "grammar_plan_eval0@2"],
        ["grammar_data@10", "grammar_sft@10", "grammar_rm@10", "grammar_eval0@10"],
        ["grammar_data@11", "grammar_sft@11", "grammar_rm@11", "grammar_eval0@11"],
    ]
    both = Params.model_validate(repo_params())  # params.yaml: arithmetic has no rm stage
    assert ["arithmetic_calibration_data@0", "arithmetic_calibration_sft@0", "arithmetic_calibration_eval0@0"] in (
        upstream_chains(both)
    )
    assert ["arithmetic_plan_data@3", "arithmetic_plan_sft@3", "arithmetic_plan_eval0@3"] in upstream_chains(both)
    assert ["arithmetic_data@124", "arithmetic_sft@124", "arithmetic_eval0@124"] in upstream_chains(both)
    assert upstream_chains(PARAMS, evaluation=False) == CHAINS[:3]  # --calibration-only: calibration and planning
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]  # YAML merge keys resolved
    matrix = {"": "instances", "calibration_": "calibration.instances", "plan_": "calibration.plan_instances"}
    for task, kind in itertools.product(TASKS, ("data", "sft", "rm", "eval0")):
        if kind == "rm" and not TASKS[task].learned_reward:
            assert not any(f"{task}_{p}rm" in stages for p in matrix)
            continue
        # worker.upstream_stage runs pipelines.<kind>.main([task, instance]) for the three stage groups
        assert worker.upstream_mains()[kind] is importlib.import_module(f"pipelines.{kind}").main
        cmd = f"python -m pipelines.{kind} {task} ${{item.instance}}"
        for prefix, key in matrix.items():
            assert stages[f"{task}_{prefix}{kind}"]["cmd"] == cmd
            assert stages[f"{task}_{prefix}{kind}"]["matrix"] == {"instance": f"${{{task}.{key}}}"}


def test_stale_chains_run_concurrently_in_order_and_are_recorded_before_the_cells(workdir):
    stale = [s for c in CHAINS for s in c]
    out = run_upstream(workdir, stale)
    assert out.returncode == 0, (out.stdout, out.stderr)
    records = stage_records(workdir)
    assert set(records) == set(stale)
    for chain in CHAINS:  # in order within a chain
        for a, b in itertools.pairwise(chain):
            assert records[a]["end"] <= records[b]["start"], (a, b)
    assert any(records[s]["others"] for s in stale)  # chains overlapped
    lock = committed(workdir / "fake.lock")
    n = len(stale)
    assert set(lock[:n]) == set(stale)
    assert_waves(lock[n:])  # the calibration wave, the planning wave, then the evaluation
    assert (
        "5 upstream chains to build: grammar_calibration_data@0, grammar_plan_data@1, grammar_plan_data@2, "
        "grammar_data@10, grammar_data@11" in out.stdout
    )


def test_a_chain_with_fresh_data_and_stale_sft_starts_at_sft(workdir):
    out = run_upstream(workdir, ["grammar_sft@11", "grammar_calibration_rm@0"])
    assert out.returncode == 0, (out.stdout, out.stderr)
    ran = {
        "grammar_sft@11",
        "grammar_rm@11",
        "grammar_eval0@11",
        "grammar_calibration_rm@0",
        "grammar_calibration_eval0@0",
    }
    assert set(stage_records(workdir)) == ran
    assert set(committed(workdir / "fake.lock")[:5]) == ran


def test_nothing_stale_upstream_runs_nothing_upstream(workdir):
    out = run_upstream(workdir, [])
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert not stage_records(workdir) and "upstream" not in out.stdout
    # `dvc status` asked 3 times: the upstream answer serves the calibration wave (nothing ran between), which runs
    # cells, so the planning and grid waves ask again
    assert len((workdir / "fake/status").read_text().splitlines()) == 3
    assert set(committed(workdir / "fake.lock")) == {c.stage for c in GRID} | {"grammar_calibrate", "grammar_planning"}


def test_dvc_status_is_asked_once_and_again_only_after_a_phase_ran_something(workdir):
    calls = lambda: len((workdir / "fake/status").read_text().splitlines())
    out = run_upstream(workdir, ["grammar_sft@11"])  # upstream, calibration, planning and grid each ran: 4 asks
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert calls() == 4
    out = run_upstream(workdir, [])  # nothing stale (a `make settle` round between batches): 1 ask for all phases
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert calls() == 5 and "upstream" not in out.stdout
    for n, what in ((len(CAL), "calibration cells"), (len(PLAN), "planning cells"), (len(EVAL), "grid cells")):
        assert f"0 of {n} {what} to run on 3 local workers\n" in out.stdout, out.stdout


def test_a_failing_upstream_stage_fails_the_run_in_one_line_and_no_cell_runs(workdir):
    out = run_upstream(workdir, ["grammar_sft@10", "grammar_calibration_data@0"], FAKE_FAIL="grammar_sft@10")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stderr == "error: upstream stage failed: grammar_sft@10; its message is above; no cell ran\n"
    assert "FAILED grammar_sft@10: ValueError: grammar_sft@10 broke" in out.stdout
    calibration_chain = set(CHAINS[0])
    assert set(committed(workdir / "fake.lock")) == calibration_chain  # the others kept
    assert not with_outputs(workdir) and not list((workdir / "fake").glob("worker-*"))


# ------------------------------------------ protocol v4: the calibration wave, then the planning wave, come first


def assert_waves(lock: list[str]) -> None:
    """``lock`` (the stages recorded after the upstream ones) holds every calibration cell, then grammar_calibrate,
    every plan cell, grammar_planning, then the evaluation cells."""
    c, p = len(CAL), len(CAL) + 1 + len(PLAN)
    assert set(lock[:c]) == {x.stage for x in CAL} and lock[c] == "grammar_calibrate"
    assert set(lock[c + 1 : p]) == {x.stage for x in PLAN} and lock[p] == "grammar_planning"
    assert set(lock[p + 1 :]) == {x.stage for x in EVAL}


def run_fake(workdir: Path, *flags: str) -> subprocess.CompletedProcess:
    """The runner with fake DVC and fast fake cells, with ``flags``."""
    return subprocess.run(
        [sys.executable, "-c", runner_script(), "--workers", "2", "--commit-every", "0", *flags],
        cwd=workdir,
        env=env(workdir, FAKE_FAST="1000"),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


def test_the_calibration_and_planning_waves_and_their_stages_come_before_any_evaluation_cell(workdir):
    out = run_fake(workdir, "--no-analysis")
    assert out.returncode == 0, (out.stdout, out.stderr)
    cal_line = f"{len(CAL)} of {len(CAL)} calibration cells to run on 2 local workers\n"
    plan_line = f"{len(PLAN)} of {len(PLAN)} planning cells to run on 2 local workers\n"
    eval_line = f"{len(EVAL)} of {len(EVAL)} grid cells to run on 2 local workers\n"
    assert cal_line in out.stdout and plan_line in out.stdout and eval_line in out.stdout, out.stdout
    assert out.stdout.index(cal_line) < out.stdout.index(plan_line) < out.stdout.index(eval_line)
    # every calibration cell, then grammar_calibrate (in a worker, once they had all finished), every plan cell, then
    # grammar_planning, are recorded before any evaluation cell ran; with --no-analysis no analysis, and no
    # `dvc repro` at all
    assert_waves(committed(workdir / "fake.lock"))
    assert (workdir / "fake/tails").read_text() == (
        f"grammar_calibrate after {len(CAL)} cells\ngrammar_planning after {len(CAL) + len(PLAN)} cells\n"
    )
    assert not (workdir / "fake/repro").exists()
    assert "then, each once its task's cells have finished: grammar_calibrate\n" in out.stdout
    assert "then, each once its task's cells have finished: grammar_planning\n" in out.stdout
    assert all(c.calibration for c in CAL) and not any(c.calibration or c.plan for c in EVAL)
    assert all(c.plan for c in PLAN) and {c.kind for c in PLAN} == {"plan_baseline", "plan"}
    assert {c.kind for c in EVAL} == {"baseline", "design"}
    assert all(c.kl is None for c in EVAL + PLAN if c.kind in ("design", "plan"))


def test_each_tasks_calibrate_and_analysis_run_in_workers_once_its_cells_are_done_both_tasks_at_once(workdir):
    first = [100, 101, 102, 103]
    pair = list(TASKS)[:2]  # two tasks on the two workers (any other task has no instances and does not run)

    def section(task: str) -> dict:
        mine = task in pair
        alloc = {g: first if a and mine else [] for g, a in repo_params()[task]["allocation"].items()}
        cal = {"instances": [0], "plan_instances": [1, 2]} if mine else {"instances": [], "plan_instances": []}
        return {"instances": first if mine else [], "allocation": alloc, "calibration": cal}

    both = repo_params({t: section(t) for t in TASKS})
    (workdir / "params.yaml").write_text(yaml.safe_dump(both, sort_keys=False))
    grid = cells(Params.model_validate(both))
    out = subprocess.run(
        [sys.executable, "-c", runner_script(), "--workers", "2", "--commit-every", "0"],
        cwd=workdir,
        env=env(workdir, FAKE_FAST="1000", FAKE_TAIL_WAIT="5"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    lines = (workdir / "fake/tails").read_text().splitlines()
    per_task = {t: [c for c in grid if c.task == t] for t in pair}
    for task, mine in per_task.items():
        n_cal, n_plan = sum(c.calibration for c in mine), sum(c.plan for c in mine)
        assert f"{task}_calibrate after {n_cal} cells" in {line.split(" with ")[0] for line in lines}, lines
        assert f"{task}_planning after {n_cal + n_plan} cells" in {line.split(" with ")[0] for line in lines}, lines
        assert f"{task}_analysis after {len(mine)} cells" in {line.split(" with ")[0] for line in lines}, lines
    assert {line for line in lines if "_analysis" in line} == {  # both analyses ran at once, on the two workers
        f"{a}_analysis after {len(per_task[a])} cells with {b}_analysis" for a, b in itertools.permutations(pair, 2)
    }, lines
    lock = committed(workdir / "fake.lock")
    tails = ("calibrate", "planning", "analysis")
    assert set(lock) == {c.stage for c in grid} | {f"{t}_{k}" for t in pair for k in tails}  # a task without
    # instances runs nothing, its calibrate, planning and analysis included
    for task in pair:  # recorded after every cell it read
        stages = [c.stage for c in per_task[task]]
        assert lock.index(f"{task}_analysis") > max(lock.index(s) for s in stages)
        cal = [c.stage for c in per_task[task] if c.calibration]
        planned = [c.stage for c in per_task[task] if c.plan]
        evaluated = [c.stage for c in per_task[task] if not (c.calibration or c.plan)]
        assert max(lock.index(s) for s in cal) < lock.index(f"{task}_calibrate") < min(map(lock.index, planned))
        assert max(map(lock.index, planned)) < lock.index(f"{task}_planning") < min(map(lock.index, evaluated))
    assert not (workdir / "fake/repro").exists()  # no `dvc repro` at all


def test_calibration_only_builds_the_calibration_and_planning_instances_runs_their_cells_and_stops(workdir):
    out = subprocess.run(
        [sys.executable, "-c", runner_script(), "--workers", "2", "--commit-every", "0", "--calibration-only"],
        cwd=workdir,
        env=env(workdir, FAKE_FAST="1000", FAKE_STALE=",".join(s for c in CHAINS for s in c)),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    built = "grammar_calibration_data@0, grammar_plan_data@1, grammar_plan_data@2"
    assert f"3 upstream chains to build: {built}\n" in out.stdout, out.stdout
    assert (
        "calibration and plan done: protocol/<task>.json and protocol/<task>.plan.json written; commit them before "
        "the evaluation" in out.stdout
    )
    assert "grid cells" not in out.stdout
    chains = {s for c in CHAINS[:3] for s in c}
    assert set(stage_records(workdir)) == chains  # no evaluation instance was built
    tails = {"grammar_calibrate", "grammar_planning"}
    assert set(committed(workdir / "fake.lock")) == chains | {c.stage for c in CAL + PLAN} | tails
    assert with_outputs(workdir) == {c.stage for c in CAL + PLAN}
    assert (workdir / "fake/tails").read_text() == (  # no analysis
        f"grammar_calibrate after {len(CAL)} cells\ngrammar_planning after {len(CAL) + len(PLAN)} cells\n"
    )


def test_an_upstream_stage_of_a_calibration_instance_runs_its_tasks_module(monkeypatch):
    import pipelines.rm
    import pipelines.sft

    calls = []
    monkeypatch.setattr(mlflow_runs, "ready", lambda experiment: None)
    monkeypatch.setattr(pipelines.sft, "main", lambda argv: calls.append(("sft", argv)))
    monkeypatch.setattr(pipelines.rm, "main", lambda argv: calls.append(("rm", argv)))
    worker.upstream_stage(PARAMS, plan.Upstream("grammar_calibration_sft@0", ("grammar_calibration_rm@0",)))
    worker.upstream_stage(PARAMS, plan.Upstream("grammar_rm@10"))
    assert calls == [("sft", ["grammar", "0"]), ("rm", ["grammar", "10"])]


def test_upstream_stages_name_their_mlflow_runs_as_dvc_names_them():
    """sft and rm log their MLflow run under the stage's DVC name, a planning instance's too (it was logged as
    grammar_sft@1, not grammar_plan_sft@1: the run could not be found by its stage)."""
    from pipelines.common import upstream_stage_name

    for stage in (s for chain in CHAINS for s in chain):
        group, instance = stage.split("@")
        kind = group.rsplit("_", 1)[1]
        assert upstream_stage_name("grammar", PARAMS.grammar, kind, int(instance)) == stage
