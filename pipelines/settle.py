"""`make settle`: add evaluation instances, a batch at a time, until every primary question is settled or capped.

    python -m pipelines.settle                  # as many batches as needed (up to analysis.sequential.cap)
    python -m pipelines.settle --batches 1      # at most one more batch per task
    python -m pipelines.settle -- --gpus 0      # arguments after -- go to the runner (pipelines.run)

Each round runs the pipeline (pipelines.run: only stale stages run, so a finished batch is never recomputed), reads
each task's reports/<task>/stats.json, and for every task with an *open* primary question (not settled, fewer
instances than the cap) appends the next batch of task seeds to ``<task>.instances`` in params.yaml, continuing the
pre-registered sequence (the next consecutive seeds after the last one). The looks are taken in that order, so the
decision at each look depends only on the instances before it (ablations/sequential.py). Interrupted, it leaves
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

from ablations.config import PARAMS_FILE, ParamsError, load_params
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


def open_questions(task: str, reports: Path = REPORTS) -> list[str]:
    """The primary questions of ``task`` whose status is "open" in its latest report ([] without a report)."""
    path = reports / task / "stats.json"
    if not path.is_file():
        return []
    primary = json.loads(path.read_text()).get("primary") or {}
    return [q for q, r in primary.items() if r.get("status") == "open"]


def next_batch(instances: list[int], batch_size: int) -> list[int]:
    """The next ``batch_size`` consecutive task seeds after the last evaluation instance."""
    return list(range(instances[-1] + 1, instances[-1] + 1 + batch_size))


def extend(task: str, params: Path = PARAMS_FILE) -> list[int]:
    """Appends the next batch to ``task``'s instances in params.yaml (validated; nothing written on error)."""
    p = load_params(params)
    seeds = next_batch(list(getattr(p, task).instances), p.analysis.sequential.batch_size)
    taken = set(getattr(p, task).calibration.instances) & set(seeds)
    if taken:
        raise ParamsError(f"{task}: the next evaluation seeds {sorted(taken)} are calibration instances")
    edit(params, lambda doc: doc[task]["instances"].extend(seeds), f"{params} with {task} batch {seeds}")
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
        try:
            params = load_params()
        except ParamsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if "--no-analysis" in args.runner:  # the reports were not refreshed: nothing to decide a batch on
            print("settle: --no-analysis: the cells ran, no report was refreshed: no batch added (run without it)")
            return 0
        todo = [t for t in params.tasks() if open_questions(t)]
        if not todo or (args.batches is not None and added >= args.batches):
            break
        for task in todo:
            try:
                seeds = extend(task)
            except ParamsError as e:  # e.g. the next seeds are calibration instances: one line, params.yaml kept
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"settle: {task} has open questions {', '.join(open_questions(task))}: adding instances {seeds}")
        added += 1
    for task in params.tasks():
        if not (REPORTS / task / "stats.json").is_file():
            print(f"settle: {task}: no report yet ({REPORTS / task / 'stats.json'})")
            continue
        primary = json.loads((REPORTS / task / "stats.json").read_text()).get("primary") or {}
        lines = [f"{q} {r['verdict']} ({r['status']}, n = {r['n']})" for q, r in primary.items()]
        print(f"settle: {task}: " + "; ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
