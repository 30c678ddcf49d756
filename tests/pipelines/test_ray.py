"""The grid runner on a real two-node Ray cluster on this machine (tests/pipelines/cluster.py: a head and a second
node started with `ray start`, the second unable to see the repository or this checkout): a run through the cluster
is bit-identical to the same run through the local pool; a node killed mid-cell loses nothing; Ctrl-C leaves dvc.lock
valid and no Ray task running; GPUs declared on the nodes are placed one per cell, or 1/N with --workers-per-gpu.

Slow (minutes; CI runs them with `make test-all`); skipped where Ray is not installed (the `ray` extra, which `dev`
includes) or where no mount namespace can be made (unshare(1) as root, or with unprivileged user namespaces).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from pipelines.runner import lockfile
from tests.conftest import repo_params
from tests.pipelines import cluster as ray_cluster
from tests.pipelines.fakes import RAISES_ON_RAY, committed, env, runner_script
from tests.pipelines.procs import wait_for
from tests.pipelines.tiny import ALL_CELLS, TINY, cell_stages, make_repo, stage_env, visible_runs

pytestmark = pytest.mark.slow
pytest.importorskip("ray")
if subprocess.run(["unshare", "--mount", *(["--map-root-user"] if os.geteuid() else []), "true"]).returncode:
    pytest.skip("no mount namespace here (unshare --mount)", allow_module_level=True)

PY = sys.executable
EVALUATION = ("grammar_baseline@", "grammar_design@", "grammar_design_")  # the 28 evaluation cells of the tiny grid


@pytest.fixture(scope="module")
def hidden(tmp_path_factory) -> Path:
    """Where this module's repositories live: an empty folder on the second node."""
    return tmp_path_factory.mktemp("hidden")


@pytest.fixture(scope="module")
def cluster(hidden):
    c = ray_cluster.start([hidden], head=("--num-cpus=1",), node=("--num-cpus=1",))
    yield c
    c.stop()


def run_on(c: ray_cluster.Cluster, repo: Path, *flags: str) -> subprocess.Popen:
    """The runner in ``repo`` (its own process group, as a terminal's job) on cluster ``c``; output in run.log."""
    environ = {**stage_env(repo), **{k: v for k, v in c.env.items() if k.startswith("RAY_")}}
    cmd = [PY, "-m", "pipelines.run", "--ray-address", c.address, *flags]
    log = open(repo / "run.log", "w")  # noqa: SIM115 (the runner's, for its life)
    return subprocess.Popen(cmd, cwd=repo, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, repo: Path, timeout: float = 1500) -> str:
    proc.wait(timeout)
    return (repo / "run.log").read_text()


def outs(repo: Path) -> dict[str, dict]:
    """Every stage's outputs in ``repo``'s dvc.lock: {stage: {path: md5}}."""
    stages = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {s: {o["path"]: o["md5"] for o in v.get("outs", [])} for s, v in stages.items()}


def status(repo: Path) -> set[str]:
    out = subprocess.run(
        [PY, "-m", "dvc", "status", "--json"], cwd=repo, env=stage_env(repo), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout or "{}"))


def forget(repo: Path, prefixes: tuple[str, ...]) -> set[str]:
    """Removes the stages named ``prefixes...`` from ``repo``'s dvc.lock (as if they had never run); their names."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    gone = {s for s in lock["stages"] if s.startswith(prefixes)}
    lock["stages"] = {s: v for s, v in lock["stages"].items() if s not in gone}
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    return gone


@pytest.fixture(scope="module")
def finished(cluster, hidden):
    """The tiny grid from nothing, through the cluster (``ray``) and through the local pool (``local``)."""
    repos = {name: make_repo(hidden / name, repo_params(TINY)) for name in ("ray", "local")}
    local = subprocess.run(
        [PY, "-m", "pipelines.run", "--workers", "2"],
        cwd=repos["local"],
        env=stage_env(repos["local"]),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert local.returncode == 0, local.stdout + local.stderr
    start = time.perf_counter()
    proc = run_on(cluster, repos["ray"])
    log = finish(proc, repos["ray"])
    assert proc.returncode == 0, log
    return {**repos, "log": log, "seconds": time.perf_counter() - start}


PROBE = """
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

@ray.remote(num_cpus=0)
def read(paths):
    out = {}
    for p in paths:
        try:
            out[p] = len(open(p, "rb").read())
        except OSError as e:
            out[p] = type(e).__name__
    return out

paths, nodes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
on = lambda node: NodeAffinitySchedulingStrategy(node, soft=False)
print(json.dumps({k: ray.get(read.options(scheduling_strategy=on(v)).remote(paths)) for k, v in nodes.items()}))
"""


def test_the_second_node_cannot_read_the_repository_or_this_checkout(cluster, hidden):
    repo = make_repo(hidden / "probe", repo_params(TINY))
    paths = [str(repo / "params.yaml"), *(str(d / "__init__.py") for d in ray_cluster.code_dirs())]
    got = cluster.run(PROBE, json.dumps(paths), json.dumps(cluster.nodes()))
    for p in paths:
        assert got["head"][p] == Path(p).stat().st_size, got  # the head sees them
        assert got["node"][p] == "FileNotFoundError", got  # a task pinned to the other cannot


def test_a_run_through_the_cluster_is_bit_identical_to_the_local_pool(finished, cluster):
    ray, local, log = finished["ray"], finished["local"], finished["log"]
    assert "Ray: each cell asks for 1 CPU and 0 GPU" in log and "5 upstream chains to build" in log, log
    assert "7 of 7 calibration cells to run on Ray" in log and "30 of 30 planning cells to run on Ray" in log, log
    assert "28 of 28 grid cells to run on Ray" in log, log
    got, want = outs(ray), outs(local)
    tails = {"grammar_calibrate", "grammar_planning", "grammar_analysis"}
    assert set(got) == set(want) == {*ALL_CELLS, *finished_upstream(), *tails}
    assert got == want  # every output of every stage: same bytes
    for rel in ("protocol/grammar.json", "protocol/grammar.plan.json", "reports/grammar/report.md",
                "reports/grammar/stats.json"):  # fmt: skip
        assert (ray / rel).read_bytes() == (local / rel).read_bytes(), rel
    assert not status(ray)
    # MLflow: one FINISHED run per stage in the runner's store, logged there by the runner, cells from both nodes
    runs = visible_runs(ray)
    assert set(runs) == set(visible_runs(local)) and all(len(v) == 1 for v in runs.values())
    assert {r.info.status for v in runs.values() for r in v} == {"FINISHED"}
    assert {r.data.tags["repo_root"] for v in runs.values() for r in v} == {str(ray)}
    nodes = Counter(runs[s][0].data.tags.get("ray_node") for s in ALL_CELLS)
    assert set(nodes) == set(cluster.nodes().values()), nodes  # both nodes ran cells
    print(f"cluster run: {finished['seconds']:.0f} s; cells per node: {dict(nodes)}")


def finished_upstream() -> set[str]:
    kinds = ("data", "sft", "rm", "eval0")
    instances = (("calibration_", 0), ("plan_", 1), ("plan_", 2), ("", 10), ("", 11))
    return {f"grammar_{p}{k}@{i}" for k in kinds for p, i in instances}


def test_ctrl_c_leaves_dvc_lock_valid_and_no_ray_task_running(finished, cluster, hidden):
    repo = hidden / "ctrl-c"
    shutil.copytree(finished["ray"], repo, symlinks=True)
    forgotten = forget(repo, EVALUATION)
    proc = run_on(cluster, repo, "--commit-every", "0")
    try:
        wait_for(lambda: "dvc.lock: recorded" in (repo / "run.log").read_text() or proc.poll() is not None, 600)
        wait_for(lambda: cluster.task_pids() or proc.poll() is not None, 120)
        assert proc.poll() is None, (repo / "run.log").read_text()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        log = finish(proc, repo, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, log
    assert "stopped by SIGINT: " in log and "Traceback" not in log, log
    assert lockfile.problem(repo / "dvc.lock") is None  # DVC's own schema check
    stale = status(repo)
    assert stale and stale < forgotten | {"grammar_analysis"}, stale  # some recorded, the others left stale
    wait_for(lambda: not cluster.task_pids(), 30)  # no task of the runner left running on the cluster
    # and a rerun does the rest, to the same bytes
    proc = run_on(cluster, repo)
    log = finish(proc, repo)
    assert proc.returncode == 0 and not status(repo), log
    assert outs(repo) == outs(finished["ray"])


def test_a_node_killed_mid_cell_loses_nothing_and_the_run_completes(finished, tmp_path_factory):
    hidden = tmp_path_factory.mktemp("hidden-kill")
    repo = hidden / "repo"
    shutil.copytree(finished["ray"], repo, symlinks=True)
    forgotten = forget(repo, EVALUATION)
    c = ray_cluster.start([hidden], head=("--num-cpus=1",), node=("--num-cpus=1",))
    try:
        proc = run_on(c, repo)
        wait_for(lambda: c.task_pids("node") or proc.poll() is not None, 600)
        assert proc.poll() is None, (repo / "run.log").read_text()
        c.kill("node")  # the second node goes down mid-cell
        log = finish(proc, repo)
    finally:
        c.stop()
    assert proc.returncode == 0, log
    assert "FAILED" not in log and not status(repo), log
    assert outs(repo) == outs(finished["ray"])  # every cell's outputs, the lost one's included: same bytes
    wave = f"/{len(forgotten) + 1}] grammar_"  # "[k/N] <stage>:": the forgotten cells, then the analysis
    finished_cells = [line for line in log.splitlines() if line.startswith("[") and wave in line]
    assert {line.split()[1].rstrip(":") for line in finished_cells} == forgotten | {"grammar_analysis"}


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    """Two nodes, each declaring 2 GPUs and 4 CPUs (`ray start --num-gpus 2` on a CPU machine), and a folder both
    see (FAKE_DIR) where the fake cells meet."""
    fake = tmp_path_factory.mktemp("fake")
    flags = ("--num-cpus=4", "--num-gpus=2")
    c = ray_cluster.start([], head=flags, node=flags, env={"FAKE_DIR": str(fake)})
    yield c, fake
    c.stop()


@pytest.mark.parametrize(("flags", "share", "per_gpu"), [((), "1", 1), (("--workers-per-gpu", "2"), "0.5", 2)])
def test_gpus_declared_on_the_nodes_are_placed_one_per_cell_or_1_over_n(gpu_cluster, workdir, flags, share, per_gpu):
    c, fake = gpu_cluster
    for p in fake.iterdir():
        p.unlink()
    slots = 2 * 2 * per_gpu  # 2 nodes x 2 GPUs x cells per GPU
    environ = {**env(workdir), "FAKE_DIR": str(fake)}
    environ |= {k: v for k, v in c.env.items() if k.startswith("RAY_")}
    out = subprocess.run(
        [PY, "-c", runner_script("on_ray"), "--ray-address", c.address, "--commit-every", "0", *flags],
        cwd=workdir,
        env=environ,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"Ray: each cell asks for 1 CPU and {share} GPU" in out.stdout, out.stdout
    records = [json.loads(p.read_text()) for p in fake.glob("cell-*.json")]
    cells = {r["stage"] for r in records}
    assert len(records) == len(cells) == len(ALL_CELLS) and set(committed(workdir / "fake.lock")) >= cells
    assert {r["gpu"] for r in records} <= {"0", "1"}  # one GPU each, as Ray assigned it
    assert max(r["peak"] for r in records) == per_gpu  # never more cells on one GPU of one node, and that many met
    assert max(r["together"] for r in records) == slots  # every GPU share of both nodes in use at once
    assert len({r["node"] for r in records}) == 2
    for stage in cell_stages():  # each cell's files came back from its node
        kind, key = stage.split("@")
        folder = "design" if kind.startswith("grammar_design") else kind.removeprefix("grammar_")  # any design group
        summary = json.loads((workdir / f"runs/grammar/{folder}/{key}/summary.json").read_text())
        assert summary["stage"] == stage


def test_a_cell_that_raises_on_a_node_is_reported_in_one_line_and_not_retried(gpu_cluster, workdir):
    c, fake = gpu_cluster
    for p in fake.iterdir():
        p.unlink()
    environ = {**env(workdir), "FAKE_DIR": str(fake), **{k: v for k, v in c.env.items() if k.startswith("RAY_")}}
    out = subprocess.run(
        [PY, "-c", runner_script("raises_on_ray"), "--ray-address", c.address, "--commit-every", "0"],
        cwd=workdir,
        env=environ,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"] FAILED {RAISES_ON_RAY}: ValueError: {RAISES_ON_RAY} broke\n" in out.stdout, out.stdout
    assert out.stderr.splitlines()[-1].startswith(f"error: 1 stages failed: {RAISES_ON_RAY}; fix and re-run")
    attempts = Counter(p.name.removeprefix("attempt-").rsplit("-", 1)[0] for p in fake.glob("attempt-*"))
    assert attempts[RAISES_ON_RAY] == 1 and len(attempts) == 7, attempts  # not retried; the other cells ran
    assert set(committed(workdir / "fake.lock")) == {s for s in attempts if s != RAISES_ON_RAY}  # and are kept
