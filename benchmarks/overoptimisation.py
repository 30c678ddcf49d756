"""The over-optimisation figure of the README: no KL vs a strong reference KL, three seeds each.

    python benchmarks/overoptimisation.py     # -> docs/overoptimisation.png, docs/overoptimisation.json
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ablations.config import load_params
from ablations.grid import baseline_cell, find_cell
from pipelines.common import setup
from pipelines.plots import run_figure
from pipelines.upstream import build_upstream
from rlhf.ppo import train_ppo

SEEDS = (0, 1, 2)
STRONG = ("reward_k1", 0.3)  # InstructGPT-style KL in the reward, the largest default coefficient


def main() -> None:
    device = setup()
    params = load_params()
    task, grammar, sft_model, reward_model, _ = build_upstream(params, device)
    runs = {}
    for seed in SEEDS:
        for label, cell in ((f"no KL s{seed}", baseline_cell(seed)),
                            (f"{STRONG[0]} {STRONG[1]} s{seed}", find_cell(params, *STRONG, seed))):
            out = train_ppo(copy.deepcopy(sft_model), sft_model, reward_model, grammar,
                            task["train_prompts"].to(device), task["eval_prompts"].to(device),
                            params.ppo_config(cell.kl, seed))
            runs[label] = out["evals"]
            print(label, {k: round(v, 3) for k, v in out["summary"].items()})
    Path("docs").mkdir(exist_ok=True)
    run_figure(runs, "").savefig("docs/overoptimisation.png", dpi=110)
    Path("docs/overoptimisation.json").write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
