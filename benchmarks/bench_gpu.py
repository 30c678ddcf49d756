"""One PPO cell per backend on a device: tokens/s, peak memory, and cells/hour with 1, 2, 4 workers per device.

    python benchmarks/bench_gpu.py --device cuda                  # tiny and hf-llama, 1/2/4 workers, fp32
    python benchmarks/bench_gpu.py --device cuda --bf16           # hf models under bf16 autocast
    python benchmarks/bench_gpu.py --device cpu --iterations 2 --workers 1 2   # a smoke run without a GPU

A cell is ``train_ppo`` with params.yaml's PPO settings (the reference arm at the middle coefficient, as
``bench_ppo.py``), policy / reference / reward / value models of params.yaml's size built from a config (random
weights: speed does not depend on them), deterministic torch as in a pipeline stage. For each backend and each N in
``--workers``, N worker processes (one per cell, all on the same device, as N workers per GPU would be) build their
models, wait at a barrier, then each runs one cell; cells/hour = N * 3600 / (last finish - first start). The N = 1
worker also reports sampling and training tokens/s (``bench_backends.Bench``, median of 10) and peak memory
(``torch.cuda.max_memory_allocated``; max RSS on CPU). Results: stdout and benchmarks/out/gpu.json (git-ignored).
Workload: params.yaml's grammar task, instance 0.

Run on an NVIDIA H200 (2026-11-30; torch 2.11.0+cu130, the device machine's build): ``--device cuda --iterations 20``,
fp32, saved as benchmarks/gpu_h200.json. The first CUDA runs found library bugs, fixed since and covered by
tests/rlhf/test_cuda.py (skipped without a GPU): the grammar's gold reward indexed its CPU tables with CUDA tensors,
a ``ScalarModel`` left its new score head on the CPU under a CUDA backbone (every reward model, and the value model
of a verifier task), and SFT, reward-model training and the preference labels drew with a CUDA generator onto the
CPU.
"""

from __future__ import annotations

import pipelines  # noqa: F401  (first: pins the CPU math paths before torch loads, as every stage does)

# isort: split
import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from _reference import reference
from bench_backends import Bench, build, sizes

from ablations.config import load_params
from pipelines.common import load_task
from pipelines.data import build as build_task
from rlhf import hf
from rlhf.model import ScalarModel
from rlhf.ppo import train_ppo

OUT = Path(__file__).resolve().parent / "out" / "gpu.json"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> int:
    """Bytes: CUDA allocator peak, or the process's max resident set size on CPU (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def micro(backend: str, s: dict, device: torch.device, bf16: bool) -> dict:
    bench = Bench(backend, s, device, bf16)
    out = {}
    for name, fn, n_tokens in (
        ("sampling", bench.sample, s["batch"] * s["new_tokens"]),
        ("training", bench.update, s["minibatch"] * (s["prompt_len"] + s["new_tokens"])),
    ):
        fn()  # warm-up
        times = []
        for _ in range(10):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
        out[f"{name}_tokens_per_s"] = n_tokens / statistics.median(times)
    return out


def worker(args) -> None:
    """One cell: prints 'ready', waits for a line on stdin, runs, prints one JSON line."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (set before CUDA starts)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    params = load_params()
    s = sizes(params)
    task = build_task("grammar", params.grammar.task, 0)
    grammar = load_task(task)
    cfg = reference(params, "grammar").config
    if args.iterations is not None:
        cfg = cfg.model_copy(update={"iterations": args.iterations})
    bf16 = args.bf16 and args.backend != "tiny"
    result = {"backend": args.backend, "bf16": bf16, "iterations": cfg.iterations}
    if args.micro:
        result.update(micro(args.backend, s, device, bf16))
    ref = build(args.backend, s).to(device).eval()
    reward_model = ScalarModel(copy.deepcopy(ref)).eval()
    policy = copy.deepcopy(ref)
    if bf16:
        for m in (ref, policy, reward_model):  # the value model is a copy of the reward model: bf16 too
            hf.set_autocast(m, torch.bfloat16)
    train, held = task["train_prompts"].to(device), task["eval_prompts"].to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    print("ready", flush=True)
    sys.stdin.readline()
    sync(device)
    result["start"] = time.time()
    train_ppo(policy, ref, reward_model, grammar, train, held, cfg)
    sync(device)
    result["end"] = time.time()
    result["cell_s"] = result["end"] - result["start"]
    result["peak_memory_mib"] = peak_memory(device) / 2**20
    print(json.dumps(result), flush=True)


def run_workers(args, backend: str, n: int) -> list[dict]:
    """n concurrent workers on one device, released together; returns their results."""
    cmd = [sys.executable, __file__, "--worker", "--backend", backend, "--device", args.device]
    cmd += ["--threads", str(args.threads)] + (["--bf16"] if args.bf16 else [])
    cmd += [] if args.iterations is None else ["--iterations", str(args.iterations)]
    cmd += ["--micro"] if n == 1 else []
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for p in procs:
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"worker failed to start ({backend}): {line!r}")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"worker failed ({backend}, {n} workers), exit code {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", nargs="+", default=["tiny", "hf-llama"])
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--iterations", type=int, default=None, help="PPO iterations per cell (default: params.yaml)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for the hf models")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--micro", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    report = {"device": device_name, "bf16": args.bf16, "threads_per_worker": args.threads, "runs": []}
    for backend in args.backends:
        for n in args.workers:
            results = run_workers(args, backend, n)
            wall = max(r["end"] for r in results) - min(r["start"] for r in results)
            row = {
                "backend": backend,
                "workers": n,
                "cells_per_hour": n * 3600 / wall,
                "cell_s_median": statistics.median(r["cell_s"] for r in results),
                "peak_memory_mib_max": max(r["peak_memory_mib"] for r in results),
                **{k: v for k, v in results[0].items() if k.endswith("tokens_per_s")},
            }
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
