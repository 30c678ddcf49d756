"""Per-run figures: gold and proxy reward against iterations, and gold against sqrt(KL) (Gao et al. 2022)."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def run_figure(runs: dict[str, list[dict]] | list[dict], title: str):
    """``runs``: one eval list, or {label: eval list}. Each eval row has iteration, gold, proxy, kl."""
    runs = {title: runs} if isinstance(runs, list) else runs
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (label, evals) in enumerate(runs.items()):
        color = f"C{i % 10}"
        it = [e["iteration"] for e in evals]
        ax1.plot(it, [e["gold"] for e in evals], color=color, label=f"{label} gold")
        ax1.plot(it, [e["proxy"] for e in evals], color=color, ls="--", label=f"{label} proxy")
        ax2.plot([math.sqrt(max(e["kl"], 0.0)) for e in evals], [e["gold"] for e in evals], color=color,
                 marker="o", ms=3, label=label)
    ax1.set(xlabel="PPO iteration", ylabel="reward (held-out prompts)", title="gold (solid) and proxy (dashed)")
    ax2.set(xlabel="sqrt KL(pi || pi_ref)  [sqrt nats]", ylabel="gold reward", title="gold vs distance from SFT")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(title if len(runs) == 1 else "")
    fig.tight_layout()
    return fig
