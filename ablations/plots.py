"""Figures of one task's report (matplotlib, Agg backend): every run is drawn, nothing is picked."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import numpy as np
import pandas as pd

from ablations.config import AnalysisParams
from ablations.load import BASELINE
from ablations.results import TaskResults

VERDICT_COLOURS = {
    "difference": "tab:red",
    "difference within margin": "tab:olive",
    "equivalent": "tab:green",
    "inconclusive": "tab:gray",
}


def _panels(names: list[str], title: str, w: float = 4.0, h: float = 3.1, sharey: bool = True):
    """A grid of panels (at most 4 per row) sharing axes; returns (figure, name -> axes)."""
    ncols = min(4, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), sharex=True, sharey=sharey, squeeze=False)
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
    delta = proto.tasks[tr.task].margins["log_kl"]
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


REGIME_STYLE = {"on_policy": ("tab:blue", "o", 0.17), "off_policy": ("tab:orange", "s", -0.17)}  # colour, marker, dy
DIAGNOSTIC_PANELS = (  # metric, axis label, reference lines, log scale
    ("cosine", "cosine(estimate, true gradient)", (0.0, 1.0), False),
    ("scale", "scale <ĝ, g*> / |g*|² (1 = right strength)", (0.0, 1.0), False),
    ("rel_bias", "relative bias |ĝ − g*| / |g*| (1 = a zero estimate)", (1.0,), True),
)


def diagnostics(tr: TaskResults, level: float, path: Path) -> Path:
    """Gradient diagnostics (ablations/diagnostics.py): per arm (rows, in the table's order) and regime (on-policy
    blue circles above, off-policy orange squares below), each instance's value as a small point and the mean over
    instances with its t CI at ``level``; panels cosine, scale and relative bias (log axis; grey ticks: the mean
    noise floor rel_bias_noise, the relative bias that sampling noise alone would give)."""
    t, iv = tr.diagnostic_table, tr.diagnostics
    arms = list(dict.fromkeys(t.arm))
    y = {a: len(arms) - 1 - i for i, a in enumerate(arms)}
    fig, axes = plt.subplots(1, len(DIAGNOSTIC_PANELS), figsize=(14, 1.4 + 0.42 * len(arms)), sharey=True)
    for ax, (m, label, refs, log) in zip(axes, DIAGNOSTIC_PANELS):
        for ref in refs:
            ax.axvline(ref, color="black", lw=0.7, ls="-" if ref == 0 else ":")
        for r in t.itertuples():
            col, marker, dy = REGIME_STYLE.get(r.regime, ("black", "x", 0.0))
            yy = y[r.arm] + dy
            pts = iv[(iv.arm == r.arm) & (iv.regime == r.regime)][m].to_numpy(float)
            pts = pts[np.isfinite(pts) & ((pts > 0) if log else True)]
            ax.plot(pts, np.full(len(pts), yy), marker, color=col, ms=3, alpha=0.45, mfc="none")
            ax.plot([getattr(r, f"{m}_lo"), getattr(r, f"{m}_hi")], [yy, yy], color=col, lw=1.8)
            ax.plot([getattr(r, f"{m}_mean")], [yy], marker, color=col, ms=6)
            if m == "rel_bias":
                ax.plot([r.rel_bias_noise_mean], [yy], "|", color="gray", ms=10, mew=2)
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(label, fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    several = "algorithm" in t and t.algorithm.nunique() > 1  # then each label names its algorithm
    names = {r.arm: f"{r.arm} ({r.algorithm})" if several else r.arm for r in t.itertuples()}
    axes[0].set_yticks(list(y.values()), [names[a] for a in y], fontsize=7)
    axes[0].set_ylim(-0.6, len(arms) - 0.4)
    handles = [plt.Line2D([], [], color=c, marker=mk, ls="", label=g.replace("_", "-"))
               for g, (c, mk, _) in REGIME_STYLE.items()]  # fmt: skip
    handles.append(plt.Line2D([], [], color="gray", marker="|", ls="", ms=10, mew=2, label="noise floor (mean)"))
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, fontsize=8)
    fig.suptitle(f"{tr.task}: each arm's KL-gradient estimate vs the true gradient of the sequence KL "
                 f"(small: instances; large: mean with {level:.0%} CI)", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.3 / (1.4 + 0.42 * len(arms)), 1, 1))
    return _save(fig, path)


SEQ_COLOURS = {"material difference": "tab:red", "difference": "tab:orange", "equivalent": "tab:green",
               "insensitive": "tab:purple", "inconclusive": "tab:gray"}  # fmt: skip


def sequential(tr: TaskResults, path: Path) -> Path:
    """Each primary question's path over the looks: the estimate with the exact (1 - a_j) CI (thick) and the
    (1 - 2 a_j) CI (thin) at every look n_j, coloured by the look's verdict, the margin band and zero; the look that
    settled the question is circled."""
    names = [f"{r['question']}: {r['comparison']} ({r['metric']})" for r in tr.primary]
    title = f"{tr.task}: primary questions, look by look"
    fig, axes = _panels(names or ["no primary question"], title, 4.2, 3.3, sharey=False)
    for r, name in zip(tr.primary, names):
        ax = axes[name]
        ax.axhspan(-r["margin"], r["margin"], color="tab:green", alpha=0.08, lw=0)
        ax.axhline(0, color="k", lw=0.6)
        for look in r["path"]:
            c = SEQ_COLOURS.get(look["effective"], "k")
            finite = lambda v: v if v is not None and np.isfinite(v) else np.nan
            ax.vlines(look["n"], finite(look["lo90"]), finite(look["hi90"]), color=c, lw=1)
            ax.vlines(look["n"], finite(look["lo"]), finite(look["hi"]), color=c, lw=3, alpha=0.6)
            ax.plot(look["n"], look["estimate"], "o", color=c, ms=4)
            if r["settled"] and look["j"] == r["looks_decided"]:
                ax.plot(look["n"], look["estimate"], "o", mfc="none", mec="k", ms=11)
        ax.set_title(f"{name}\n{r['verdict']} ({r['status']})", fontsize=8)
        ax.set_xlabel("evaluation instances (n)")
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    for ax in axes.values():
        ax.tick_params(labelleft=True)
    fig.tight_layout()
    return _save(fig, path)


def all_figures(tr: TaskResults, proto: AnalysisParams, folder: Path) -> list[tuple[str, Path]]:
    """Writes the figures into ``folder`` (and the gradient-diagnostics figure when the task has diagnostics);
    returns (title, path) pairs in report order."""
    out = [
        ("Primary questions, look by look (exact CIs at each look's level)", sequential(tr, folder / "sequential.png")),
        ("Gold vs KL, every run", gold_vs_kl(tr, folder / "gold_vs_kl.png")),
        ("Learning curves", learning_curves(tr, folder / "learning_curves.png")),
        ("Comparisons with their TOST 90% CIs and margins (forest plot)", forest(tr, folder / "forest.png")),
        ("Q1 restraint and collapse", restraint(tr, proto, folder / "restraint.png")),
    ]
    if len(tr.diagnostic_table):
        out.append(("Gradient diagnostics", diagnostics(tr, 1 - proto.alpha, folder / "diagnostics.png")))
    return out


# --- The views a reader compares arms by: DVC's top-level plots (reports/<task>/plots/*.json, vega-lite templates
# in .dvc/plots/) and the same data as figures logged to the task's MLflow analysis run (figures/*.png) ---

NO_KL = "no KL"
PLOT_DATA = ("arms.json", "frontier.json", "differences.json")  # in reports/<task>/plots/
VIEW_FIGURES = ("arms.png", "frontier.png", "differences.png")  # in reports/<task>/figures/


def cell_label(arm: str, kind: str, level: float | None) -> str:
    """One evaluation cell of a task, as the views name it: ``no KL``, ``<arm> β <coef>`` or ``<arm> KL <target>``."""
    if kind == "baseline" or arm == BASELINE:
        return NO_KL
    return f"{arm} KL {level:.3g}" if kind == "matched" else f"{arm} β {level:g}"


def _per_instance(tr: TaskResults) -> pd.DataFrame:
    """Every eval row averaged over an instance's PPO seeds (the instance is the unit), labelled by cell and
    placement; cells in the grid's order (no KL first)."""
    ev = tr.evals
    keys = ["arm", "kind", "level", "instance", "iteration"]
    per = ev.groupby(keys, dropna=False, sort=False)[["gold", "kl"]].mean().reset_index()
    placement = dict(zip(tr.runs.arm, tr.runs.placement))
    per["cell"] = [cell_label(a, k, lv) for a, k, lv in zip(per.arm, per.kind, per.level)]
    per["placement"] = per.arm.map(placement).fillna("none")
    order = {c: i for i, c in enumerate(dict.fromkeys([NO_KL, *per.cell]))}
    return per.assign(order=per.cell.map(order)).sort_values(["order", "instance", "iteration"], kind="stable")


def arm_curves(tr: TaskResults) -> pd.DataFrame:
    """Gold against PPO iteration per cell: the median and interquartile range across instances, and n."""
    per = _per_instance(tr)
    g = per.groupby(["order", "cell", "arm", "placement", "iteration"], sort=True).gold
    out = pd.concat(
        [g.median().rename("median"), g.quantile(0.25).rename("q25"), g.quantile(0.75).rename("q75"),
         g.size().rename("n")], axis=1,
    ).reset_index()  # fmt: skip
    return out.drop(columns="order")


def frontier(tr: TaskResults) -> pd.DataFrame:
    """Gold against exact KL along training, per placement: each cell's median trajectory across instances (the
    median KL and the median gold at each evaluated iteration); the no-KL trajectory repeated in every placement's
    panel as the reference."""
    per = _per_instance(tr)
    g = per.groupby(["order", "cell", "arm", "placement", "iteration"], sort=True)
    med = g[["kl", "gold"]].median().reset_index()
    none, kl = med[med.cell == NO_KL], med[med.cell != NO_KL]
    panels = list(dict.fromkeys(kl.placement)) or ["none"]
    out = pd.concat([*(none.assign(placement=p) for p in panels), kl], ignore_index=True)
    # cells in the grid's order (the colours of arms.json), the panels in the order their arms come
    return out.sort_values("order", kind="stable").drop(columns="order").reset_index(drop=True)


def differences(tr: TaskResults) -> pd.DataFrame:
    """Each primary comparison's paired difference d_i per instance (ablations/primary.py ``differences``, in the
    pre-registered order), ``decided`` for the instances of the look that decided it, with its estimate (the median),
    CI and margin. Generic over the comparisons: whatever analyse() returned (a frontier question is one comparison
    per KL level)."""
    rows = []
    for r in tr.primary:
        for k, (instance, d) in enumerate((r.get("differences") or {}).items()):
            rows.append(
                {"question": r["question"], "comparison": r["comparison"], "contrast": r.get("contrast"),
                 "metric": r["metric"],
                 "instance": int(instance), "difference": d, "decided": k < (r.get("n") or 0),
                 "estimate": r.get("estimate"), "lo": r.get("lo"), "hi": r.get("hi"), "margin": r.get("margin"),
                 "verdict": r.get("verdict")}
            )  # fmt: skip
    cols = ["question", "comparison", "contrast", "metric", "instance", "difference", "decided", "estimate", "lo", "hi",
            "margin"]  # fmt: skip
    return pd.DataFrame(rows, columns=[*cols, "verdict"])


def _records(df: pd.DataFrame) -> list[dict]:
    """JSON-ready rows: floats rounded to 6 decimals (readable diffs), NaN as null."""
    out = []
    for row in df.to_dict("records"):
        out.append({k: (None if isinstance(v, float) and not np.isfinite(v) else
                        round(v, 6) if isinstance(v, float) else v.item() if isinstance(v, np.generic) else v)
                    for k, v in row.items()})  # fmt: skip
    return out


# no KL black, then vega's tableau10 and more: the colours of the templates in .dvc/plots/ (cells in the grid's order)
CELL_COLOURS = ("#000000", "#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6",
                "#9d755d", "#bab0ac", "#8c564b", "#17becf", "#bcbd22", "#7f7f7f")  # fmt: skip


def _cell_colours(cells) -> dict[str, str]:
    """Each cell's colour, as the DVC templates give it: in order of first appearance, no KL first."""
    others = [c for c in dict.fromkeys(cells) if c != NO_KL]
    rest = CELL_COLOURS[1:]
    return {NO_KL: CELL_COLOURS[0], **{c: rest[i % len(rest)] for i, c in enumerate(others)}}


def arms_figure(df: pd.DataFrame, task: str, path: Path) -> Path:
    """Every cell's median gold (line) with its interquartile range across instances (band), one panel."""
    fig, ax = plt.subplots(figsize=(9, 5))
    colours = _cell_colours(df.cell)
    for cell, g in df.groupby("cell", sort=False):
        ax.fill_between(g.iteration, g.q25, g.q75, color=colours[cell], alpha=0.12, lw=0)
        ax.plot(g.iteration, g["median"], color=colours[cell], lw=1.8, label=f"{cell} (n={int(g.n.max())})")
    ax.set(xlabel="PPO iteration", ylabel="gold (held-out prompts)",
           title=f"{task}: gold by arm, median and interquartile range across instances")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def frontier_figure(df: pd.DataFrame, task: str, path: Path) -> Path:
    """Gold against exact KL along training, one panel per placement, each cell's median trajectory (the last
    evaluation marked), the no-KL trajectory in black in every panel; KL on a symmetric-log axis."""
    panels = list(dict.fromkeys(df.placement))
    fig, axes = _panels(panels, f"{task}: gold against exact KL(π‖π_ref) along training, median across instances",
                        4.6, 3.8)  # fmt: skip
    colours = _cell_colours(df.cell)
    for p, ax in axes.items():
        for cell, g in df[df.placement == p].groupby("cell", sort=False):
            style = {"color": colours[cell], "lw": 1.0 if cell == NO_KL else 1.6, "ls": "--" if cell == NO_KL else "-"}
            ax.plot(g.kl, g.gold, label=cell, **style)
            ax.plot(g.kl.iloc[-1:], g.gold.iloc[-1:], "o", color=colours[cell], ms=4)
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set(title=f"KL in the {p}" if p in ("reward", "loss") else p, xlabel="exact KL (nats / response)")
        ax.set_ylabel("gold")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, path)


def differences_figure(df: pd.DataFrame, task: str, path: Path) -> Path:
    """Per primary comparison (a panel each), each instance's paired difference (filled: the instances of the
    deciding look), the estimate with its CI (bar), zero and the ±margin band."""
    comparisons = list(dict.fromkeys(df.comparison)) or ["no primary comparison"]
    sizes = [max(int((df.comparison == q).sum()), 4) + 3 for q in comparisons]
    fig, axs = plt.subplots(len(comparisons), 1, figsize=(8, 0.9 + 0.16 * sum(sizes)), squeeze=False,
                            gridspec_kw={"height_ratios": sizes})  # fmt: skip
    fig.suptitle(f"{task}: primary comparisons, paired differences by instance")
    axes = dict(zip(comparisons, axs[:, 0]))
    for q, ax in axes.items():
        d = df[df.comparison == q].reset_index(drop=True)
        if d.empty:
            continue
        m = float(d.margin.iloc[0])
        ax.axvspan(-m, m, color="tab:green", alpha=0.1, lw=0)
        ax.axvline(0, color="black", lw=0.7)
        y = np.arange(len(d))[::-1]
        used = d.decided.to_numpy(bool)
        ax.plot(d.difference[used], y[used], "o", color="tab:blue", ms=4, label="in the deciding look")
        ax.plot(d.difference[~used], y[~used], "o", mfc="none", color="tab:blue", ms=4, label="later instances")
        est, lo, hi = (d[c].iloc[0] for c in ("estimate", "lo", "hi"))
        if lo is not None and hi is not None and np.isfinite([est, lo, hi]).all():
            err = [[est - lo], [hi - est]]
            ax.errorbar([est], [-1.5], xerr=err, fmt="D", color="tab:red", capsize=3, label="estimate, CI")
        ax.set_yticks(y, [str(i) for i in d.instance], fontsize=5)
        ax.set_title(f"{q}: {d.contrast.iloc[0]} ({d.metric.iloc[0]})\n{d.verdict.iloc[0]}", fontsize=8)
        ax.set_xlabel(f"difference in {d.metric.iloc[0]} (shaded ±{m:.3g})")
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def write_views(tr: TaskResults, folder: Path) -> list[Path]:
    """Writes the three views of ``tr`` into ``folder``: their data (plots/arms.json, plots/frontier.json,
    plots/differences.json: DVC's top-level plots) and figures (figures/arms.png, frontier.png, differences.png:
    logged to MLflow). Returns the paths."""
    import json

    data = {"arms.json": arm_curves(tr), "frontier.json": frontier(tr), "differences.json": differences(tr)}
    (folder / "plots").mkdir(parents=True, exist_ok=True)
    (folder / "figures").mkdir(parents=True, exist_ok=True)
    out = []
    for name, df in data.items():
        (folder / "plots" / name).write_text(json.dumps(_records(df), indent=1, ensure_ascii=False) + "\n")
        out.append(folder / "plots" / name)
    out.append(arms_figure(data["arms.json"], tr.task, folder / "figures" / "arms.png"))
    out.append(frontier_figure(data["frontier.json"], tr.task, folder / "figures" / "frontier.png"))
    out.append(differences_figure(data["differences.json"], tr.task, folder / "figures" / "differences.png"))
    return out
