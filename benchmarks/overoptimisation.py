"""The over-optimisation figure of the README: no KL vs InstructGPT-style reference KL, three seeds each.

python benchmarks/overoptimisation.py     # -> docs/overoptimisation.png, docs/overoptimisation.json
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ablations.config import load_params
from pipelines.common import setup
from pipelines.plots import run_figure
from pipelines.upstream import build_upstream
from rlhf.config import no_kl
from rlhf.ppo import train_ppo

SEEDS = (0, 1, 2)
ARMS = (("reward_k1", 0.1), ("reward_k1", 0.3))  # KL in the reward, middle and largest default coefficient


def main() -> None:
    device = setup()
    params = load_params()
    task, grammar, sft_model, reward_model, _ = build_upstream(params, 0, device)
    runs, groups = {}, {}
    for seed in SEEDS:
        cases = [("no KL", no_kl())] + [(f"{a} {c:g}", params.grid.arms[a].kl(c)) for a, c in ARMS]
        for group, kl in cases:
            out = train_ppo(
                copy.deepcopy(sft_model),
                sft_model,
                reward_model,
                grammar,
                task["train_prompts"].to(device),
                task["eval_prompts"].to(device),
                params.grammar.ppo_config(kl, seed),
            )
            label = f"{group} s{seed}"
            runs[label], groups[label] = out["evals"], group
            print(label, {k: round(v, 3) for k, v in out["summary"].items()})
    Path("docs").mkdir(exist_ok=True)
    title = f"seeds {', '.join(map(str, SEEDS))}: no KL over-optimises the proxy; KL in the reward holds gold"
    run_figure(runs, title, groups).savefig("docs/overoptimisation.png", dpi=110)
    Path("docs/overoptimisation.json").write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
