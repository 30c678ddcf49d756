"""Cells/hour of a population of B cells trained as one batched computation (``rlhf.population``), against one
cell per process (``rlhf.ppo.train_ppo``), on a device (issue 21).

    python benchmarks/bench_population.py --device cuda                      # B = 1, 8, 64, 256, then doubling to OOM
    python benchmarks/bench_population.py --device cpu --sizes 1 2 4 8 --iterations 4 --repeats 3
    python benchmarks/bench_population.py --device cpu --smoke               # seconds: the script works
    python benchmarks/bench_population.py --device cpu --backends hf-llama hf-gpt2 --sizes 1 2 4 --iterations 2

A cell is the default grammar cell of ``bench_gpu.py`` (params.yaml's PPO settings, the reference arm at the middle
coefficient, grammar instance 0, models of params.yaml's size with random weights: speed does not depend on them),
on each of ``--backends`` (default tiny; hf-llama and hf-gpt2 are ``bench_backends.py``'s from-config
``transformers`` models of the same sizes, MLP width 4 d_model, fp32: a population refuses bf16 autocast); the B
cells of a population differ in seed and coefficient (the coefficients of params.yaml's grid, in turn). Seconds are
wall-clock on CUDA and this process's CPU seconds on CPU (one torch thread: cells/hour per core, robust to other
work on a shared machine). ``single``: one ``train_ppo`` cell in this process (what one worker does per cell);
cells/hour = 3600 / its seconds, per worker. ``population B``: ``train_population`` of B cells; cells/hour = 3600 B
/ its seconds. Each figure is the median of ``--repeats`` runs; ``per_cell_ratio`` = single seconds / (population
seconds / B) (> 1: the population is faster per cell). ``--max-doubling`` (default on CUDA) goes on doubling B past
the last size until the device runs out of memory (or B = 8192): the largest B that fit is reported. The
population's cell 0 is the single cell: ``vs_single`` holds |difference| of its final gold and KL (float rounding,
amplified by training; ``rlhf.population``'s docstring). Results: stdout and benchmarks/out/population.json
(git-ignored), one entry of "backends" per backend.
"""

from __future__ import annotations

import pipelines  # noqa: F401  (first: pins the CPU math paths before torch loads, as every stage does)

# isort: split
import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
from bench_backends import build, sizes
from bench_gpu import peak_memory, sync

from ablations.config import load_params
from ablations.grid import cells
from pipelines.common import load_task
from pipelines.data import build as build_task
from rlhf.model import ScalarModel
from rlhf.population import CellInputs, train_population
from rlhf.ppo import train_ppo

OUT = Path(__file__).resolve().parent / "out" / "population.json"


def workload(args, backend: str, device: torch.device):
    """(the default grammar cell's config, its task, ref, reward model, train prompts, eval sets) on ``device``."""
    params = load_params()
    task = build_task("grammar", params.grammar.task, 0)
    coefs = params.grammar.coefs or params.grammar.calibration.coefs
    mid, arm = coefs[len(coefs) // 2], params.analysis.reference_arm
    cell = next(c for c in cells(params) if c.task == "grammar" and c.arm == arm and c.coef == mid)
    cfg = cell.config
    if args.iterations is not None:
        cfg = cfg.model_copy(update={"iterations": args.iterations})
    ref = build(backend, sizes(params)).to(device).eval()
    reward_model = ScalarModel(copy.deepcopy(ref)).eval()
    n_eval = args.eval_prompts or len(task["eval_prompts"])
    evals = {"": task["eval_prompts"][:n_eval].to(device)}
    return cfg, coefs, load_task(task), ref, reward_model, task["train_prompts"].to(device), evals


def population_inputs(w, b: int) -> list[CellInputs]:
    """B cells of the workload: cell i has seed i and the grid's coefficient i mod (number of coefficients)."""
    cfg, coefs, task, ref, reward_model, train, evals = w
    out = []
    for i in range(b):
        kl = cfg.kl.model_copy(update={"coef": coefs[i % len(coefs)] if i else cfg.kl.coef})
        out.append(CellInputs(ref, reward_model, task, train, evals, cfg.model_copy(update={"seed": i, "kl": kl})))
    return out


def timed(fn, device: torch.device) -> tuple[float, object]:
    """(seconds, fn()): wall-clock seconds on CUDA; on CPU this process's CPU seconds (one thread: what a cell
    costs a core, robust to other work on a shared machine)."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    sync(device)
    start = clock()
    out = fn()
    sync(device)
    return clock() - start, out


def single(w, device: torch.device) -> tuple[float, dict]:
    c = population_inputs(w, 1)[0]
    return timed(
        lambda: train_ppo(copy.deepcopy(c.ref), c.ref, c.reward_model, c.task, c.train_prompts, c.eval_sets, c.cfg),
        device,
    )


def measure(w, b: int, repeats: int, device: torch.device, base_s: float, base: dict) -> dict:
    """Median seconds of ``repeats`` populations of ``b`` cells, as a row of the report."""
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        seconds, outs = timed(lambda: train_population(population_inputs(w, b)), device)
        times.append(seconds)
    s = statistics.median(times)
    got = outs[0]["summary"]
    return {
        "population": b,
        "seconds_median": s,
        "seconds": times,
        "cells_per_hour": 3600 * b / s,
        "per_cell_ratio": base_s / (s / b),
        "peak_memory_mib": peak_memory(device) / 2**20,
        "vs_single": {k: abs(got[f"final_{k}"] - base["summary"][f"final_{k}"]) for k in ("gold", "kl")},
    }


def bench_backend(args, backend: str, device: torch.device) -> dict:
    """The single-cell baseline and every population size on one backend: its entry of the report."""
    w = workload(args, backend, device)
    singles = [single(w, device) for _ in range(args.repeats)]
    base_s, base = statistics.median(s for s, _ in singles), singles[0][1]
    report = {"backend": backend, "iterations": w[0].iterations, "eval_prompts": len(w[-1][""])}
    report["single"] = {"seconds_median": base_s, "cells_per_hour": 3600 / base_s}
    report["runs"] = []
    print(json.dumps(report), flush=True)
    sizes_ = list(args.sizes)
    doubling = args.max_doubling if args.max_doubling is not None else device.type == "cuda"
    while sizes_:
        b = sizes_.pop(0)
        try:
            row = measure(w, b, args.repeats, device, base_s, base)
        except torch.cuda.OutOfMemoryError:
            report["out_of_memory_at"] = b
            break
        report["runs"].append(row)
        print(json.dumps({"backend": backend, **row}), flush=True)
        if doubling and not sizes_ and b < 8192:
            sizes_.append(2 * b)
    report["largest"] = max((r["population"] for r in report["runs"]), default=None)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", nargs="+", default=["tiny"], choices=["tiny", "hf-llama", "hf-gpt2"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--iterations", type=int, default=None, help="PPO iterations per cell (default: params.yaml)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="evaluation prompts per cell (default: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-doubling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--smoke", action="store_true", help="sizes 1 2, 1 iteration, 16 eval prompts, 1 repeat")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.iterations, args.eval_prompts, args.repeats = [1, 2], 1, 16, 1
    device = torch.device(args.device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "threads": args.threads, "backends": []}
    for backend in args.backends:
        report["backends"].append(bench_backend(args, backend, device))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
