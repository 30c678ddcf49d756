"""PPO speed on one CPU thread: median of several runs, for the default params.yaml.

    python benchmarks/bench_ppo.py [--repeats 3]

Reports the wall time of one default-length PPO run (default arm: reward_k1 at the middle coefficient), and
tokens/s for sampling (KV-cache generation of a rollout batch) and for training (one PPO minibatch update of
policy and value model, forward + backward + Adam). Writes benchmarks/results.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from ablations.config import load_params
from ablations.grid import cells
from pipelines.common import setup
from pipelines.upstream import build_upstream
from rlhf.model import generate, logprobs_from_logits, response_logits
from rlhf.ppo import response_values, train_ppo
from rlhf.task import EOS


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = setup()
    params = load_params()
    task, grammar, sft_model, reward_model, _ = build_upstream(params, 0, device)
    mid = params.grid.coefs[len(params.grid.coefs) // 2]
    cell = next(
        c for c in cells(params) if c.kind == "fixed" and c.arm == params.analysis.reference_arm and c.coef == mid
    )
    cfg = params.grammar.ppo_config(cell.kl, cell.seed)
    train, held = task["train_prompts"].to(device), task["eval_prompts"].to(device)

    g = torch.Generator(device).manual_seed(0)
    prompts = train[: cfg.batch_size]
    n_sample = cfg.batch_size * grammar.max_new_tokens
    t_sample = median_time(lambda: generate(sft_model, prompts, grammar.max_new_tokens, 1.0, g, EOS), 20)

    policy, value = copy.deepcopy(sft_model), copy.deepcopy(reward_model)
    opt = torch.optim.Adam(list(policy.parameters()) + list(value.parameters()), lr=1e-6)
    mb = prompts[: cfg.minibatch_size]
    responses = generate(sft_model, mb, grammar.max_new_tokens, 1.0, g, EOS)

    def update():
        loss = logprobs_from_logits(response_logits(policy, mb, responses, 1.0), responses).mean()
        loss = loss + response_values(value, mb, responses).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    n_train = cfg.minibatch_size * (grammar.prompt_len + grammar.max_new_tokens)
    t_train = median_time(update, 20)
    t_run = median_time(
        lambda: train_ppo(copy.deepcopy(sft_model), sft_model, reward_model, grammar, train, held, cfg), args.repeats
    )
    result = {
        "ppo_run_seconds_median": t_run,
        "repeats": args.repeats,
        "iterations": cfg.iterations,
        "arm": cell.stage,
        "threads": torch.get_num_threads(),
        "sampling_tokens_per_s": n_sample / t_sample,
        "training_tokens_per_s": n_train / t_train,
    }
    Path("benchmarks/results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
