"""Figures of one task's report (matplotlib, Agg backend): every run is drawn, nothing is picked."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from ablations.config import AnalysisParams
from ablations.load import BASELINE
from ablations.results import TaskResults

VERDICT_COLOURS = {
    "difference": "tab:red",
    "difference within margin": "tab:olive",
    "equivalent": "tab:green",
    "inconclusive": "tab:gray",
}


def _panels(names: list[str], title: str, w: float = 4.0, h: float = 3.1):
    """A grid of panels (at most 4 per row) sharing axes; returns (figure, name -> axes)."""
    ncols = min(4, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), sharex=True, sharey=True, squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, dict(zip(names, axes.flat))


def _colours(levels) -> dict[float, tuple]:
    cmap = plt.get_cmap("viridis")
    lv = sorted(levels)
    return {c: cmap(i / max(1, len(lv) - 1) * 0.85) for i, c in enumerate(lv)}


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _arms(tr: TaskResults) -> list[str]:
    return [BASELINE] + [a for a in dict.fromkeys(tr.runs.arm) if a != BASELINE]


def gold_vs_kl(tr: TaskResults, path: Path) -> Path:
    """Gold against exact KL per arm: fixed-coefficient runs (solid, coloured by coefficient) and KL-matched runs
    (dashed, red) with their targets (dotted lines); the final point of each run marked."""
    ev, runs = tr.evals, tr.runs
    colours = _colours(runs[runs.kind == "fixed"].level.unique())
    targets = sorted(runs[runs.kind == "matched"].level.unique())
    fig, axes = _panels(_arms(tr), f"{tr.task}: gold vs KL(π‖π_ref) on held-out prompts, every run")
    for arm, ax in axes.items():
        for (kind, lv, _i, _s), g in ev[ev.arm == arm].groupby(["kind", "level", "instance", "seed"], dropna=False):
            col = "black" if kind == "baseline" else colours.get(lv, "tab:red") if kind == "fixed" else "tab:red"
            ax.plot(g.kl, g.gold, color=col, alpha=0.35, lw=0.8, ls="--" if kind == "matched" else "-")
            ax.plot(g.kl.iloc[-1:], g.gold.iloc[-1:], "o", color=col, ms=2.5)
        for t in targets:
            ax.axvline(t, color="tab:red", ls=":", lw=0.7)
        ax.set_title("no KL" if arm == BASELINE else arm, fontsize=9)
        ax.set_xlabel("KL (nats / response)")
        ax.set_ylabel("gold")
        ax.label_outer()
    handles = [plt.Line2D([], [], color=c, label=f"coef {k:g}") for k, c in colours.items()]
    handles += [plt.Line2D([], [], color="tab:red", ls="--", label="KL-matched (targets dotted)")]
    handles += [plt.Line2D([], [], color="black", label="no KL")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, path)


def learning_curves(tr: TaskResults, path: Path) -> Path:
    """Gold against PPO iteration per arm and fixed coefficient: every run faint, the mean over runs bold."""
    ev = tr.evals[tr.evals.kind != "matched"]
    colours = _colours(tr.runs[tr.runs.kind == "fixed"].level.unique())
    fig, axes = _panels(_arms(tr), f"{tr.task}: gold during PPO (fixed coefficients), runs faint, mean bold")
    for arm, ax in axes.items():
        for lv, g in ev[ev.arm == arm].groupby("level", dropna=False):
            col = "black" if arm == BASELINE else colours[lv]
            for _, r in g.groupby(["instance", "seed"]):
                ax.plot(r.iteration, r.gold, color=col, alpha=0.2, lw=0.7)
            m = g.groupby("iteration").gold.mean()
            ax.plot(m.index, m.to_numpy(), color=col, lw=1.8)
        ax.set_title("no KL" if arm == BASELINE else arm, fontsize=9)
        ax.set_xlabel("PPO iteration")
        ax.set_ylabel("gold")
        ax.label_outer()
    handles = [plt.Line2D([], [], color=c, label=f"coef {k:g}") for k, c in colours.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles) or 1, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, path)


def forest(tr: TaskResults, path: Path) -> Path:
    """Every Q2-Q4 comparison and positive control: difference with its 90% CI (thick, the TOST interval) and 95% CI
    (thin), coloured by verdict; the ±margin band shaded. One panel per question and metric."""
    c = tr.comparisons
    groups = [(q, m) for q, m in dict.fromkeys(zip(c.question, c.metric))] if len(c) else []
    if not groups:
        fig = plt.figure(figsize=(6, 1))
        fig.text(0.5, 0.5, "no comparisons", ha="center")
        return _save(fig, path)
    sizes = [int(((c.question == q) & (c.metric == m)).sum()) for q, m in groups]
    height = 1.0 + 0.2 * sum(sizes) + 0.7 * len(groups)
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, height), squeeze=False,
                             gridspec_kw={"height_ratios": [max(s, 2) for s in sizes]})  # fmt: skip
    for ax, (q, m) in zip(axes[:, 0], groups):
        df = c[(c.question == q) & (c.metric == m)].reset_index(drop=True)
        y = np.arange(len(df))[::-1]
        margin = float(df.margin.iloc[0])
        ax.axvspan(-margin, margin, color="tab:green", alpha=0.12, lw=0)
        ax.axvline(0, color="black", lw=0.7)
        for yi, r in zip(y, df.itertuples()):
            pc = not r.in_family
            negligible = not pc and r.verdict == "difference" and bool(r.within_margin)
            v = "difference within margin" if negligible else r.verdict
            col = "tab:blue" if pc else VERDICT_COLOURS.get(v, "black")
            ax.plot([r.ci95_lo, r.ci95_hi], [yi, yi], color=col, lw=0.8)
            ax.plot([r.ci90_lo, r.ci90_hi], [yi, yi], color=col, lw=2.6)
            ax.plot([r.diff], [yi], "D" if pc else "o", color=col, ms=3.5)
        where = [f.split(" @ ")[-1] if " @ " in f else "tuned" for f in df.family]
        ax.set_yticks(y, [f"{w}: {lab}" for w, lab in zip(where, df.label)], fontsize=6)
        ax.set_title(f"{q} {m} (shaded ±{margin:g})", fontsize=9)
        lo, hi = np.nanmin(df.ci95_lo.to_numpy(float)), np.nanmax(df.ci95_hi.to_numpy(float))
        if np.isfinite(lo) and np.isfinite(hi):
            span = max(hi, margin) - min(lo, -margin)
            ax.set_xlim(min(lo, -margin) - 0.05 * span, max(hi, margin) + 0.05 * span)
    axes[-1, 0].set_xlabel("difference (arm − other): 90% CI thick (TOST), 95% CI thin")
    handles = [plt.Line2D([], [], color=v, marker="o", label=k) for k, v in VERDICT_COLOURS.items()]
    handles.append(plt.Line2D([], [], color="tab:blue", marker="D", label="positive control (no KL − reference)"))
    fig.legend(handles=handles, loc="lower center", ncol=4, frameon=False, fontsize=7)
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1))
    return _save(fig, path)


def restraint(tr: TaskResults, proto: AnalysisParams, path: Path) -> Path:
    """Q1: per arm and coefficient the mean log ratio of final KL to no KL with its 90% CI against the minimum
    meaningful reduction; and every cell's collapse rate with its exact 95% CI."""
    r, col = tr.restraint, tr.collapse
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.8 + 0.22 * max(len(r), len(col), 4)))
    delta = proto.tasks[tr.task].min_log_kl_reduction
    if len(r):
        y = np.arange(len(r))[::-1]
        colours = {"restrains": "tab:green", "does not restrain": "tab:red", "inconclusive": "tab:gray"}
        for yi, row in zip(y, r.itertuples()):
            c = colours.get(row.verdict, "black")
            a1.plot([row.ci90_lo, row.ci90_hi], [yi, yi], color=c, lw=2.2)
            a1.plot([row.log_ratio], [yi], "o", color=c, ms=3.5)
        a1.axvline(-delta, color="tab:green", ls="--", lw=1)
        a1.axvline(0, color="black", lw=0.7)
        a1.set_yticks(y, [f"{row.arm} @ {row.level:g}" for row in r.itertuples()], fontsize=7)
        a1.set_xlabel(f"log(final KL / no-KL final KL), 90% CI; dashed: −{delta:.3g} (minimum reduction)")
        a1.set_title("Q1 restraint (green restrains, red does not)", fontsize=9)
    y = np.arange(len(col))[::-1]
    for yi, row in zip(y, col.itertuples()):
        a2.plot([row.ci_lo, row.ci_hi], [yi, yi], color="tab:purple", lw=1.6)
        a2.plot([row.rate], [yi], "o", color="tab:purple", ms=3.5)
    lab = lambda row: "no KL" if row.arm == BASELINE else f"{row.arm} {row.kind} {row.level:g}"
    a2.set_yticks(y, [lab(row) for row in col.itertuples()], fontsize=6)
    a2.set_xlim(-0.02, 1.02)
    a2.set_xlabel("collapse rate (final gold < SFT gold − collapse_drop), exact 95% CI")
    a2.set_title("collapse per cell", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def all_figures(tr: TaskResults, proto: AnalysisParams, folder: Path) -> list[tuple[str, Path]]:
    """Writes the four figures into ``folder``; returns (title, path) pairs in report order."""
    return [
        ("Gold vs KL, every run", gold_vs_kl(tr, folder / "gold_vs_kl.png")),
        ("Learning curves", learning_curves(tr, folder / "learning_curves.png")),
        ("Comparisons with their TOST 90% CIs and margins (forest plot)", forest(tr, folder / "forest.png")),
        ("Q1 restraint and collapse", restraint(tr, proto, folder / "restraint.png")),
    ]
