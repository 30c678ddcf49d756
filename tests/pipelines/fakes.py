"""Stand-ins for the runner's tests: a cell function that only sleeps and writes a summary, and a DVC whose commit
rewrites its lock file in place, slowly, the way DVC rewrites dvc.lock (so an interrupted commit leaves it cut).

    python -m tests.pipelines.fakes dvc status --json   # every cell of ./params.yaml (calibration too) is stale
    python -m tests.pipelines.fakes dvc repro ...       # does nothing
    python -m tests.pipelines.fakes commit STAGE...     # adds them to fake.lock (JSON) in place, over FAKE_COMMIT_S

Environment: FAKE_DIR (where workers drop pid files and the commit drops `committing`; `dvc repro` appends its
arguments to FAKE_DIR/repro, one call a line, and `dvc status` a line to FAKE_DIR/status; ``tail`` its stage to
FAKE_DIR/tails), FAKE_FAST (the first FAKE_FAST cells of ablations.grid.cells -- the calibration cells come first --
take 0.05 s, the others a minute), FAKE_COMMIT_S (default 0), FAKE_TOGETHER (``placed``), FAKE_STALE (upstream stages
`dvc status` reports until committed, comma-separated; default none), FAKE_FAIL (the upstream stage that fails).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

LOCK = Path("fake.lock")


def runner_script(cell_fn: str = "sleepy", fake_dvc: bool = True, gpus: tuple[str, ...] | None = ()) -> str:
    """`python -c` source that runs pipelines.runner.cli.main with a cell function of this module (and its DVC and
    upstream stages; with real DVC, the real stages), on a machine whose visible CUDA devices are ``gpus`` (default:
    none, CPU workers; None: what torch sees). This module's functions are pickled by value for Ray (its nodes
    cannot import the tests)."""
    dvc = (
        "dvccli.DVC = [sys.executable, '-m', 'tests.pipelines.fakes', 'dvc']; "
        "dvccli.COMMIT = [sys.executable, '-m', 'tests.pipelines.fakes', 'commit']; "
    )
    stage, tail = ("fakes.stage", "fakes.tail") if fake_dvc else ("worker.upstream_stage", "worker.tail_stage")
    visible = "" if gpus is None else f"plan.visible_gpus = lambda: {list(gpus)!r}; "
    return (
        "import sys; from pipelines.runner import cli, dvccli, plan, worker; from tests.pipelines import fakes; "
        "fakes.by_value_for_ray(); "
        f"{dvc if fake_dvc else ''}{visible}"
        f"sys.exit(cli.main(sys.argv[1:], run_cell=fakes.{cell_fn}, run_stage={stage}, run_tail={tail}))"
    )


def by_value_for_ray() -> None:
    """Ray's pickler sends this module's functions by value (where Ray is installed)."""
    try:
        from ray import cloudpickle
    except ImportError:
        return
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def sleepy(params, cell) -> dict:
    """A cell: drops its pid, sleeps (briefly for the first FAKE_FAST cells), writes summary.json atomically
    (without torch, which pipelines.common imports)."""
    from ablations.grid import cells
    from pipelines.leftovers import temp_sibling

    (Path(os.environ["FAKE_DIR"]) / f"worker-{os.getpid()}").touch()
    fast = [c.stage for c in cells(params)][: int(os.environ.get("FAKE_FAST", "1000000"))]
    time.sleep(0.05 if cell.stage in fast else 60)
    tmp = temp_sibling(cell.out_dir)
    tmp.mkdir(parents=True)
    (tmp / "summary.json").write_text(json.dumps({"stage": cell.stage, "final_gold": float(cell.seed)}))
    os.replace(tmp, cell.out_dir)  # a fresh directory each time in these tests
    return {"final_gold": float(cell.seed), "wall_s": 0.0}


def placed(params, cell) -> dict:
    """A cell that records the GPU its worker was given (CUDA_VISIBLE_DEVICES; "unset" without) and the most cells
    it saw running at once, on its GPU (``peak``) and in all (``together``): each running cell drops a file, and a
    cell stays until FAKE_TOGETHER cells are there together, no other cell of its wave (calibration or evaluation)
    can come, or 3 s have passed. Writes FAKE_DIR/cell-<stage>.json."""
    from ablations.grid import cells

    gpu, here = os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), Path(os.environ["FAKE_DIR"])
    me = here / f"on-{gpu}-{os.getpid()}"
    me.touch()
    peak = together = 0
    earlier = sum(c.calibration for c in cells(params)) if not cell.calibration else 0  # cells of the first wave
    wave = [c for c in cells(params) if c.calibration == cell.calibration]
    n_cells, deadline = earlier + len(wave), time.monotonic() + 3.0
    while time.monotonic() < deadline:
        running = len(list(here.glob("on-*")))
        peak = max(peak, len(list(here.glob(f"on-{gpu}-*"))))
        together = max(together, running)
        if together >= int(os.environ["FAKE_TOGETHER"]) or running + len(list(here.glob("cell-*"))) == n_cells:
            break
        time.sleep(0.02)
    time.sleep(0.1)  # still here while the others look
    me.unlink()
    record = {"stage": cell.stage, "gpu": gpu, "pid": os.getpid(), "peak": peak, "together": together}
    (here / f"cell-{cell.stage}.json").write_text(json.dumps(record))
    return {"final_gold": float(cell.seed), "wall_s": 0.0}


def on_ray(params, cell) -> dict:
    """A cell on a Ray node: records its node, the GPU Ray gave it (CUDA_VISIBLE_DEVICES) and the most cells it saw
    running at once on that GPU of that node (``peak``) and in all (``together``): each running cell drops a file in
    FAKE_DIR (a folder every node sees), and stays until as many cells are there together as the cluster's GPUs hold
    shares like its own, every other cell of its wave has come, or 60 s have passed. Writes
    FAKE_DIR/cell-<stage>.json and summary.json."""
    import ray

    from ablations.grid import cells

    node, share = ray.get_runtime_context().get_node_id(), ray.get_runtime_context().get_assigned_resources()["GPU"]
    slots = round(ray.cluster_resources()["GPU"] / share)
    gpu, here = os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), Path(os.environ["FAKE_DIR"])
    me = here / f"on-{node}-{gpu}-{os.getpid()}"
    me.touch()
    wave = [c for c in cells(params) if c.calibration == cell.calibration]
    earlier = sum(c.calibration for c in cells(params)) if not cell.calibration else 0
    peak = together = 0
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        running = len(list(here.glob("on-*")))
        peak, together = max(peak, len(list(here.glob(f"on-{node}-{gpu}-*")))), max(together, running)
        if together >= slots or running + len(list(here.glob("cell-*"))) == earlier + len(wave):
            break
        time.sleep(0.02)
    time.sleep(0.2)  # still here while the others look
    me.unlink()
    record = {"stage": cell.stage, "node": node, "gpu": gpu, "peak": peak, "together": together}
    (here / f"cell-{cell.stage}.json").write_text(json.dumps(record))
    cell.out_dir.mkdir(parents=True)
    (cell.out_dir / "summary.json").write_text(json.dumps(record))
    return {"final_gold": 0.0, "wall_s": 0.0}


RAISES_ON_RAY = "grammar_calibration_baseline@0-0"  # the cell ``raises_on_ray`` fails


def raises_on_ray(params, cell) -> dict:
    """A cell on a Ray node that drops FAKE_DIR/attempt-<stage>-<pid> each time it starts; RAISES_ON_RAY raises,
    the others write summary.json."""
    (Path(os.environ["FAKE_DIR"]) / f"attempt-{cell.stage}-{os.getpid()}").touch()
    if cell.stage == RAISES_ON_RAY:
        raise ValueError(f"{cell.stage} broke")
    cell.out_dir.mkdir(parents=True)
    (cell.out_dir / "summary.json").write_text(json.dumps({"stage": cell.stage}))
    return {"final_gold": 0.0, "wall_s": 0.0}


def stage(params, up) -> dict:
    """An upstream stage: writes FAKE_DIR/stage-<name>.json with its start and end times and the stages of other
    chains it saw running (each running stage drops a file; a stage waits up to 5 s to meet another one); fails if
    it is FAKE_FAIL."""
    here = Path(os.environ["FAKE_DIR"])
    me, start = here / f"running-{up.stage}", time.time()
    me.touch()
    deadline, others = time.monotonic() + 5.0, set()
    while time.monotonic() < deadline and not others:
        others = {p.name.removeprefix("running-") for p in here.glob("running-*")} - {up.stage}
        time.sleep(0.02)
    time.sleep(0.1)  # still here while the others look
    me.unlink()
    if up.stage == os.environ.get("FAKE_FAIL"):
        raise ValueError(f"{up.stage} broke")
    record = {"start": start, "end": time.time(), "others": sorted(others)}
    (here / f"stage-{up.stage}.json").write_text(json.dumps(record))
    return {"wall_s": 0.0}


def tail(params, t) -> dict:
    """A stage after a wave (calibrate, analysis): appends to FAKE_DIR/tails its name, the cells of its task with
    outputs by then, and the other tails it met running (it waits up to FAKE_TAIL_WAIT seconds, default 0, to meet
    one), one line each."""
    from ablations.grid import cells

    here = Path(os.environ["FAKE_DIR"])
    me, others = here / f"tail-{t.stage}", set()
    me.touch()
    deadline = time.monotonic() + float(os.environ.get("FAKE_TAIL_WAIT", "0"))
    while time.monotonic() < deadline and not others:
        others = {p.name.removeprefix("tail-") for p in here.glob("tail-*")} - {t.stage}
        time.sleep(0.02)
    time.sleep(0.1 if others else 0)  # still here while the others look
    me.unlink()
    done = sum((c.out_dir / "summary.json").exists() for c in cells(params) if c.task == t.task)
    with open(here / "tails", "a") as f:
        f.write(f"{t.stage} after {done} cells{''.join(f' with {o}' for o in sorted(others))}\n")
    return {"wall_s": 0.0}


def by_value(params, cell) -> dict:
    """A cell as a Ray worker runs it (pipelines/runner/remote.py): reads its instance's data/<task>/<i>/task.pt
    if it was shipped, logs an MLflow run (two eval/gold values, an artifact), writes summary.json; instance 101
    fails."""
    from pipelines import tracking

    data = Path(f"data/{cell.task}/{cell.instance}/task.pt")
    with tracking.stage_run(cell.stage, params.mlflow.experiment, {"seed": cell.seed}) as (client, rid):
        tracking.log_metrics(client, rid, [{"iteration": 0, "gold": 0.5}, {"iteration": 1, "gold": 0.75}], "eval/")
        if cell.instance == 101:
            raise ValueError(f"{cell.stage} broke")
        notes = Path("notes")
        notes.mkdir(exist_ok=True)
        (notes / "what.txt").write_text("an artifact")
        client.log_artifact(rid, str(notes / "what.txt"), artifact_path="notes")
    cell.out_dir.mkdir(parents=True)
    (cell.out_dir / "summary.json").write_text(json.dumps({"read": data.read_text() if data.exists() else None}))
    return {"final_gold": 0.0, "wall_s": 0.0}


def slow_real(params, cell) -> dict:
    """The real cell (pipelines.ppo.run_cell) for the first FAKE_FAST cells; the others open their MLflow run and
    sleep in it for a minute, as a long PPO run would (a signal then finds a RUNNING run to mark FAILED)."""
    from ablations.grid import cells
    from pipelines import tracking
    from pipelines.ppo import run_cell

    (Path(os.environ["FAKE_DIR"]) / f"worker-{os.getpid()}").touch()
    if cell.stage in [c.stage for c in cells(params)][: int(os.environ["FAKE_FAST"])]:
        return run_cell(params, cell)
    with tracking.stage_run(cell.stage, params.mlflow.experiment, {}):
        time.sleep(60)
    raise AssertionError("a slow cell must be stopped")


def committed(path: Path = LOCK) -> list[str]:
    """The stages recorded in the fake lock; raises if it is cut."""
    return json.loads(path.read_text())["stages"] if path.exists() else []


def _commit(names: list[str]) -> None:
    (Path(os.environ["FAKE_DIR"]) / "committing").touch()
    text = json.dumps({"stages": [*committed(), *names]})
    delay = float(os.environ.get("FAKE_COMMIT_S", "0")) / len(text)
    with open(LOCK, "w") as f:  # in place, like DVC: cut if killed before the end
        for ch in text:
            f.write(ch)
            f.flush()
            time.sleep(delay)


def main(argv: list[str]) -> int:
    if argv[:1] == ["commit"]:
        _commit([a for a in argv[1:] if not a.startswith("--ran-with=")])
    elif argv[:2] == ["dvc", "repro"]:
        with open(Path(os.environ["FAKE_DIR"]) / "repro", "a") as f:
            f.write(" ".join(argv[2:]) + "\n")
    elif argv[:3] == ["dvc", "status", "--json"]:
        from ablations.config import load_params
        from ablations.grid import cells

        with open(Path(os.environ["FAKE_DIR"]) / "status", "a") as f:  # one line a call
            f.write("status\n")
        done = set(committed())
        stale = [s for s in os.environ.get("FAKE_STALE", "").split(",") if s] + [c.stage for c in cells(load_params())]
        print(json.dumps({s: ["changed"] for s in stale if s not in done}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def sleepy_group(params, group) -> dict:
    """A population (pipelines/runner/population.py ``Group``): ``sleepy`` for each of its cells, in one worker call;
    writes FAKE_DIR/group-<first stage>.json with its cells' stages."""
    for cell in group.cells:
        sleepy(params, cell)
    (Path(os.environ["FAKE_DIR"]) / f"group-{group.cells[0].stage}.json").write_text(
        json.dumps([c.stage for c in group.cells])
    )
    return {"final_gold": 0.0, "wall_s": 0.0, "cells": len(group.cells)}


def env(workdir: Path, **extra: str) -> dict[str, str]:
    """The environment of a runner started on ``workdir`` with fake DVC and fake cells (no MLflow work)."""
    from tests.conftest import REPO  # here, not at the top: the fake DVC command imports this module

    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FAKE_DIR": str(workdir / "fake"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'none.db'}",  # never created: no MLflow work
        **extra,
    }
