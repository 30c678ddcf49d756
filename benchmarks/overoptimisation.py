"""The over-optimisation figure of the README: no KL vs InstructGPT-style reference KL, three seeds each.

    python benchmarks/overoptimisation.py     # -> docs/overoptimisation.png, docs/overoptimisation.json

Panels: gold (solid) and proxy (dashed) against PPO iterations; mean response length (the SFT policy's is the
iteration-0 value: over-optimisation here is not going silent); gold against sqrt KL. The JSON also holds the
task's sanity table: gold, proxy and length of the SFT policy and of degenerate policies on the held-out prompts.
"""

from __future__ import annotations

import pipelines  # noqa: F401  (first: pins the CPU math paths before torch loads, as every stage does)

# isort: split
import argparse
import copy
import json
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.gridspec import GridSpec

from ablations.config import load_params
from pipelines.common import setup
from pipelines.plots import run_figure
from pipelines.upstream import build_upstream
from rlhf.config import no_kl
from rlhf.evaluate import degenerate_responses, response_stats
from rlhf.model import generate
from rlhf.ppo import train_ppo
from rlhf.task import EOS

SEEDS = (0, 1, 2)
ARMS = (("reward_k1", 0.1), ("reward_k1", 0.3))  # KL in the reward, middle and largest default coefficient
SAMPLES_PER_PROMPT = 4  # SFT samples per held-out prompt for the sanity table


def sanity_table(task, grammar, sft_model, reward_model) -> dict[str, dict[str, float]]:
    """Held-out gold/proxy/length of the SFT policy and of degenerate policies (rlhf.evaluate)."""
    prompts = task["eval_prompts"].repeat(SAMPLES_PER_PROMPT, 1)
    g = torch.Generator(prompts.device).manual_seed(0)
    sft = generate(sft_model, prompts, grammar.max_new_tokens, 1.0, g, EOS)
    rows = {"sft": response_stats(reward_model, grammar, prompts, sft)}
    for name, responses in degenerate_responses(grammar, sft, g).items():
        rows[name] = response_stats(reward_model, grammar, prompts, responses)
    return rows


def length_panel(fig, runs: dict[str, list[dict]], groups: dict[str, str]) -> None:
    """Adds a third panel, mean response length against iterations, between run_figure's two; the arms' legend
    moves there (the length panel has room below its curves)."""
    axes = fig.axes
    gs = GridSpec(1, 3, figure=fig)
    axes[0].set_subplotspec(gs[0, 0])
    axes[1].set_subplotspec(gs[0, 2])
    axes[0].get_legend().remove()
    ax = fig.add_subplot(gs[0, 1])
    color = {g: f"C{i % 10}" for i, g in enumerate(dict.fromkeys(groups.values()))}
    seen = set()
    for label, evals in runs.items():
        group = groups[label]
        legend = None if group in seen else group
        seen.add(group)
        ax.plot([e["iteration"] for e in evals], [e["length"] for e in evals], color=color[group], label=legend)
    ax.set(xlabel="PPO iteration", ylabel="mean response length (tokens)", title="length (iteration 0: SFT)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.set_size_inches(15, 4.0)
    fig.tight_layout()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    args = ap.parse_args()
    device = setup()
    params = load_params()
    task, grammar, sft_model, reward_model, metrics = build_upstream(params, "grammar", 0, device)
    table = sanity_table(task, grammar, sft_model, reward_model)
    runs, groups, seconds = {}, {}, {}
    for seed in args.seeds:
        cases = [("no KL", no_kl())] + [(f"{a} {c:g}", params.grid.arms[a].kl(c)) for a, c in ARMS]
        for group, kl in cases:
            start = time.process_time()
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
            seconds[label] = time.process_time() - start
            print(label, f"{seconds[label]:.1f} s CPU", {k: round(v, 3) for k, v in out["summary"].items()})
    Path("docs").mkdir(exist_ok=True)
    title = f"seeds {', '.join(map(str, args.seeds))}: no KL over-optimises the proxy; KL in the reward holds gold"
    fig = run_figure(runs, title, groups)
    length_panel(fig, runs, groups)
    fig.savefig("docs/overoptimisation.png", dpi=110)
    plt.close(fig)
    out = {"upstream": metrics, "sanity": table, "cpu_seconds": seconds, "runs": runs}
    Path("docs/overoptimisation.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
