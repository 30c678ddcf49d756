"""Gradient-diagnostic table at one common checkpoint, default params.yaml, one CPU thread.

    python benchmarks/diagnostics_table.py [--warmup 20] [--n-true 2048] [--n-minibatches 16]

The SFT policy is first trained for ``--warmup`` iterations with the reference arm (at the middle coefficient), so
that it sits away from the reference (at the reference itself the KL gradient is 0). From that checkpoint every
row below runs one iteration with gradient diagnostics at iteration 1 (``rlhf.diagnostics``): the same true
gradient for all rows (same policy, same diagnostic seed), each arm's estimate on-policy and after its own
epochs x minibatches - 1 updates (fresh optimizer and value model from the reward model, as at the start of a
run). Prints a markdown table; writes benchmarks/diagnostics.json.
"""

from __future__ import annotations

import pipelines  # noqa: F401  (first: pins the CPU math paths before torch loads, as every stage does)

# isort: split
import argparse
import copy
import json
import time
from pathlib import Path

import torch
from bench_algorithms import reference_config, upstream

from ablations.config import load_params
from pipelines.common import setup
from rlhf.config import KLConfig, PPOConfig
from rlhf.ppo import train_ppo

# (label, KLConfig fields); every row at coefficient 0.1 (the estimate is per unit coefficient)
ARMS = [
    ("reward k1", dict(placement="reward", estimator="k1")),
    ("reward k3", dict(placement="reward", estimator="k3")),
    ("loss k1", dict(placement="loss", estimator="k1")),
    ("loss k2", dict(placement="loss", estimator="k2")),
    ("loss k3", dict(placement="loss", estimator="k3")),
    ("loss k3 IS", dict(placement="loss", estimator="k3", is_weight=True)),
    ("loss k3+", dict(placement="loss", estimator="k3+")),
    ("loss full", dict(placement="loss", estimator="full")),
    ("loss k3 IS seq-sum", dict(placement="loss", estimator="k3", is_weight=True, aggregation="seq-mean-token-sum")),
    (
        "loss k2 +rtg seq-sum",
        dict(placement="loss", estimator="k2", return_to_go=True, aggregation="seq-mean-token-sum"),
    ),
    ("both k3", dict(placement="both", estimator="k3")),
    ("both k2", dict(placement="both", estimator="k2")),
    ("both full", dict(placement="both", estimator="full")),  # issue 18: the exact form (both_split is refused)
    ("loss k3 IS +rtg", dict(placement="loss", estimator="k3", is_weight=True, return_to_go=True)),
]
ALGORITHMS = [("ppo", 1), ("grpo", 8)]
COLUMNS = ("cosine", "cosine_noise_floor", "cosine_minibatch", "scale", "rel_bias", "rel_bias_noise", "rel_bias_excess",
           "rel_var")  # fmt: skip


def warm_policy(params, task, grammar, sft_model, reward_model, iterations: int, device):
    """The SFT model after ``iterations`` of the reference arm: the common checkpoint."""
    cfg = reference_config(params).model_copy(update=dict(iterations=iterations, eval_every=iterations))
    policy = copy.deepcopy(sft_model)
    train = task["train_prompts"].to(device)
    out = train_ppo(policy, sft_model, reward_model, grammar, train, task["eval_prompts"].to(device), cfg)
    return policy, out["evals"][-1]["kl"]


def table(params, task, grammar, sft_model, reward_model, policy, n_true: int, n_minibatches: int, device) -> list:
    rows = []
    train, held = task["train_prompts"].to(device), task["eval_prompts"][:16].to(device)
    base = reference_config(params).model_dump(exclude={"kl", "seed", "algorithm", "group_size", "diagnostics"})
    diagnostics = dict(at=[1], n_true=n_true, n_minibatches=n_minibatches, seed=0)
    for algorithm, group_size in ALGORITHMS:
        for label, kl in ARMS:
            cfg = PPOConfig(
                **{**base, "algorithm": algorithm, "group_size": group_size, "iterations": 1, "eval_every": 1},
                kl=KLConfig(target="reference", coef=0.1, **kl),
                seed=0,
                diagnostics=diagnostics,
            )
            start = time.perf_counter()
            out = train_ppo(copy.deepcopy(policy), sft_model, reward_model, grammar, train, held, cfg)
            for d in out["diagnostics"]:
                rows.append({"algorithm": algorithm, "arm": label, **d, "seconds": time.perf_counter() - start})
    return rows


def markdown(rows: list) -> str:
    head = "| algorithm | arm | regime | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for r in rows:
        values = " | ".join(f"{r[c]:.3f}" for c in COLUMNS)
        lines.append(f"| {r['algorithm']} | {r['arm']} | {r['regime']} ({r['updates']}) | {values} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--n-true", type=int, default=2048)
    ap.add_argument("--n-minibatches", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = setup()
    params = load_params()
    task, grammar, sft_model, reward_model = upstream(params, device)
    policy, kl = warm_policy(params, task, grammar, sft_model, reward_model, args.warmup, device)
    rows = table(params, task, grammar, sft_model, reward_model, policy, args.n_true, args.n_minibatches, device)
    Path("benchmarks/diagnostics.json").write_text(
        json.dumps({"warmup": args.warmup, "checkpoint_kl": kl, "rows": rows}, indent=2) + "\n"
    )
    print(f"checkpoint: {args.warmup} iterations of the reference arm, KL to the reference {kl:.2f} nats\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
