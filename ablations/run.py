"""Run everything with every core: `dvc repro`, but with the stale grid cells run concurrently.

    python -m ablations.run                      # local process pool, one worker per core
    python -m ablations.run --workers 1          # one cell at a time
    python -m ablations.run --ray-address auto   # cells as Ray tasks (pip install -e '.[ray]'), shared filesystem

Steps: 1. validate params.yaml (nothing runs if it is wrong); 2. `dvc repro rm` (data, SFT, reward model);
3. ask `dvc status` which grid cells are stale and run them in parallel, each with torch threads set to
RLHF_THREADS (default 1), printing one line per finished cell; `dvc commit` then records them in dvc.lock
exactly as `dvc repro` would have (also on failure or Ctrl-C, for the cells that finished); 4. `dvc repro` for
the rest (the analysis). A cell that is interrupted leaves no outputs and no lock entry: the next run redoes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

from ablations.config import ParamsError, load_params
from ablations.grid import Cell, cells, upstream_stages

DVC = [sys.executable, "-m", "dvc"]
ROOT = Path.cwd()


def dvc(*args: str, capture: bool = False) -> str:
    out = subprocess.run([*DVC, *args], check=True, text=True, capture_output=capture)
    return out.stdout if capture else ""


def stale_cells(grid: list[Cell]) -> list[Cell]:
    """Grid cells whose DVC stage is changed or has never run (per `dvc status --json`; asking for the whole
    pipeline at once is ~10x faster than naming 100 stages, which DVC collects one by one)."""
    status = json.loads(dvc("status", "--json", capture=True) or "{}")
    return [c for c in grid if c.stage in status]


def commit(done: list[Cell], whole_groups: bool) -> None:
    """Records finished cells in dvc.lock, as `dvc repro` would have. DVC re-reads dvc.lock for every stage it
    is given by name (~2.5 s each at 100 cells) but only once for a whole matrix group, so when every cell of the
    grid has its outputs the groups are committed in one call; after a failure or an interrupt the finished
    cells are committed one by one."""
    if not done:
        return
    if whole_groups:
        dvc("commit", "--force", "--quiet", *sorted({c.stage.split("@")[0] for c in done}))
    else:
        print(f"recording {len(done)} finished cells in dvc.lock ...", flush=True)
        dvc("commit", "--force", "--quiet", *[c.stage for c in done])


def _run_cell(root: str, cell: Cell) -> dict:
    """One cell in a worker process (local or Ray): torch threads are set per process by run_cell."""
    os.chdir(root)  # Ray workers need the repository on a shared filesystem at the same path
    from pipelines.ppo import run_cell

    return run_cell(load_params(), cell)


def _pool(workers: int, ray_address: str | None):
    """Yields (submit, wait_one, shutdown) for a local process pool or a Ray cluster."""
    if ray_address is None:
        pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))
        return pool.submit, lambda pending: wait(pending, return_when=FIRST_COMPLETED)[0], pool.shutdown
    import ray

    ray.init(
        address=ray_address,
        runtime_env={
            "env_vars": {
                k: os.environ[k] for k in ("RLHF_THREADS", "TQDM_DISABLE", "MLFLOW_TRACKING_URI") if k in os.environ
            }
        },
    )
    remote = ray.remote(num_cpus=1)(_run_cell)

    class Ref:  # a future-like wrapper so the loop below is the same for both backends
        def __init__(self, ref):
            self.ref = ref

        def result(self):
            return ray.get(self.ref)

    def submit(fn, *args):
        return Ref(remote.remote(*args))

    def wait_one(pending):
        by_ref = {p.ref: p for p in pending}
        done, _ = ray.wait(list(by_ref), num_returns=1)
        return {by_ref[r] for r in done}

    return submit, wait_one, lambda **_: ray.shutdown()


def run_grid(todo: list[Cell], workers: int, ray_address: str | None = None) -> list[str]:
    """Runs ``todo`` concurrently and records the finished cells in dvc.lock. Returns the failed stage names."""
    os.environ.setdefault("RLHF_THREADS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    submit, wait_one, shutdown = _pool(workers, ray_address)
    pending = {submit(_run_cell, str(ROOT), c): c for c in todo}
    failed, done, start = [], [], time.perf_counter()
    try:
        while pending:
            for fut in wait_one(set(pending)):
                cell = pending.pop(fut)
                try:
                    s = fut.result()
                except Exception as e:  # report and go on: the other cells are still worth having
                    failed.append(cell.stage)
                    print(f"[{len(todo) - len(pending)}/{len(todo)}] FAILED {cell.stage}: {e}", flush=True)
                    continue
                done.append(cell)
                print(
                    f"[{len(todo) - len(pending)}/{len(todo)}] {cell.stage}: gold {s['final_gold']:.3f} "
                    f"proxy {s['final_proxy']:.3f} KL {s['final_kl']:.2f} ({s['wall_s']:.0f}s, "
                    f"{time.perf_counter() - start:.0f}s elapsed)",
                    flush=True,
                )
    finally:
        shutdown(cancel_futures=True) if ray_address is None else shutdown()
        commit(done, whole_groups=len(done) == len(todo))
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="local processes (default: cores)")
    ap.add_argument("--ray-address", help="Ray cluster address ('auto', 'ray://host:10001' or 'local')")
    ap.add_argument("--no-analysis", action="store_true", help="stop after the grid cells")
    args = ap.parse_args(argv)
    try:
        params = load_params()
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    dvc("repro", *upstream_stages(params))
    grid = cells(params)
    todo = stale_cells(grid)
    where = f"Ray at {args.ray_address}" if args.ray_address else f"{args.workers} local workers"
    print(f"{len(todo)} of {len(grid)} grid cells to run on {where}", flush=True)
    failed = run_grid(todo, args.workers, args.ray_address) if todo else []
    if failed:
        print(f"{len(failed)} cells failed: {', '.join(failed)}; fix and re-run (finished cells are kept)")
        return 1
    if not args.no_analysis:
        dvc("repro")
    print(f"done in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
