"""The runner's command line and its waves: upstream chains, calibration cells, the calibrate stages, evaluation
cells, the analysis (pipelines.runner's docstring tells the whole story)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ablations.config import Params, ParamsError, load_params
from ablations.grid import (
    Cell,
    calibrate_stages,
    calibration_cells,
    evaluation_cells,
    plan_cells,
    plan_stages,
    upstream_chains,
)
from pipelines import runner, tracking
from pipelines.cpu import THREADS_ENV
from pipelines.runner import mlflow_runs, plan
from pipelines.runner.dvccli import check_interpreter, dvc, stage_env
from pipelines.runner.local import LocalPool
from pipelines.runner.ray import RayPool
from pipelines.runner.record import Recorder, check_stale
from pipelines.runner.repo import prepare, runner_lock
from pipelines.runner.signals import POLL_S, Interrupted, RunnerError, Signals, last_line
from pipelines.runner.worker import RAN_WITH, ppo_cell, upstream_stage


def _progress(i: int, n: int, cell: Cell, s: dict, elapsed: float) -> str:
    shown = [
        ("gold", "final_gold", 3),
        ("proxy", "final_proxy", 3),
        ("ood", "final_ood_gold", 3),
        ("KL", "final_kl", 2),
    ]
    values = " ".join(f"{label} {s[k]:.{d}f}" for label, k, d in shown if isinstance(s.get(k), int | float))
    return f"[{i}/{n}] {cell.stage}: {values}{' ' if values else ''}({s.get('wall_s', 0):.0f}s, {elapsed:.0f}s elapsed)"


def run_cells(todo: list, backend, recorder: Recorder, sig: Signals, run_cell, experiment: str) -> list[str]:
    """Runs ``todo`` (cells, or Upstream stages: when one finishes, its ``next`` is queued) on ``backend``,
    recording finished ones as they finish; returns the failed stages. On a signal (or an error of the runner
    itself) stops the workers, marks the unfinished stages' MLflow runs FAILED and records every finished one
    before raising."""
    root, start, what = str(Path.cwd()), time.perf_counter(), recorder.what
    pending = {backend.submit(root, c, run_cell): c for c in todo}
    n, done = len(todo) + sum(len(getattr(c, "rest", ())) for c in todo), 0
    failed: list[str] = []
    try:
        while pending and not sig.signum:
            for handle in backend.wait(set(pending), POLL_S):
                cell, done = pending.pop(handle), done + 1
                try:
                    s = backend.result(handle)
                except Exception as e:  # report and go on: the other cells are still worth having
                    failed.append(cell.stage)
                    print(f"[{done}/{n}] FAILED {cell.stage}: {tracking.fault_line(e) or last_line(e)}", flush=True)
                    continue
                print(_progress(done, n, cell, s, time.perf_counter() - start), flush=True)
                for member in getattr(cell, "cells", (cell,)):  # a population (pipelines/population.py): each cell
                    recorder.add(member, s.get(RAN_WITH))
                if getattr(cell, "next", None) and s.get(RAN_WITH) is not None:
                    pending[backend.submit(root, cell.next, run_cell)] = cell.next
            recorder.poll()
    finally:
        if pending:
            print(f"stopping {len(pending)} unfinished {what}; recording the finished ones ...", flush=True)
            backend.stop(list(pending))
        recorder.finish()
        if pending:
            stopped = {m.stage for c in pending.values() for m in getattr(c, "cells", (c,))}
            mlflow_runs.fail_runs(experiment, "stopped by the grid runner", stopped)
    sig.check(
        f"{len(recorder.recorded)} finished {what} are recorded in dvc.lock, {len(pending)} were stopped "
        "(MLflow runs marked FAILED); run again to do the rest"
    )
    return failed


@dataclass
class Sweep:
    """One invocation's waves on one set of workers (started at the first wave with work: Ray connects at once)."""

    args: argparse.Namespace
    sig: Signals
    params: Params
    env: dict[str, str]
    workers: int
    slots: list[str] | None
    run_cell: Callable
    run_stage: Callable
    pool: list = field(default_factory=list)

    def backend(self):
        if not self.pool:
            ray = self.args.ray_address
            self.pool.append(RayPool(ray, self.args.workers_per_gpu) if ray else LocalPool(self.workers, self.slots))
        return self.pool[0]

    def close(self) -> None:
        for b in self.pool:
            b.close()

    def upstream(self) -> None:
        """The stale upstream chains (data -> sft -> rm), all of them before any cell."""
        chains = upstream_chains(self.params, evaluation=not self.args.calibration_only)
        ups = plan.stale_chains(chains, self.env, self.sig)
        if not ups:
            return
        print(f"{len(ups)} upstream chains to build: {', '.join(u.stage for u in ups)}", flush=True)
        recorder = Recorder(self.env, self.args.commit_every, "upstream stages")
        failed = run_cells(ups, self.backend(), recorder, self.sig, self.run_stage, self.params.mlflow.experiment)
        if failed:
            raise RunnerError(f"upstream stage failed: {', '.join(failed)}; its message is above; no cell ran")
        check_stale(recorder)

    def wave(self, grid: list[Cell], what: str) -> None:
        """Runs the stale cells of ``grid`` on the workers, recording them as they finish; RunnerError if any
        failed."""
        todo = plan.stale_cells(grid, self.env, self.sig)
        where = plan.where(self.workers, self.slots, self.args.ray_address)
        print(f"{len(todo)} of {len(grid)} {what} to run on {where}", flush=True)
        if not todo:
            return
        run_cell = self.run_cell
        if self.args.population:  # groups of cells, each group one batched computation in a worker
            from pipelines import population

            todo, run_cell = population.plan(self.params, todo, self.args.population), population.executor(run_cell)
        recorder = Recorder(self.env, self.args.commit_every)
        failed = run_cells(todo, self.backend(), recorder, self.sig, run_cell, self.params.mlflow.experiment)
        if failed:
            n, names = len(failed), ", ".join(failed)
            raise RunnerError(f"{n} cells failed: {names}; fix and re-run (finished cells are kept)")
        check_stale(recorder)

    def cells(self) -> None:
        """Upstream, calibration cells, the calibrate stages (the protocol is fixed on the calibration cells before
        any evaluation cell runs; dvc.yaml's DAG too), the plan cells and the planning stages (each comparison's
        sample size, fixed before any evaluation cell runs), evaluation cells."""
        self.upstream()
        self.wave(calibration_cells(self.params), "calibration cells")
        dvc(["repro", *calibrate_stages(self.params)], self.env, self.sig)
        self.wave(plan_cells(self.params), "planning cells")
        dvc(["repro", *plan_stages(self.params)], self.env, self.sig)
        if self.args.calibration_only:
            print(
                "calibration and plan done: protocol/<task>.json and protocol/<task>.plan.json written; commit them "
                "before the evaluation",
                flush=True,
            )
            return
        self.wave(evaluation_cells(self.params), "grid cells")


def load(args: argparse.Namespace) -> Params:
    if not Path(".dvc").is_dir():
        raise RunnerError("no .dvc directory here: run the runner from the repository's root", 2)
    try:
        return load_params()
    except ParamsError as e:
        raise RunnerError(str(e), 2) from None


def run(args: argparse.Namespace, sig: Signals, run_cell=ppo_cell, run_stage=upstream_stage) -> None:
    start, params = time.perf_counter(), load(args)
    workers, slots = plan.placement(args, [] if args.ray_address else plan.visible_gpus())
    env = stage_env()
    check_interpreter(env)
    with runner_lock():
        os.environ[tracking.RUNNER_ENV] = str(os.getpid())  # the workers' stages pass refuse_beside_runner
        prepare(params.mlflow.experiment)
        sig.check("stopped before any compute")
        os.environ.setdefault(THREADS_ENV, "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
        with mlflow_runs.sweep(params.mlflow.experiment, env):
            sweep = Sweep(args, sig, params, env, workers, slots, run_cell, run_stage)
            try:
                sweep.cells()
            finally:
                sweep.close()
            if args.calibration_only:
                return
            if not args.no_analysis:  # the running tasks' analyses (a task with no instances has none to run)
                dvc(["repro", *(f"{task}_analysis" for task in params.tasks())], env, sig)
    print(f"done in {time.perf_counter() - start:.0f}s", flush=True)


def main(argv: list[str] | None = None, run_cell=ppo_cell, run_stage=upstream_stage) -> int:
    """The command line; ``run_cell(params, cell) -> summary`` runs one cell in a worker, ``run_stage(params,
    upstream) -> summary`` one upstream stage (tests swap them)."""
    ap = argparse.ArgumentParser(description=runner.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, help="local processes (default: cores; with CUDA: one per GPU)")
    ap.add_argument("--gpus", help="GPUs for local workers, e.g. 0,1 (default with CUDA: every visible GPU)")
    ap.add_argument("--workers-per-gpu", type=int, help="workers (cells at once) per GPU; on Ray: 1/N GPU per cell")
    ap.add_argument("--ray-address", help="Ray cluster address ('auto', 'ray://host:10001' or 'local')")
    ap.add_argument(
        "--population", type=int, help="up to N stale cells of one structure per worker, as one batched computation"
    )
    ap.add_argument("--no-analysis", action="store_true", help="stop after the grid cells")
    ap.add_argument(
        "--calibration-only", action="store_true", help="stop once the calibration and the plan are fixed (protocol/)"
    )
    ap.add_argument(
        "--commit-every", type=float, default=60.0, help="seconds between recordings of finished cells (default 60)"
    )
    args = ap.parse_args(argv)
    try:
        with Signals() as sig:
            run(args, sig, run_cell, run_stage)
    except Interrupted as e:
        print(f"stopped by {e}", file=sys.stderr, flush=True)
        return e.code
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.code
    except Exception as e:  # a full disk or a corrupt store: one line; a bug of the runner: the traceback in a file
        fault = tracking.fault_line(e)
        if fault:
            print(f"error: {fault}", file=sys.stderr, flush=True)
            return 1
        log = Path(tempfile.mkstemp(prefix="pipelines-run-", suffix=".txt")[1])
        log.write_text(traceback.format_exc())
        print(f"error: unexpected {type(e).__name__}: {last_line(e)} (traceback in {log})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
