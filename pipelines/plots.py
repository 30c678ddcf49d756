"""Per-run figures: gold and its dashed companion (the proxy reward of a learned-reward task, out-of-domain gold of a
verifier task) against iterations, and gold against sqrt(KL) (Gao et al. 2022)."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def run_figure(runs: dict[str, list[dict]] | list[dict], title: str, groups: dict[str, str] | None = None):
    """``runs``: one eval list, or {label: eval list}; each eval row has iteration, gold, kl and proxy or ood_gold.
    ``groups`` (label -> group name) colours runs by group, one legend entry per group (e.g. seeds of an arm)."""
    runs = {title: runs} if isinstance(runs, list) else runs
    groups = groups or {label: label for label in runs}
    color = {g: f"C{i % 10}" for i, g in enumerate(dict.fromkeys(groups.values()))}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    first = next(iter(runs.values()))[0]
    dashed = "proxy" if "proxy" in first else "ood_gold"
    seen = set()
    for label, evals in runs.items():
        group = groups[label]
        legend = group if group not in seen else None
        seen.add(group)
        it = [e["iteration"] for e in evals]
        ax1.plot(it, [e["gold"] for e in evals], color=color[group], label=legend and f"{legend}: gold")
        ax1.plot(it, [e[dashed] for e in evals], color=color[group], ls="--", label=legend and f"{legend}: {dashed}")
        ax2.plot(
            [math.sqrt(max(e["kl"], 0.0)) for e in evals],
            [e["gold"] for e in evals],
            color=color[group],
            marker="o",
            ms=3,
            label=legend,
        )
    ax1.set(xlabel="PPO iteration", ylabel="reward (held-out prompts)", title=f"gold (solid) and {dashed} (dashed)")
    ax2.set(xlabel="sqrt KL(pi || pi_ref)  [sqrt nats]", ylabel="gold reward", title="gold vs distance from SFT")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def save_run_figure(runs: dict[str, list[dict]] | list[dict], title: str, path, dpi: int = 90) -> None:
    """``run_figure`` written to ``path``, then closed: pyplot keeps every figure it made until it is closed, so a
    worker that runs many cells would otherwise grow with each."""
    fig = run_figure(runs, title)
    try:
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
