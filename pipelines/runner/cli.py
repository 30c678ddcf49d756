"""The runner's command line and its waves: upstream chains, calibration cells and the calibrate stages, evaluation
cells and the analyses (pipelines.runner's docstring tells the whole story)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ablations.config import Params, ParamsError, load_params
from ablations.grid import Cell, calibration_cells, evaluation_cells, plan_cells, upstream_chains
from pipelines import runner, tracking
from pipelines.cpu import THREADS_ENV
from pipelines.runner import mlflow_runs, plan
from pipelines.runner.dvccli import check_interpreter, dvc, stage_env
from pipelines.runner.local import LocalPool
from pipelines.runner.ray import RayPool
from pipelines.runner.record import Recorder, check_stale
from pipelines.runner.repo import prepare, runner_lock
from pipelines.runner.signals import POLL_S, Interrupted, RunnerError, Signals, last_line
from pipelines.runner.worker import RAN_WITH, ppo_cell, tail_stage, upstream_stage


def _progress(i: int, n: int, job: plan.Job, s: dict, elapsed: float) -> str:
    shown = [
        ("gold", "final_gold", 3),
        ("proxy", "final_proxy", 3),
        ("ood", "final_ood_gold", 3),
        ("KL", "final_kl", 2),
    ]
    values = " ".join(f"{label} {s[k]:.{d}f}" for label, k, d in shown if isinstance(s.get(k), int | float))
    return f"[{i}/{n}] {job.stage}: {values}{' ' if values else ''}({s.get('wall_s', 0):.0f}s, {elapsed:.0f}s elapsed)"


def _task(work) -> str:
    return getattr(work, "task", None) or work.cells[0].task  # a cell or a Tail; a population's cells share it


def _ready(pending: dict, timeout: float) -> set:
    """The finished handles of ``pending`` (handle -> Job), waiting on each job's backend in turn."""
    backends: dict[int, tuple] = {}
    for handle, job in pending.items():
        backends.setdefault(id(job.backend), (job.backend, set()))[1].add(handle)
    return {h for b, handles in backends.values() for h in b.wait(handles, timeout / len(backends))}


def run_cells(
    todo: list[plan.Job], backend, recorder: Recorder, sig: Signals, run_cell, experiment: str, tails=()
) -> list[str]:
    """Runs ``todo`` (jobs: cells, populations of cells, or upstream stages, whose ``then`` is queued when they
    finish) on ``backend`` with ``run_cell``, and each of ``tails`` (jobs of plan.Tail stages, with their own
    function and backend) once every job of its task has finished; records each job's ``records`` as it finishes;
    returns the failed stages (a task with a failed job does not run its tail). On a signal (or an error of the
    runner itself) stops the workers, marks the unfinished stages' MLflow runs FAILED and records every finished one
    before raising."""
    root, start, what = str(Path.cwd()), time.perf_counter(), recorder.what
    waiting = {job.work.task: job for job in tails}
    counted = lambda job: not isinstance(job.work, plan.Tail | plan.Upstream)  # what a task's tail waits for
    left = Counter(_task(job.work) for job in todo if counted(job))
    pending: dict = {}

    def submit(job: plan.Job) -> None:
        job = replace(job, fn=job.fn or run_cell, backend=job.backend or backend)
        pending[job.backend.submit(root, job.work, job.fn)] = job

    def release() -> None:  # the tails whose task has nothing left to run
        for task in [t for t in waiting if not left[t]]:
            submit(waiting.pop(task))

    for job in todo:
        submit(job)
    release()
    n, done = sum(job.chain for job in todo) + len(tails), 0
    failed: list[str] = []
    try:
        while pending and not sig.signum:
            for handle in _ready(pending, POLL_S):
                job, done = pending.pop(handle), done + 1
                try:
                    s = job.backend.result(handle)
                except Exception as e:  # report and go on: the other cells are still worth having
                    failed.append(job.stage)
                    print(f"[{done}/{n}] FAILED {job.stage}: {tracking.fault_line(e) or last_line(e)}", flush=True)
                    if counted(job) and waiting.pop(_task(job.work), None):
                        print(f"not run: {_task(job.work)}'s stage after its cells ({job.stage} failed)", flush=True)
                    continue
                print(_progress(done, n, job, s, time.perf_counter() - start), flush=True)
                for member in job.records:
                    recorder.add(member, s.get(RAN_WITH))
                if job.then is not None and (s.get(RAN_WITH) or {}).get("params") is not None:
                    submit(replace(plan.upstream_job(job.then), fn=job.fn, backend=job.backend))
                if counted(job):
                    left[_task(job.work)] -= 1
                    release()
            recorder.poll()
    finally:
        if pending:
            print(f"stopping {len(pending)} unfinished {what}; recording the finished ones ...", flush=True)
            for b in {id(j.backend): j.backend for j in pending.values()}.values():
                b.stop([h for h, j in pending.items() if j.backend is b])
        recorder.finish()
        if pending:
            stopped = {m.stage for job in pending.values() for m in job.records}
            mlflow_runs.fail_runs(experiment, "stopped by the grid runner", stopped)
    sig.check(
        f"{len(recorder.recorded)} finished {what} are recorded in dvc.lock, {len(pending)} were stopped "
        "(MLflow runs marked FAILED); run again to do the rest"
    )
    return failed


@dataclass
class Sweep:
    """One invocation's waves on one set of workers (started at the first wave with work: Ray connects at once).
    On Ray the stages after a wave (calibrate, analysis), which read the repository's git history, run in local
    workers on the runner's machine, one per task at most."""

    args: argparse.Namespace
    sig: Signals
    params: Params
    env: dict[str, str]
    workers: int
    slots: list[str] | None
    run_cell: Callable
    run_stage: Callable
    run_tail: Callable = tail_stage
    pool: dict = field(default_factory=dict)
    known: dict | None = None  # the last `dvc status`, while no stage has run since (None: ask again)

    def stale(self) -> dict:
        """The stages `dvc status` calls changed or never run, asked once and reused by the next phase while nothing
        has run since: only a stage that runs changes what is stale (the runner ran on params.yaml as loaded at its
        start), so a `make settle` round with nothing upstream, calibration or planning to do asks once instead of
        four times (each about 2.5 min over an 860-cell grid on 2 cores)."""
        if self.known is None:
            self.known = plan.status(self.env, self.sig)
        return self.known

    def ran(self) -> None:
        """Something ran: the next phase asks `dvc status` again."""
        self.known = None

    def backend(self):
        if "cells" not in self.pool:
            ray = self.args.ray_address
            if ray:
                self.pool["cells"] = RayPool(ray, self.args.workers_per_gpu, self.params.mlflow.experiment)
            else:
                self.pool["cells"] = self.pool["tails"] = LocalPool(self.workers, self.slots)
        return self.pool["cells"]

    def tail_backend(self):
        if "tails" not in self.pool:
            self.backend()
        if "tails" not in self.pool:
            self.pool["tails"] = LocalPool(min(len(self.params.tasks()), os.cpu_count() or 1))
        return self.pool["tails"]

    def close(self) -> None:
        for b in {id(b): b for b in self.pool.values()}.values():
            b.close()

    def upstream(self) -> None:
        """The packaged models' conversions, then the stale upstream chains (data -> sft -> rm), all of them before
        any cell. No SFT stage depends on a conversion in DVC's graph (pipelines/dvcyaml.py PRETRAINED says why)."""
        if self.params.pretrained:
            dvc(["repro", *(f"pretrained@{name}" for name in self.params.pretrained)], self.env, self.sig)
            self.ran()
        chains = upstream_chains(self.params, evaluation=not self.args.calibration_only)
        ups = plan.stale_chains(chains, self.stale())
        if not ups:
            return
        self.ran()
        print(f"{len(ups)} upstream chains to build: {', '.join(u.stage for u in ups)}", flush=True)
        recorder = Recorder(self.env, self.args.commit_every, "upstream stages")
        jobs = [plan.upstream_job(u) for u in ups]
        failed = run_cells(jobs, self.backend(), recorder, self.sig, self.run_stage, self.params.mlflow.experiment)
        if failed:
            raise RunnerError(f"upstream stage failed: {', '.join(failed)}; its message is above; no cell ran")
        check_stale(recorder)

    def wave(self, grid: list[Cell], what: str, tail: str | None = None) -> None:
        """Runs the stale cells of ``grid`` on the workers, then each task's ``tail`` stage (plan.stale_tails) as soon
        as its cells have finished, recording them as they finish; RunnerError if any failed."""
        stale = self.stale()
        todo = [c for c in grid if c.stage in stale]
        tails = plan.stale_tails(tail, self.params.tasks(), stale, todo) if tail else []
        where = plan.where(self.workers, self.slots, self.args.ray_address)
        print(f"{len(todo)} of {len(grid)} {what} to run on {where}", flush=True)
        if tails:
            print(f"then, each once its task's cells have finished: {', '.join(t.stage for t in tails)}", flush=True)
        if not todo and not tails:
            return
        self.ran()
        run_cell, jobs = self.run_cell, plan.cell_jobs(todo)
        if self.args.population:  # groups of cells, each group one batched computation in a worker
            from pipelines.runner import population

            items = population.plan(self.params, todo, self.args.population)
            jobs = [plan.Job(x, x.cells if isinstance(x, population.Group) else (x,)) for x in items]
            run_cell = population.executor(run_cell)
        backend = self.backend()
        tail_jobs = [plan.Job(t, (t,), fn=self.run_tail, backend=self.tail_backend()) for t in tails]
        recorder = Recorder(self.env, self.args.commit_every)
        failed = run_cells(jobs, backend, recorder, self.sig, run_cell, self.params.mlflow.experiment, tail_jobs)
        if failed:
            n, names = len(failed), ", ".join(failed)
            raise RunnerError(f"{n} stages failed: {names}; fix and re-run (finished ones are kept)")
        check_stale(recorder)

    def cells(self) -> None:
        """Upstream, calibration cells and the calibrate stages (the protocol is fixed on the calibration cells before
        any evaluation cell runs; dvc.yaml's DAG too), the plan cells and the planning stages (each comparison's sample
        size, fixed before any evaluation cell runs), evaluation cells and the analyses."""
        self.upstream()
        self.wave(calibration_cells(self.params), "calibration cells", "calibrate")
        self.wave(plan_cells(self.params), "planning cells", "planning")
        if self.args.calibration_only:
            print(
                "calibration and plan done: protocol/<task>.json and protocol/<task>.plan.json written; commit them "
                "before the evaluation",
                flush=True,
            )
            return
        self.wave(evaluation_cells(self.params), "grid cells", None if self.args.no_analysis else "analysis")


def load(args: argparse.Namespace) -> Params:
    if not Path(".dvc").is_dir():
        raise RunnerError("no .dvc directory here: run the runner from the repository's root", 2)
    try:
        return load_params()
    except ParamsError as e:
        raise RunnerError(str(e), 2) from None


def run(
    args: argparse.Namespace, sig: Signals, run_cell=ppo_cell, run_stage=upstream_stage, run_tail=tail_stage
) -> None:
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
            sweep = Sweep(args, sig, params, env, workers, slots, run_cell, run_stage, run_tail)
            try:
                sweep.cells()
            finally:
                sweep.close()
            if args.calibration_only:
                return
    print(f"done in {time.perf_counter() - start:.0f}s", flush=True)


def main(argv: list[str] | None = None, run_cell=ppo_cell, run_stage=upstream_stage, run_tail=tail_stage) -> int:
    """The command line; ``run_cell(params, cell) -> summary`` runs one cell in a worker, ``run_stage(params,
    upstream) -> summary`` one upstream stage, ``run_tail(params, tail) -> summary`` one stage after a wave (tests
    swap them)."""
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
            run(args, sig, run_cell, run_stage, run_tail)
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
