"""Cost of one training iteration per algorithm at equal sampled tokens, one CPU thread, params.yaml's grammar task.

    python benchmarks/bench_algorithms.py [--iterations 10] [--repeats 3] [--group-size 8]

Timed: iterations 2 .. n-1 of a run (the held-out evaluations at 0 and n are left out). Every algorithm runs
the same batch (batch_size responses of at most max_new_tokens tokens), epochs and
minibatches, with the reference arm's KL at the middle coefficient; grpo and rloo sample ``--group-size``
responses for each of batch_size / group_size prompts. Each repeat runs every algorithm once, in turn (so drift
on a shared machine hits them alike); the medians over repeats of seconds per iteration and per 1,000 sampled
response tokens are reported with their ratio to PPO in the same run. Upstream models as the DVC stages make them
(grammar instance 0). Results: stdout and benchmarks/out/algorithms.json (git-ignored).
"""

from __future__ import annotations

import pipelines  # noqa: F401  (first: pins the CPU math paths before torch loads, as every stage does)

# isort: split
import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from _reference import reference

from ablations.config import load_params
from pipelines.common import setup
from pipelines.upstream import build_upstream
from rlhf.config import ALGORITHMS, GROUPED, PPOConfig
from rlhf.ppo import train_ppo

OUT = Path(__file__).resolve().parent / "out" / "algorithms.json"


def upstream(params, device):
    """(data, task, SFT model, reward model) of grammar instance 0, as the DVC stages make them."""
    return build_upstream(params, "grammar", 0, device)[:4]


def reference_config(params) -> PPOConfig:
    """The run config of the reference arm at the grammar task's middle coefficient, first seed (_reference)."""
    return reference(params, "grammar").config


def bench(params, task, grammar, sft_model, reward_model, iterations: int, repeats: int, group_size: int, device):
    """Seconds per iteration and per 1,000 sampled tokens of every algorithm (medians over repeats)."""
    ref_cfg = reference_config(params)
    base = ref_cfg.model_dump(exclude={"kl"})
    base.update(iterations=iterations, eval_every=iterations)  # held-out evaluation at 0 and the end only
    train, held = task["train_prompts"].to(device), task["eval_prompts"].to(device)
    per_iter, per_ktok = {a: [] for a in ALGORITHMS}, {a: [] for a in ALGORITHMS}
    for _ in range(repeats):
        for algorithm in ALGORITHMS:
            g = group_size if algorithm in GROUPED else 1
            cfg = PPOConfig(**{**base, "algorithm": algorithm, "group_size": g}, kl=ref_cfg.kl)
            stamps = []  # end of each iteration; iterations 2 .. n-1 hold no held-out evaluation
            progress = lambda row, stamps=stamps: stamps.append(time.perf_counter())
            out = train_ppo(copy.deepcopy(sft_model), sft_model, reward_model, grammar, train, held, cfg, progress)
            seconds = stamps[-2] - stamps[0]
            tokens = sum(row["length"] for row in out["history"][1:-1]) * cfg.batch_size
            per_iter[algorithm].append(seconds / (cfg.iterations - 2))
            per_ktok[algorithm].append(1000 * seconds / tokens)
    return {
        "iterations": iterations,
        "repeats": repeats,
        "batch_size": base["batch_size"],
        "minibatch_size": base["minibatch_size"],
        "epochs": base["epochs"],
        "group_size_grpo_rloo": group_size,
        "arm": f"{params.analysis.reference_arm} at coef {ref_cfg.kl.coef}",
        "threads": torch.get_num_threads(),
        "seconds_per_iteration_median": {a: statistics.median(v) for a, v in per_iter.items()},
        "seconds_per_1000_sampled_tokens_median": {a: statistics.median(v) for a, v in per_ktok.items()},
        "ratio_to_ppo_per_token_median": {
            a: statistics.median(x / p for x, p in zip(v, per_ktok["ppo"])) for a, v in per_ktok.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=8)
    args = ap.parse_args()
    assert args.iterations >= 3, "iterations 2 .. n-1 are timed"
    torch.set_num_threads(1)
    device = setup()
    params = load_params()
    task, grammar, sft_model, reward_model = upstream(params, device)
    result = bench(
        params, task, grammar, sft_model, reward_model, args.iterations, args.repeats, args.group_size, device
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
