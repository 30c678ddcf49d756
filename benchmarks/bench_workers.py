"""Speedup of the parallel grid runner: N workers vs 1, on real default-size cells.

    python benchmarks/bench_workers.py [--cells 8] [--repeats 2] [--workers 2]

Needs a finished `make repro` (it reuses data/ and models/). Works in a scratch copy of the repository, where it
deletes the outputs of the first ``--cells`` PPO cells and times `python -m pipelines.run --no-analysis` bringing
them back, with 1 worker and with ``--workers``; median of ``--repeats`` each. Writes benchmarks/workers.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ablations.config import load_params
from ablations.grid import cells

KEEP = (
    "rlhf",
    "pipelines",
    "ablations",
    "data",
    "models",
    "metrics",
    "runs",
    ".dvc",
    "dvc.yaml",
    "dvc.lock",
    "params.yaml",
    ".dvcignore",
    ".gitignore",
)


def timed_run(repo: Path, todo: list, workers: int) -> float:
    for cell in todo:
        shutil.rmtree(repo / cell.out_dir, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pipelines.run", "--no-analysis", "--workers", str(workers)],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
        env={
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "TQDM_DISABLE": "1",
            "MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}",
        },
    )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    missing = [d for d in ("data", "models", "runs") if not Path(d).is_dir()]
    if missing:  # the scratch copy reuses a finished pipeline's outputs
        sys.exit(f"bench_workers: no {', '.join(missing)}/ here: run `make repro` first (it reuses its outputs)")
    todo = [c for c in cells(load_params()) if c.arm != "none"][: args.cells]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        for name in KEEP:
            src = Path(name)
            (shutil.copytree if src.is_dir() else shutil.copy)(src, repo / name)
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
        timed_run(repo, todo[:1], 1)  # warm-up: creates the MLflow database
        times = {w: statistics.median(timed_run(repo, todo, w) for _ in range(args.repeats)) for w in (1, args.workers)}
    result = {
        "cells": len(todo),
        "repeats": args.repeats,
        "seconds_1_worker": times[1],
        f"seconds_{args.workers}_workers": times[args.workers],
        "speedup": times[1] / times[args.workers],
    }
    Path("benchmarks/workers.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
