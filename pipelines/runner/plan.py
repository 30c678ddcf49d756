"""What to run and where: the stale upstream chains and grid cells (per `dvc status`), and the placement of local
workers on CPUs or GPUs from the command-line flags."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from ablations.grid import Cell
from pipelines.runner.dvccli import dvc
from pipelines.runner.signals import RunnerError, Signals


def status(env: dict[str, str], sig: Signals) -> dict:
    """The stages that are changed or have never run, per `dvc status --json` (asking for the whole pipeline at once
    is ~10x faster than naming 100 stages, which DVC collects one by one)."""
    return json.loads(dvc(["status", "--json"], env, sig, capture=True) or "{}")


@dataclass(frozen=True)
class Tail:
    """A stage that follows a wave of cells, one per task: ``<task>_calibrate`` after the calibration cells,
    ``<task>_planning`` after the plan cells, ``<task>_analysis`` after the evaluation cells (each runs its dvc.yaml
    command). It runs in a worker as soon as every cell of its task in the wave has finished."""

    task: str
    kind: str  # "calibrate", "planning" or "analysis"

    @property
    def stage(self) -> str:
        return f"{self.task}_{self.kind}"


def stale_tails(kind: str, tasks, stale: dict, todo: list) -> list[Tail]:
    """The ``kind`` stages of ``tasks`` to run after a wave: each one `dvc status` calls ``stale`` now, or whose task
    has a cell to run (``todo``) in the wave; once a stage reruns, every stage after it must (as ``stale_chains``),
    so no second `dvc status` is needed when the wave ends."""
    ran = {c.task for item in todo for c in getattr(item, "cells", (item,))}
    return [Tail(task, kind) for task in tasks if f"{task}_{kind}" in stale or task in ran]


@dataclass(frozen=True)
class Upstream:
    """One stale upstream stage (``stage``, e.g. grammar_sft@0) and the stages after it in its chain."""

    stage: str
    rest: tuple[str, ...] = ()

    @property
    def next(self) -> Upstream | None:
        return Upstream(self.rest[0], self.rest[1:]) if self.rest else None


@dataclass(frozen=True)
class Job:
    """One submission to a worker: ``work`` is what the worker runs (a Cell, a population's Group of cells, an
    Upstream stage or a Tail), ``records`` the stages dvc.lock records when it finishes, ``then`` the Upstream stage
    that runs after it (the rest of its chain; ``chain`` counts it and those after it, for the progress count);
    ``fn`` and ``backend`` when it runs otherwise than its wave's cells (a Tail: in a local worker)."""

    work: object
    records: tuple
    then: Upstream | None = None
    chain: int = 1
    fn: Callable | None = None  # what the worker runs it with (None: the wave's function)
    backend: object | None = None  # where it runs (None: the wave's backend)

    @property
    def stage(self) -> str:
        return self.work.stage


def cell_jobs(cells: list[Cell]) -> list[Job]:
    return [Job(c, (c,)) for c in cells]


def upstream_job(up: Upstream) -> Job:
    return Job(up, (up,), up.next, 1 + len(up.rest))


def stale_chains(chains: list[list[str]], stale: dict) -> list[Upstream]:
    """The first stage of each chain that ``stale`` (a ``status``) names, with the rest of its chain after it:
    once a stage reruns, every stage after it must too (they depend on its outputs)."""
    firsts = [next((k for k, s in enumerate(c) if s in stale), None) for c in chains]
    return [Upstream(c[k], tuple(c[k + 1 :])) for c, k in zip(chains, firsts) if k is not None]


def visible_gpus() -> list[str]:
    """The CUDA devices this runner may place cells on, as CUDA_VISIBLE_DEVICES entries: the runner's own
    CUDA_VISIBLE_DEVICES if set (e.g. by a job scheduler), else the indices 0..n-1; [] without CUDA.
    ``torch.cuda.device_count`` counts through NVML where it can and starts no CUDA context here."""
    import torch

    n = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in env.split(",")] if env is not None else [str(i) for i in range(n)]
    return ids[:n]


def placement(args: argparse.Namespace, visible: list[str]) -> tuple[int, list[str] | None]:
    """(number of local workers, CUDA_VISIBLE_DEVICES of each worker or None for CPU workers) from the flags and
    the ``visible`` GPUs; RunnerError (one line, exit 2) for flags that make no sense here.

    On GPUs (``--gpus``, default every visible one) there are ``--workers`` workers if given, else
    ``--workers-per-gpu`` (default 1) per GPU; worker i gets GPU i mod the number of GPUs, so the GPUs are filled
    evenly, and a pool that starts fewer workers than slots (fewer cells than workers) still spreads them."""
    if args.workers is not None and args.workers < 1:
        raise RunnerError(f"--workers must be 1 or more (got {args.workers})", 2)
    if getattr(args, "population", None) is not None and (args.population < 1 or args.ray_address):
        raise RunnerError("--population N: N must be 1 or more, and local workers only (not --ray-address)", 2)
    if args.workers_per_gpu is not None and args.workers_per_gpu < 1:
        raise RunnerError(f"--workers-per-gpu must be 1 or more (got {args.workers_per_gpu})", 2)
    if args.ray_address:
        if args.gpus is not None or args.workers is not None:
            flag = "--gpus" if args.gpus is not None else "--workers"
            raise RunnerError(f"{flag} places local workers; on Ray, Ray places the cells (see --workers-per-gpu)", 2)
        return 0, None
    if not visible:
        flag = "--gpus" if args.gpus is not None else "--workers-per-gpu" if args.workers_per_gpu is not None else None
        if flag:
            raise RunnerError(
                f"{flag}: no CUDA device is visible to this runner (torch sees none); cells run on CPU workers "
                "(--workers)",
                2,
            )
        return args.workers or os.cpu_count() or 1, None
    if args.workers is not None and args.workers_per_gpu is not None:
        raise RunnerError("give --workers (in all) or --workers-per-gpu, not both", 2)
    gpus = visible if args.gpus is None else [g.strip() for g in args.gpus.split(",")]
    bad = [g for g in gpus if g not in visible]
    if bad or len(set(gpus)) != len(gpus):
        why = f"{bad[0]!r} is not a visible GPU" if bad else "a GPU is named twice"
        raise RunnerError(f"--gpus {args.gpus}: {why}; visible: {','.join(visible)} (CUDA_VISIBLE_DEVICES entries)", 2)
    workers = args.workers or len(gpus) * (args.workers_per_gpu or 1)
    return workers, [gpus[i % len(gpus)] for i in range(workers)]


def where(workers: int, slots: list[str] | None, ray_address: str | None) -> str:
    if ray_address:
        return f"Ray at {ray_address}"
    if not slots:
        return f"{workers} local workers"
    return f"{workers} local workers: " + ", ".join(f"{slots.count(g)} on GPU {g}" for g in dict.fromkeys(slots))
