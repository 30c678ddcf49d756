"""How long `make repro` of the recorded answer takes on N cores when every stage is recomputed (no DVC cache, no
dvc-remote/): the measured time of each stage that dvc.lock records, scheduled the way the runner runs them.

    python benchmarks/repro_wait.py                      # 2, 16 and 64 cores, from dvc.lock and the v4 stage times
    python benchmarks/repro_wait.py --cores 8 --status-s 150
    python benchmarks/repro_wait.py --up-to 127          # only task instances up to 127: profile first-look

Stage times: ``v4_stage_times.csv`` beside this script, one row per stage (``stage,seconds,log``): the stage's own
wall time as the runner printed it (``[i/n] <stage>: ... (<seconds>s, ...)``) during protocol v4's runs on the 2-core
development machine (AMD EPYC, one torch thread per stage, one stage per core; ``log`` names the run, and the
``rebuild`` runs shared the cores with test runs, so their stages (the calibration and planning instances' chains and
cells) are slower than on an idle machine, as are look 14's (instances 176-179, beside a test run): an upper bound).
A stage of dvc.lock without a row gets the median of its kind (its name before ``@``), and is counted.

Schedule (pipelines/runner): the waves run one after another: (0) the data -> SFT -> reward model -> eval0 chains,
one chain per task instance, chains in parallel; (1) the calibration cells, then each task's calibrate stage;
(2) the planning cells, then planning; (3) the evaluation cells, then each task's analysis. Within a wave the jobs go
longest first to the next free core (list scheduling; within 4/3 of the best possible), and the wave's tail stages
(calibrate, planning, analysis: one per task, side by side) run after its last job (a task's tail waits for its
cells; here for all of them). Each wave also waits for one `dvc
status` over the whole grid (``--status-s``, single-threaded, so it does not shrink with cores). Not counted: the
pull attempt, the workers' start, recording in dvc.lock, and any speed difference between this machine's cores and
yours.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CHAIN = re.compile(r"_(data|sft|rm|eval0)@")  # an upstream stage: <task>[_calibration|_plan]_<kind>@<instance>
WAVES = ("chains", "calibration", "planning", "evaluation")


def kind(stage: str) -> str:
    return stage.partition("@")[0]


def wave(stage: str) -> int:
    """The runner's wave of a dvc.lock stage (module docstring)."""
    if CHAIN.search(stage):
        return 0
    k = kind(stage)
    if "_calibrat" in k:
        return 1
    if "_plan" in k:
        return 2
    return 3


def instance(stage: str) -> int | None:
    """A stage's task instance (``grammar_design@139-...`` -> 139); None for calibrate, planning, analysis."""
    m = re.search(r"@(\d+)", stage)
    return int(m.group(1)) if m else None


def jobs(stages: list[str], seconds: dict[str, float]) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Each wave's jobs and its tail stages (seconds): an upstream chain (one task instance's stages) is one job, any
    other stage of an instance one; a stage of no instance (calibrate, planning, analysis) is a tail."""
    out: dict[int, list[float]] = defaultdict(list)
    tails: dict[int, list[float]] = defaultdict(list)
    chains: dict[str, float] = defaultdict(float)
    for s in stages:
        if wave(s) == 0:
            chains[CHAIN.sub("@", s)] += seconds[s]
        else:
            (out if instance(s) is not None else tails)[wave(s)].append(seconds[s])
    out[0] = list(chains.values())
    return out, tails


def wave_seconds(jobs: list[float], tails: list[float], cores: int) -> float:
    """A wave's wall time: its jobs list-scheduled, then its tails side by side."""
    return makespan(jobs, cores) + max(tails, default=0.0)


def makespan(durations: list[float], cores: int) -> float:
    """Longest-first list scheduling of ``durations`` on ``cores``: when the last job ends."""
    free = [0.0] * cores
    for d in sorted(durations, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def stage_seconds(stages: list[str], times: dict[str, float]) -> tuple[dict[str, float], dict[str, int]]:
    """Each stage's seconds: its own row, else its kind's median; and how many stages of each kind had no row."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s, t in times.items():
        by_kind[kind(s)].append(t)
    medians = {k: statistics.median(v) for k, v in by_kind.items()}
    missing: dict[str, int] = defaultdict(int)
    out = {}
    for s in stages:
        if s not in times:
            if kind(s) not in medians:
                raise SystemExit(f"no time for stage {s} nor for any stage of its kind {kind(s)!r}")
            missing[kind(s)] += 1
        out[s] = times.get(s, medians.get(kind(s)))
    return out, dict(missing)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lock", type=Path, default=Path("dvc.lock"), help="the stages to recompute (default dvc.lock)")
    ap.add_argument("--times", type=Path, default=HERE / "v4_stage_times.csv")
    ap.add_argument("--cores", type=int, nargs="+", default=[2, 16, 64])
    ap.add_argument("--up-to", type=int, help="keep only the stages of task instances up to this one (e.g. 127)")
    ap.add_argument("--status-s", type=float, default=150.0, help="one `dvc status` over the grid (default: 2.5 min)")
    args = ap.parse_args(argv)
    if not args.lock.is_file():
        print(f"error: {args.lock} not found: run from the repository root or pass --lock", file=sys.stderr)
        return 2
    with args.times.open(newline="") as f:
        times = {row["stage"]: float(row["seconds"]) for row in csv.DictReader(f)}
    stages = list(yaml.load(args.lock.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["stages"])
    if args.up_to is not None:
        stages = [s for s in stages if (instance(s) or 0) <= args.up_to]
    seconds, missing = stage_seconds(stages, times)
    per_wave, tails = jobs(stages, seconds)
    total = sum(seconds.values())
    print(f"{len(stages)} stages of {args.lock}, {total:,.0f} CPU-s ({total / 3600:.1f} CPU-h); by wave: "
          + ", ".join(f"{WAVES[w]} {sum(per_wave[w]) + sum(tails[w]):,.0f}" for w in range(4)))  # fmt: skip
    if missing:
        print("timed by their kind's median (no row):", ", ".join(f"{k} {n}" for k, n in sorted(missing.items())))
    for cores in args.cores:
        parts = [wave_seconds(per_wave[w], tails[w], cores) for w in range(4)]
        wait = sum(parts) + len(parts) * args.status_s
        shown = ", ".join(f"{WAVES[w]} {p / 60:.0f}" for w, p in enumerate(parts))
        status = f"{len(parts)} dvc status {len(parts) * args.status_s / 60:.0f}"
        print(f"{cores:>3} cores: about {wait / 60:,.0f} min ({shown}; {status})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
