"""`make settle`: add evaluation instances, a batch at a time, to the comparisons still open, until every primary
comparison is settled or has reached its planned cap.

    python -m pipelines.settle                  # as many batches as needed (up to each comparison's cap)
    python -m pipelines.settle --batches 1      # at most one more batch per task
    python -m pipelines.settle -- --gpus 0      # arguments after -- go to the runner (pipelines.run)

Each round runs the pipeline (pipelines.run: only stale stages run, so a finished batch is never recomputed), reads
each task's reports/<task>/stats.json, and for every task with an *open* primary comparison (not settled, fewer
instances than its planned cap, protocol/<task>.plan.json; not closed as out of reach of steerability, amendment 1 in
ablations/primary.py) appends the next batch of task seeds to
``<task>.instances`` in params.yaml (the no-KL baseline and grid.design.shared run on every instance) and to
``<task>.allocation.<group>`` of every design group an open comparison reads: a settled or capped comparison's own
cells stop (per-question allocation). The batches continue the pre-registered sequence (the next consecutive seeds
after the last one), and the looks are taken in that order, so the decision at each look depends only on the
instances before it (ablations/rule.py). After each round every recorded output is pushed to dvc-remote/, the DVC
remote committed with the repository (pipelines/store.py): commit it with params.yaml and dvc.lock, and a fresh
clone's `make settle` restores the finished looks instead of computing them again. Interrupted, it leaves
params.yaml valid (replaced whole) and every finished cell recorded; running it again picks up where it stopped.
Killed, even by SIGKILL, it takes its runner with it (the runner gets SIGTERM: finished cells recorded). With
``-- --no-analysis`` it runs the cells once and adds no batch: without reports there is nothing to decide on.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ablations.comparisons import primary_comparisons
from ablations.config import PARAMS_FILE, SHARED, ParamsError, load_params
from pipelines import store
from pipelines.profile import edit

REPORTS = Path("reports")
RUNNER = [sys.executable, "-m", "pipelines.run"]
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_settle(parent: int):
    """The runner's preexec: the kernel sends it SIGTERM when settle dies, even by SIGKILL (Linux prctl
    PR_SET_PDEATHSIG), so it stops as on Ctrl-C (finished cells recorded) instead of running on orphaned, holding
    the runner lock that refuses the next `make settle`."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # settle died before prctl took effect
            os._exit(143)

    return preexec


def comparison_status(task: str, reports: Path = REPORTS) -> dict[str, dict]:
    """Each primary comparison's row of ``task``'s latest report ({} without a report)."""
    path = reports / task / "stats.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("primary") or {}


def open_comparisons(task: str, reports: Path = REPORTS) -> list[str]:
    """The primary comparisons of ``task`` whose status is "open" in its latest report."""
    return [c for c, r in comparison_status(task, reports).items() if r.get("status") == "open"]


def open_groups(params, task: str, open_: list[str]) -> list[str]:
    """The design groups (but shared) whose cells an open comparison reads: they get the next batch."""
    n_levels = len(getattr(params, task).calibration.levels)
    group_of = {(arm, role): g for g, arm, role in params.grid.design_cells()}
    out = []
    for c in primary_comparisons(params.analysis, n_levels):
        if c.name in open_:
            out += [group_of[cell] for cell in c.cells() if group_of[cell] != SHARED]
    return list(dict.fromkeys(g for g in params.grid.design if g in out))


def next_batch(instances: list[int], batch_size: int) -> list[int]:
    """The next ``batch_size`` consecutive task seeds after the last evaluation instance."""
    return list(range(instances[-1] + 1, instances[-1] + 1 + batch_size))


def extend(task: str, groups: list[str], params: Path = PARAMS_FILE) -> list[int]:
    """Appends the next batch to ``task``'s instances and to the allocation of ``groups`` in params.yaml
    (validated; nothing written on error)."""
    p = load_params(params)
    section = getattr(p, task)
    seeds = next_batch(list(section.instances), p.analysis.sequential.batch_size)
    taken = (set(section.calibration.instances) | set(section.calibration.plan_instances)) & set(seeds)
    if taken:
        raise ParamsError(f"{task}: the next evaluation seeds {sorted(taken)} are calibration or planning instances")

    def change(doc):
        doc[task]["instances"].extend(seeds)
        for g in groups:
            doc[task]["allocation"][g].extend(seeds)

    edit(params, change, f"{params} with {task} batch {seeds} for {', '.join(groups) or 'the shared cells'}")
    return seeds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=None, help="at most this many more batches per task")
    ap.add_argument("runner", nargs="*", help="arguments for pipelines.run (after --)")
    args = ap.parse_args(argv)
    added = 0
    while True:
        rc = subprocess.call([*RUNNER, *args.runner], preexec_fn=_die_with_settle(os.getpid()))
        if rc:
            return rc
        store.sync("push")  # this look's outputs into dvc-remote/, to commit with dvc.lock (a fresh clone pulls them)
        try:
            params = load_params()
        except ParamsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if "--no-analysis" in args.runner:  # the reports were not refreshed: nothing to decide a batch on
            print("settle: --no-analysis: the cells ran, no report was refreshed: no batch added (run without it)")
            return 0
        todo = {t: o for t in params.tasks() if (o := open_comparisons(t))}
        if not todo or (args.batches is not None and added >= args.batches):
            break
        for task, open_ in todo.items():
            groups = open_groups(params, task, open_)
            try:
                seeds = extend(task, groups)
            except ParamsError as e:  # e.g. the next seeds are calibration instances: one line, params.yaml kept
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"settle: {task}: open {', '.join(open_)}: instances {seeds} for groups {', '.join(groups)}")
        added += 1
    for task in params.tasks():
        if not (REPORTS / task / "stats.json").is_file():
            print(f"settle: {task}: no report yet ({REPORTS / task / 'stats.json'})")
            continue
        lines = [f"{c} {r['verdict']} ({r['status']}, n = {r['n']})" for c, r in comparison_status(task).items()]
        print(f"settle: {task}: " + "; ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
