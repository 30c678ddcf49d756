"""The runner's ``--population N``: stale cells of one structure executed N at a time in one process, as one
batched computation on its device (``rlhf.population``), each cell still its own DVC stage (issue 21).

    python -m pipelines.run --gpus 0 --population 256     # make repro RUN_ARGS="--gpus 0 --population 256"

``plan`` groups a wave's stale cells by task and ``rlhf.population.structure`` (algorithm, KL placement and
estimator, every PPO value but seed and KL strength) into groups of at most N, in the wave's order (the tiny and
the hf backend alike: a task has one model section); a cell a population cannot train (hf backend with bf16
autocast, moving reference, target old_policy with a reward-side KL, gradient diagnostics) stays a cell of its own,
run as today. A worker runs a group with ``run_group``: each cell is loaded
as its stage loads it (``pipelines.ppo.load_cell``), all are trained together, and each cell's outputs and MLflow
run are written exactly as ``python -m pipelines.ppo <stage>`` writes them (``pipelines.ppo.write_outputs``). The
runner then records every cell of the group in dvc.lock as it records a cell. Interrupting: a group finishes all
of its cells at once or none, so a stopped group's cells stay stale (their MLflow runs marked FAILED) and the next
run redoes them; groups that finished are recorded, as cells are today.

Numbers: a cell's result does not depend on the other cells of its group (tests/rlhf/test_population.py), but it
is not ``train_ppo``'s to the last bit (vmapped kernels round differently): running with --population is a
re-baseline of the cells it runs. The CPU default stays one cell per process (benchmarks/bench_population.py).
"""

from __future__ import annotations

import functools
import time
from contextlib import ExitStack
from dataclasses import dataclass

from ablations.config import Params
from ablations.grid import Cell, find_cell
from pipelines import tracking
from pipelines.common import eval_sets, setup
from pipelines.ppo import cell_axes, load_cell, resolved, write_outputs
from rlhf.population import CellInputs, refused, structure, train_population


@dataclass(frozen=True)
class Group:
    """Stale cells trained as one population; the runner records each of ``cells`` when the group finishes."""

    cells: tuple[Cell, ...]

    @property
    def stage(self) -> str:
        return f"{self.cells[0].stage} (+{len(self.cells) - 1} in its population)"


def _key(params: Params, cell: Cell):
    """The structure a cell shares with its population, or None for a cell that runs on its own."""
    try:
        cell = resolved(params, cell)
    except FileNotFoundError:  # no calibration yet: the cell's own stage reports it
        return None
    task = getattr(params, cell.task)
    cfg = cell.config  # built once, in the grid
    if refused(cfg) or (task.model.backend == "hf" and task.model.hf.bf16):  # bf16: rlhf.population.AUTOCAST_REFUSED
        return None
    return repr((cell.task, sorted(structure(cfg).items())))


def plan(params: Params, todo: list[Cell], size: int) -> list[Cell | Group]:
    """``todo`` as groups of at most ``size`` cells of one structure (first-seen order), and single cells."""
    groups: dict[str, list[Cell]] = {}
    out: list[Cell | Group | str] = []
    for cell in todo:
        key = _key(params, cell)
        if key is None:
            out.append(cell)
            continue
        if key not in groups:
            out.append(key)
        groups.setdefault(key, []).append(cell)
    items: list[Cell | Group] = []
    for x in out:
        if not isinstance(x, str):
            items.append(x)
            continue
        cells = groups[x]
        items += [_group(cells[i : i + size]) for i in range(0, len(cells), size)]
    return items


def _group(cells: list[Cell]) -> Cell | Group:
    return cells[0] if len(cells) == 1 else Group(tuple(cells))


def run_group(params: Params, group: Group) -> dict:
    """Trains ``group``'s cells as one population in this worker and writes each cell's outputs. Returns the
    first cell's summary with ``wall_s`` (the group's seconds) and ``cells`` (how many)."""
    device = setup()
    loaded = [load_cell(params, find_cell(params, c.stage), device) for c in group.cells]
    inputs = [
        CellInputs(
            c.ref,
            c.reward_model,
            c.task,
            c.data["train_prompts"].to(device),
            eval_sets(c.data, device),
            c.cfg,
            initial_eval=c.initial_eval,
        )
        for c in loaded
    ]
    axes = [cell_axes(c.cell, c.cfg) for c in loaded]
    with ExitStack() as runs:
        mlflow = [
            runs.enter_context(tracking.stage_run(c.cell.stage, params.mlflow.experiment, c.cfg.model_dump(), tags=a))
            for c, a in zip(loaded, axes)
        ]
        start = time.perf_counter()
        outs = train_population(inputs)
        wall_s = time.perf_counter() - start
        summaries = [
            write_outputs(c.cell, a, out, wall_s / len(loaded), client, rid)
            for c, a, out, (client, rid) in zip(loaded, axes, outs, mlflow)
        ]
    return {**summaries[0], "wall_s": wall_s, "cells": len(summaries)}


def run_item(run_cell, group_fn, params: Params, item: Cell | Group) -> dict:
    """What a worker runs for an item of ``plan``: a group with ``group_fn``, a single cell with ``run_cell``."""
    return group_fn(params, item) if isinstance(item, Group) else run_cell(params, item)


def ppo_group(params: Params, group: Group) -> dict:
    """``run_group`` in a runner's worker (MLflow's store made ready first, as for a cell)."""
    from pipelines.runner import mlflow_runs

    mlflow_runs.ready(params.mlflow.experiment)
    return run_group(params, group)


def executor(run_cell):
    """``run_item`` bound to the runner's ``run_cell`` and this module's ``group_fn`` as it is now (tests swap
    it), picklable for spawned workers."""
    return functools.partial(run_item, run_cell, group_fn)


group_fn = ppo_group


def members(item) -> tuple[Cell, ...]:
    """The cells an item of the runner's queue stands for: a group's cells, or the item itself."""
    return item.cells if isinstance(item, Group) else (item,)
