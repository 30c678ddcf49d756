"""Figures of the analysis report (matplotlib, Agg backend): every seed is drawn, nothing is picked."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ablations.grid import BASELINE

VERDICT_COLOURS = {"difference": "tab:red", "equivalent": "tab:green", "inconclusive": "tab:gray"}


def _coef_colours(coefs: list[float]) -> dict[float, tuple]:
    """One viridis colour per coefficient, in increasing order."""
    cmap = plt.get_cmap("viridis")
    return {c: cmap(i / max(1, len(coefs) - 1) * 0.85) for i, c in enumerate(sorted(coefs))}


def _arm_axes(arms: list[str], title: str):
    """A grid of panels (at most 3 per row) sharing axes, one per arm; returns (figure, arm -> axes)."""
    ncols = min(3, len(arms))
    nrows = math.ceil(len(arms) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.3 * nrows), sharex=True, sharey=True, squeeze=False)
    for ax in axes.flat[len(arms) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, dict(zip(arms, axes.flat))


def _legend(fig, colours: dict[float, tuple], extra: list | None = None):
    """A figure-level legend of the coefficient colours (and the baseline), below the panels."""
    handles = [plt.Line2D([], [], color=c, lw=2, label=f"coef {k:g}") for k, c in colours.items()]
    handles.append(plt.Line2D([], [], color="black", lw=2, label="no KL (baseline)"))
    fig.legend(handles=handles + (extra or []), loc="lower center", ncol=len(handles) + len(extra or []), frameon=False)


def _runs_of(evals: pd.DataFrame, arm: str):
    """The eval rows of ``arm`` grouped by run (coef, seed)."""
    return evals[evals.arm == arm].groupby(["coef", "seed"], sort=True)


def gold_vs_kl(
    runs: pd.DataFrame, evals: pd.DataFrame, arms: list[str], coefs: list[float], budgets: list[float], path: Path
) -> Path:
    """Gold reward against exact KL(pi || pi_ref) per arm: each run's eval trajectory (faint, in training order)
    and its final point, coloured by coefficient; dashed lines at the KL budgets."""
    colours = _coef_colours(coefs)
    panels = arms + [BASELINE]
    fig, axes = _arm_axes(panels, "Gold reward vs KL(π‖π_ref) on held-out prompts: every run")
    for arm in panels:
        ax = axes[arm]
        for (coef, _), g in _runs_of(evals, arm):
            c = "black" if arm == BASELINE else colours[coef]
            ax.plot(g.kl, g.gold, color=c, alpha=0.3, lw=0.9)
        fin = runs[runs.arm == arm]
        ax.scatter(
            fin.final_kl,
            fin.final_gold,
            s=14,
            zorder=3,
            c=["black" if arm == BASELINE else colours[c] for c in fin.coef],
            edgecolors="white",
            linewidths=0.4,
        )
        for b in budgets:
            if b <= evals.kl.max():  # a budget no run reaches would only stretch the axis
                ax.axvline(b, color="gray", ls="--", lw=0.7)
        ax.set_title("baseline (no KL)" if arm == BASELINE else arm, fontsize=10)
        ax.set_xlabel("KL (nats / response)")
        ax.set_ylabel("gold")
        ax.label_outer()
    _legend(fig, colours, [plt.Line2D([], [], color="gray", marker="o", lw=0, label="final")])
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def learning_curves(evals: pd.DataFrame, arms: list[str], coefs: list[float], path: Path) -> Path:
    """Gold reward against PPO iteration per arm: every seed faint, the mean over seeds per coefficient bold."""
    colours = _coef_colours(coefs)
    panels = arms + [BASELINE]
    fig, axes = _arm_axes(panels, "Gold reward on held-out prompts during PPO: seeds (faint) and their mean")
    for arm in panels:
        ax = axes[arm]
        sel = evals[evals.arm == arm]
        for (coef, _), g in _runs_of(evals, arm):
            ax.plot(g.iteration, g.gold, color="black" if arm == BASELINE else colours[coef], alpha=0.2, lw=0.8)
        for coef, g in sel.groupby("coef"):
            m = g.groupby("iteration").gold.mean()
            ax.plot(m.index, m.to_numpy(), color="black" if arm == BASELINE else colours[coef], lw=2)
        ax.set_title("baseline (no KL)" if arm == BASELINE else arm, fontsize=10)
        ax.set_xlabel("PPO iteration")
        ax.set_ylabel("gold")
        ax.label_outer()
    _legend(fig, colours)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def forest(comparisons: pd.DataFrame, families: dict[str, str], margin: float, reference: str, path: Path) -> Path:
    """Difference to the reference arm with its 95% CI for every comparison, one panel per family, coloured by
    verdict, with the ±margin equivalence band shaded."""
    fams = [f for f in families if (comparisons.family == f).any()]
    sizes = [int((comparisons.family == f).sum()) for f in fams]
    height = 1.2 + 0.28 * sum(sizes) + 0.6 * len(fams)
    fig, axes = plt.subplots(
        len(fams), 1, figsize=(7.5, height), gridspec_kw={"height_ratios": [max(s, 2) for s in sizes]}, squeeze=False
    )
    for ax, fam in zip(axes[:, 0], fams):
        df = comparisons[comparisons.family == fam].reset_index(drop=True)
        y = np.arange(len(df))[::-1]
        ax.axvspan(-margin, margin, color="tab:green", alpha=0.12, lw=0)
        ax.axvline(0, color="black", lw=0.8)
        for yi, r in zip(y, df.itertuples()):
            col = VERDICT_COLOURS.get(r.verdict, "black")
            if np.isfinite(r.ci_lo):
                ax.plot([r.ci_lo, r.ci_hi], [yi, yi], color=col, lw=1.6)
            ax.plot([r.diff], [yi], "o", color=col, ms=4)
        ax.set_yticks(y, df.label, fontsize=7)
        ax.set_title(families[fam], fontsize=10)
    axes[-1, 0].set_xlabel(f"difference to {reference} (gold), 95% CI; shaded: ±{margin:g} margin")
    handles = [plt.Line2D([], [], color=c, marker="o", label=v) for v, c in VERDICT_COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
