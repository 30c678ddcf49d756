"""The runner's stages by value (pipelines/runner/remote.py, ray.py, mlflow_runs.py), without Ray: what a Ray task
is shipped (checked against DVC's own view of every stage's dependencies), what it runs in its scratch directory and
returns, and how the runner writes it back. tests/pipelines/test_ray.py runs the same through a real two-node cluster
(slow)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ablations.config import Params
from ablations.grid import cells, upstream_chains
from ablations.tasks import TASKS
from pipelines.runner import worker
from pipelines.runner.plan import Tail, Upstream
from pipelines.runner.ray import deliver, inputs
from tests.conftest import REPO, repo_params
from tests.pipelines.tiny import make_repo

CODE = ("rlhf", "ablations/", "pipelines/", "params.yaml")  # code travels as py_modules, params.yaml as text


def both_tasks() -> dict:
    """params.yaml with one calibration instance, two planning instances and one batch of evaluation instances per
    task, every design group on it."""
    first = [100, 101, 102, 103]
    groups = repo_params()["grammar"]["allocation"]
    one = {"instances": first, "calibration": {"instances": [0], "plan_instances": [1, 2]},
           "allocation": {g: first if a else [] for g, a in groups.items()}}  # fmt: skip
    return repo_params({task: one for task in TASKS})


def test_each_stage_is_shipped_the_upstream_outputs_dvc_yaml_says_it_reads(tmp_path):
    from dvc.repo import Repo

    params = both_tasks()
    root = make_repo(tmp_path / "repo", params)
    with Repo(str(root)) as repo:
        deps = {s.name: {d.def_path for d in s.deps} for s in repo.index.stages}
    p = Params.model_validate(params)
    items = [*cells(p), *(Upstream(s) for chain in upstream_chains(p) for s in chain)]
    assert {i.task if hasattr(i, "task") else i.stage.split("_")[0] for i in items} == set(TASKS)
    for item in items:
        want = {d for d in deps[item.stage] if not d.startswith(CODE)}
        assert {p.as_posix() for p in inputs(item)} == want, item.stage
    assert {s for s in deps if s not in {i.stage for i in items}} == {
        f"{t}_{k}" for t in TASKS for k in ("calibrate", "planning", "analysis")
    }  # every other stage reads the repository's history or many runs: they run on the runner's machine


def test_the_stages_after_a_wave_run_their_dvc_yaml_command_and_remove_their_outputs_first():
    for task in TASKS:
        argv, outs = worker._declared(f"{task}_calibrate")
        assert argv == ["pipelines.calibrate", task] and outs == [Path(f"protocol/{task}.json")]
        argv, outs = worker._declared(f"{task}_planning")
        assert argv == ["pipelines.plan", task] and outs == [Path(f"protocol/{task}.plan.json")]
        argv, outs = worker._declared(f"{task}_analysis")
        assert argv == ["pipelines.analysis", task] and Path(f"reports/{task}/figures") in outs
        assert Path(f"reports/{task}/stats.json") in outs
    assert Tail("grammar", "analysis").stage == "grammar_analysis"
    assert Tail("grammar", "planning").stage == "grammar_planning"


def test_a_cells_files_replace_its_folder_whole_and_other_files_one_by_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = Path("runs/grammar/baseline/10-0")
    (folder / "old.csv").parent.mkdir(parents=True)
    (folder / "old.csv").write_text("from an earlier run")
    Path("models/grammar/10").mkdir(parents=True)
    Path("models/grammar/10/keep.pt").write_text("kept")
    outputs = {f"{folder}/summary.json": b"{}", "models/grammar/10/sft.pt": b"w", "metrics/grammar/10/sft.json": b"1"}
    deliver(outputs, [folder])
    assert sorted(p.name for p in folder.iterdir()) == ["summary.json"]
    assert Path("models/grammar/10/sft.pt").read_bytes() == b"w" and Path("models/grammar/10/keep.pt").exists()
    assert Path("metrics/grammar/10/sft.json").read_bytes() == b"1"
    assert not [p for p in Path(".").rglob(".*tmp-*")]


JOB = """
import dataclasses, os, pickle, sys, tempfile  # noqa
from pathlib import Path
tmp = sys.argv[1]
tempfile.tempdir = tmp
os.makedirs(f"{tmp}/kl-placement-ray-999999999-gone")  # left by a worker process that was killed
from pipelines.runner import remote

remote.setup()  # first, as Ray runs it: pipelines.tracking takes the root from the working directory
from ablations.config import load_params
from ablations.grid import find_cell
from tests.pipelines import fakes

root, params = Path.cwd(), Path(tmp, "params.yaml").read_text()
cell = find_cell(load_params(Path(tmp, "params.yaml")), "grammar_baseline@100-0")
out = remote.run(remote.Job(cell, fakes.by_value, params, ("data/grammar/100/task.pt",)), b"instance data")
failed = remote.run(remote.Job(dataclasses.replace(cell, instance=101), fakes.by_value, params, ()))
left = sorted(p.name for p in Path(tmp).glob("kl-placement-ray-*"))
in_root = sorted(p.name for p in root.iterdir())
Path(tmp, "result.pkl").write_bytes(pickle.dumps((str(root), out, failed, left, in_root)))
"""


@pytest.mark.slow  # two MLflow stores, each ~5 s of CPU (schema migrations)
def test_a_job_runs_by_value_in_a_scratch_folder_and_its_files_and_mlflow_runs_come_back(tmp_path, monkeypatch):
    """remote.setup + remote.run as a Ray worker process runs them (in a subprocess: they change its working
    directory), then mlflow_runs.import_runs into this repository's store as the runner does."""
    from mlflow.tracking import MlflowClient

    from pipelines import tracking
    from pipelines.runner import mlflow_runs

    (tmp_path / "params.yaml").write_text(json.dumps(both_tasks()))  # YAML
    out = subprocess.run(
        [sys.executable, "-c", JOB, str(tmp_path)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    root, done, failed, left, in_root = pickle.loads((tmp_path / "result.pkl").read_bytes())
    assert Path(root).parent == tmp_path and Path(root).name.startswith("kl-placement-ray-")
    assert left == [Path(root).name]  # the killed worker's folder is gone, this one's is there until its exit
    assert done["error"] is None and done["summary"]["final_gold"] == 0.0
    ran_with = {"params": (tmp_path / "params.yaml").read_text(), "files": {}}  # no protocol file read
    assert done["summary"][worker.RAN_WITH] == ran_with
    # the input was there, the output comes back, the input does not
    assert done["outputs"] == {"runs/grammar/baseline/100-0/summary.json": b'{"read": "instance data"}'}
    assert "runs" not in in_root and "mlflow.db" in in_root  # the failed stage left no output
    (run,) = done["runs"]
    assert run["status"] == "FINISHED" and run["tags"]["dvc_stage"] == "grammar_baseline@100-0"
    assert run["tags"]["repo_root"] == root and run["params"] == {"seed": "0"}
    assert [(k, v, s) for k, v, _, s in run["metrics"]] == [("eval/gold", 0.5, 0), ("eval/gold", 0.75, 1)]
    assert run["artifacts"] == {"notes/what.txt": b"an artifact"}
    assert failed["error"] == "ValueError: grammar_baseline@101-0 broke" and failed["outputs"] == {}
    assert failed["summary"] is None and [r["status"] for r in failed["runs"]] == ["FAILED"]
    # as the runner logs them: this repository's root and commit, everything else as logged on the node
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'target.db'}")
    mlflow_runs.import_runs("e2e", done["runs"] + failed["runs"], "abc123")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'target.db'}")
    exp = client.get_experiment_by_name("e2e").experiment_id
    runs = {r.data.tags["dvc_stage"]: r for r in client.search_runs([exp])}
    ok, bad = runs["grammar_baseline@100-0"], runs["grammar_baseline@101-0"]
    assert ok.info.status == "FINISHED" and bad.info.status == "FAILED"
    assert ok.data.tags["repo_root"] == str(tracking.ROOT) and ok.data.tags["git_commit"] == "abc123"
    assert ok.info.run_name == "grammar_baseline@100-0" and ok.data.params == {"seed": "0"}
    assert [(m.value, m.step) for m in client.get_metric_history(ok.info.run_id, "eval/gold")] == [(0.5, 0), (0.75, 1)]
    assert [a.path for a in client.list_artifacts(ok.info.run_id, "notes")] == ["notes/what.txt"]
    assert ok.info.start_time == run["start_time"] and ok.info.end_time == run["end_time"]
    # imported again (the stage re-run): one visible run of it, as tracking.stage_run leaves
    mlflow_runs.import_runs("e2e", done["runs"], "abc123")
    assert [r.data.tags["dvc_stage"] for r in client.search_runs([exp])].count("grammar_baseline@100-0") == 1


def test_an_address_where_no_ray_head_answers_is_refused_in_one_line_at_once():
    import socket

    from pipelines.runner.ray import check_reachable
    from pipelines.runner.signals import RunnerError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RunnerError, match=rf"^--ray-address 127.0.0.1:{port}: no Ray head answers there \("):
        check_reachable(f"127.0.0.1:{port}")
    for left_to_ray in ("auto", "local", "ray://head:10001"):
        check_reachable(left_to_ray)
