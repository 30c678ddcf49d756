"""The words of the analysis: one verdict per question with its numbers and scope, report.md per task, the index,
and stats.json. Formats results computed elsewhere (ablations/questions.py, answers.py, descriptive.py); imports
only the result containers, never ablations.analysis. Tables are in ablations/tables.py."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ablations import answers as A
from ablations import stats as S
from ablations import tables as T
from ablations.diagnostics import METRICS
from ablations.results import Results, TaskResults

_f, _ci = T.fmt, T.ci


def _fam_comps(tr: TaskResults, q: str, m: str) -> pd.DataFrame:
    c = tr.comparisons
    return c[(c.question == q) & (c.metric == m) & c.in_family.astype(bool)] if len(c) else c


def _pcs(tr: TaskResults, q: str, m: str) -> str:
    """ "positive control detected in k of F families (no KL − ref: Δ a to b)"."""
    f = tr.families[(tr.families.question == q) & (tr.families.metric == m)]
    if f.empty:
        return ""
    what = "reference arm restrains" if q == "Q1" else "no KL − reference"
    d = f.pc_diff.to_numpy(float)
    span = (
        f"{_f(np.nanmin(d), sign=True)}"
        if len(d) == 1
        else f"{_f(np.nanmin(d), sign=True)} to {_f(np.nanmax(d), sign=True)}"
    )
    unit = "log KL ratio" if q == "Q1" else m
    return f"positive control ({what}) detected in {int(f.pc_pass.sum())} of {len(f)} families ({unit} {span})"


def _largest(c: pd.DataFrame) -> pd.Series | None:
    return c.loc[c["diff"].abs().idxmax()] if len(c) and c["diff"].notna().any() else None


def _row_numbers(r) -> str:
    """ "loss_k1 − reward_k1 @ coef 0.1: Δ −2.115 (95% CI [..]; 90% CI [..])"."""
    where = r.family.split(" @ ")[-1] if " @ " in r.family else "tuned"
    cis = f"95% CI {_ci(r.ci95_lo, r.ci95_hi)}, 90% CI {_ci(r.ci90_lo, r.ci90_hi)}"
    return f"{r.label} ({where}): Δ {_f(r['diff'], sign=True)} ({cis})"


def _needed(c: pd.DataFrame) -> str:
    """What more instances would do for the inconclusive comparisons."""
    inc = c[c.verdict == S.INCONCLUSIVE]
    if inc.empty:
        return ""
    out_of_reach = int(np.isinf(inc.n_needed_equiv).sum())
    eq = inc.n_needed_equiv[np.isfinite(inc.n_needed_equiv)]
    dd = inc.n_needed_diff[np.isfinite(inc.n_needed_diff)]
    parts = []
    if len(dd):
        parts.append(f"for the inconclusive, showing the observed difference would take {T.span(dd)} instances")
    if len(eq):
        parts.append(f"showing equivalence {T.span(eq)}")
    if out_of_reach:
        parts.append(f"equivalence is out of reach for {out_of_reach} (observed difference near or beyond the margin)")
    return "; ".join(parts)


def question_sentence(tr: TaskResults, ans, proto) -> str:
    """One question's verdict with its numbers."""
    q, m, a = ans.question, ans.metric, ans.reported
    head = f"**{q} {'' if q == 'Q1' else m + ' '}— {a}.**"
    if a == A.NOT_RUN:
        return f"{head} The design has no runs for this question."
    if q == "Q1":
        r = tr.restraint
        bad = r[r.verdict == S.NO_RESTRAINT]
        body = []
        if len(bad):
            worst = bad.loc[bad.log_ratio.idxmax()]
            body.append(
                f"{', '.join(dict.fromkeys(bad.arm))} do not restrain KL at {len(bad)} (arm, coef) cells: e.g. "
                f"{worst.arm} at coef {worst.level:g} ends at {_f(worst.kl_arm, 1)} nats vs {_f(worst.kl_none, 1)} "
                f"without KL (log ratio {_f(worst.log_ratio, sign=True)}, 90% CI {_ci(worst.ci90_lo, worst.ci90_hi)}; "
                f"restraint needs below −{proto.tasks[tr.task].min_log_kl_reduction:.3g})"
            )
        n_ok = int((r.verdict == S.RESTRAINS).sum())
        body.append(f"{n_ok} of {len(r)} cells restrain, {int((r.verdict == S.INCONCLUSIVE).sum())} inconclusive")
        body.append(_pcs(tr, q, m))
        body.append(T.collapse_words(tr.collapse))
    else:
        c = _fam_comps(tr, q, m)
        mat = c[c.material.astype(bool)]
        n_eq = int(((c.verdict == S.EQUIVALENT) | c.within_margin.astype(bool)).sum())
        n_f = int(((tr.families.question == q) & (tr.families.metric == m)).sum())
        body = [f"of {len(c)} comparisons in {n_f} famil{'y' if n_f == 1 else 'ies'}: {len(mat)} material "
                f"differences (Holm-significant, not shown within ±{c.margin.iloc[0]:g}), {n_eq} equivalent or "
                f"within the margin, {int((c.verdict == S.INCONCLUSIVE).sum())} inconclusive"]  # fmt: skip
        top = _largest(mat) if len(mat) else _largest(c)
        if top is not None:
            body.append(("largest difference " if len(mat) else "largest gap ") + _row_numbers(top))
        reach = np.nanmax(np.abs(c[["ci90_lo", "ci90_hi"]].to_numpy(float))) if len(c) else np.nan
        if np.isfinite(reach) and mat.empty:
            body.append(f"the 90% CIs reach ±{_f(reach)} at most")
        if q == "Q3" and len(tr.steering):
            st = tr.steering
            bad = st[~st.steerable]
            body.append(
                "every arm steerable to every target"
                if bad.empty
                else "not steerable: "
                + ", ".join(f"{r.arm} at {r.target:g} nats ({r.hits}/{r.runs} hit)" for r in bad.itertuples())
            )
        body.append(_pcs(tr, q, m))
        need = _needed(c)
        if need:
            body.append(need)
    runs = tr.runs
    seeds = runs.groupby("instance").seed.nunique()
    tag = f"{tr.task}, {runs.instance.nunique()} instances × {T.span(seeds)} seed{'s' if seeds.max() > 1 else ''}"
    stab = f"split-half: {ans.status} (halves: {ans.half_a} / {ans.half_b})"
    full = f" (full data: {ans.answer})" if a == A.UNSETTLED else ""
    return f"{head}{full} " + "; ".join(x for x in body if x) + f". [{tag}; {stab}]"


def answer_paragraph(tr: TaskResults, proto) -> list[str]:
    """The headline and one line per question."""
    what = {
        "matters": "where the KL penalty goes matters",
        "does not matter": "where the KL penalty goes does not matter within the pre-registered margins",
        "not settled": "these runs do not settle whether it matters",
    }[tr.headline]
    L = [f"**Answer ({tr.headline}).** On {tr.scope}: {what}.", ""]
    for ans in tr.answers.itertuples():
        L.append(f"- {question_sentence(tr, ans, proto)}")
    return L


# ---------------------------------------------------------------- report.md


def _cells(cells: list) -> str:
    """ "fixed coef 0.03, 0.1; matched KL 2" from (kind, level) pairs."""
    what = {"fixed": "fixed coef", "matched": "matched KL", "baseline": "no KL"}
    by: dict[str, list] = {}
    for kind, level in cells:
        by.setdefault(kind, []).append("" if level is None else f"{level:g}")
    return "; ".join(f"{what.get(k, k)} {', '.join(v)}".strip() for k, v in by.items())


def diagnostic_lines(tr: TaskResults, p) -> list[str]:
    """The gradient-diagnostic section: the table, what it compares on which runs, and how to read it; one line
    when no run of the task has diagnostics."""
    t, c = tr.diagnostic_table, tr.diagnostic_coverage
    if t.empty:
        return ["No run of this task has gradient diagnostics (`diagnostics` in the task's `ppo` section of "
                "params.yaml was off, or the runs predate diagnostics.csv): no table and no figure."]  # fmt: skip
    level = f"{1 - p.alpha:.0%}"
    _, common = T.diagnostic_spec(t)
    missing = c["runs_total"] - c["runs_with"]
    L = [
        T.diagnostics_table(t),
        "",
        "Each row compares the arm's own KL-gradient estimate (the gradient of its KL term as the training loop "
        "applies it, on one minibatch, per unit coefficient) with an unbiased estimate of the true gradient of the "
        "sequence-level KL(π_θ‖π_ref) to the reference, on-policy and after the arm's own off-policy updates "
        f"(epochs × minibatches − 1 on the iteration's batch), at checkpoint iteration(s) "
        f"{', '.join(map(str, c['checkpoints']))}, in {c['runs_with']} of the {c['runs_total']} KL-arm runs "
        f"({_cells(c['cells'])}) on instance(s) {', '.join(map(str, c['instances']))}; each instance's runs and "
        f"checkpoints are averaged, then mean [{level} t CI] over instances, n = instances (rlhf/diagnostics.py "
        "defines every metric).",
        "",
        "Scale 1 is the true gradient's strength per unit coefficient; a relative bias of 1 is no closer to the true "
        "gradient than a zero gradient; the noise floor (mean) is the relative bias that sampling noise alone would "
        "give, and *beyond noise* removes it. The cosine of the mean estimate is the bias-only cosine: an unbiased "
        "estimator with the arm's noise would reach its noise floor, so only a cosine clearly below the floor shows "
        "bias. The one-minibatch cosine mostly measures variance: do not rank arms by it. It does not shrink for a "
        "mean-zero estimator (its mean is noise); the scale does. Regimes ending in _own judge the arm against its "
        "own target (moving reference, or the rollout policy for target old_policy) instead of the frozen SFT model.",
    ]
    if common:
        L += ["", f"Common to every row: {common}."]
    if missing:
        L += ["", f"{missing} KL-arm run(s) have no diagnostics (header-only or no diagnostics.csv) and are not in it."]
    return L


def render_task(tr: TaskResults, res: Results, images: dict[str, str]) -> str:
    """A task's report.md: the answer, scope, lock, one section per question, the factorial view, secondary
    outcomes, stability, figures and the protocol."""
    p, tp = res.protocol, res.protocol.tasks[tr.task]
    L = [f"# Does it matter where the KL penalty goes? Task `{tr.task}`", ""]
    L += answer_paragraph(tr, p)
    L += [
        "",
        f"> **Scope.** Every claim here is about {tr.scope}, and about this protocol. Synthetic task, tiny models: not "
        "evidence about large language models until reproduced on one.",
        "",
        "**Protocol lock.** " + " ".join(res.lock.sentences() if res.lock else ["not checked (no git information)."]),
        "",
        "## The four questions",
        "",
        T.answers_table(tr),
        "",
        "Positive controls and exact-test floors per family (a positive control passes at α/m, the strictest level a "
        "member of the family faces under Holm; the exact sign-flip test cannot go below its floor):",
        "",
        T.families_table(tr.families, p.alpha),
        "",
        "## Q1 Restraint",
        "",
        f"Per instance, log(final exact KL / no-KL final exact KL); *restrains* when the mean is shown below "
        f"−{tp.min_log_kl_reduction:.3g} (the arm at least {1 - math.exp(-tp.min_log_kl_reduction):.0%} below no "
        f"KL), *does not restrain* when shown above it (one-sided t-tests at α = {p.alpha:g}, Holm within each "
        "coefficient).",
        "",
        T.restraint_table(tr.restraint),
        "",
        f"Collapse: final gold more than {tp.collapse_drop:g} below the run's own SFT gold (per run; exact "
        f"Clopper–Pearson 95% CI; runs of one instance are not independent when it has several seeds).",
        "",
        T.collapse_table(tr.collapse, tr.cells),
        "",
    ]
    for q, title in (("Q2", "Q2 Matched coefficient"), ("Q3", "Q3 Matched KL, by construction"), ("Q4", "Q4 Tuned")):
        L += [f"## {title}", ""]
        if q == "Q3":
            L += [
                f"Hit: final exact KL within ±{tp.kl_tolerance:.0%} of the target. A miss is a failure, counted "
                f"here and kept in the comparisons below with its final values (intention to treat); an arm that "
                f"hits in fewer than {p.min_hit_rate:.0%} of its runs is *not steerable* at that target.",
                "",
                T.steering_table(tr.steering),
                "",
                T.target_overlap(list(tr.steering.target.unique()) if len(tr.steering) else [], tp.kl_tolerance),
                "",
            ]
        if q == "Q4":
            L += [
                "Cross-fitting: the coefficient with the best mean final gold on one half of the instances is "
                "evaluated on the other half, and vice versa; no value is evaluated on the instances that chose it.",
                "",
                T.tuning_table(tr.tuning),
                "",
            ]
        for m in tp.margins:
            c = tr.comparisons[(tr.comparisons.question == q) & (tr.comparisons.metric == m)]
            if len(c):
                L += [f"**{m}** (margin ±{tp.margins[m]:g})", "", T.comparison_table(c), ""]
    L += ["## Factorial view: placement × estimator (final gold)", "", f"Crossed set: {tr.crossed}.", ""]
    L += [T.factorial_table(tr.factorial), ""] if len(tr.factorial) else []
    L += ["## Secondary outcomes: response length and empty responses", "", *T.secondary_lines(tr.secondary, p), ""]
    L += ["## Gradient diagnostics: each arm's KL gradient against the true one", "", *diagnostic_lines(tr, p), ""]
    ag = tr.agreement
    L += [
        "## Stability (split-half)",
        "",
        f"Instances {', '.join(map(str, tr.halves[0]))} vs {', '.join(map(str, tr.halves[1]))}, every question "
        f"answered on each half with the same protocol: {int(ag.agree.sum())} of {len(ag)} verdicts agree between "
        f"the halves, {int(ag.conflict.sum())} conflict (definite and different). An answer whose halves "
        "contradict each other or the full data is reported as *unsettled*.",
        "",
        T.stability_table(tr.answers),
        "",
        "## Figures",
        "",
    ]
    for title, name in images.items():
        L += [f"### {title}", "", f"![{title}]({name})", ""]
    L += T.methods(tr, p)
    return "\n".join(L) + "\n"


def render_index(res: Results) -> str:
    """reports/report.md: one headline per task, with links to the task reports."""
    L = ["# Does it matter where the KL penalty goes? PPO-based RLHF and RLVR ablations", ""]
    for task, tr in res.tasks.items():
        L += [f"## [{task}]({task}/report.md)", "", *answer_paragraph(tr, res.protocol), ""]
    L += ["**Protocol lock.** " + " ".join(res.lock.sentences() if res.lock else ["not checked."]), ""]
    return "\n".join(L)


# ---------------------------------------------------------------- stats.json


def _clean(x):
    """JSON-safe copy: numpy scalars to Python, NaN/inf to None."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float | np.floating):
        return float(x) if np.isfinite(x) else None
    if isinstance(x, np.integer | np.bool_):
        return x.item()
    return x


def task_stats(tr: TaskResults, res: Results) -> dict:
    """stats.json of a task (DVC metrics): headline, scope, the answers, positive controls, collapse and hit rates,
    split-half agreement, and every comparison's difference."""
    c, f = tr.comparisons, tr.families
    lvl = lambda r: "" if r.level is None or pd.isna(r.level) else f"@{r.level:g}"
    return _clean(
        {
            "headline": tr.headline,
            "n_instances": int(tr.runs.instance.nunique()),
            "n_runs": len(tr.runs),
            "answers": {
                f"{r.question}/{r.metric}": {"reported": r.reported, "full": r.answer, "split_half": r.status}
                for r in tr.answers.itertuples()
            },
            "positive_controls": {r.family: bool(r.pc_pass) for r in f.itertuples()},
            "collapse_rate": {f"{r.arm}/{r.kind}{lvl(r)}": r.rate for r in tr.collapse.itertuples()},
            "hit_rate": {f"{r.arm}@{r.target:g}": r.rate for r in tr.steering.itertuples()},
            "split_half": {
                "agree": int(tr.agreement.agree.sum()),
                "conflict": int(tr.agreement.conflict.sum()),
                "verdicts": len(tr.agreement),
            },
            "diff": {f"{r.family}/{r.label}": r.diff for r in c.itertuples()},
            "gradient_diagnostics": diagnostic_stats(tr),
        }
    )


def diagnostic_stats(tr: TaskResults) -> dict:
    """The gradient-diagnostic table's numbers: coverage, and per "<arm>/<regime>" its updates, instances, runs and
    each metric's mean, sd, CI and n ({} rows when the task has no diagnostics)."""
    t = tr.diagnostic_table
    rows = {
        f"{r['arm']}/{r['regime']}": {
            "updates": r["updates"], "instances": r["instances"], "runs": r["runs"],
            **{m: {k: r[f"{m}_{k}"] for k in ("mean", "sd", "lo", "hi", "n")} for m in METRICS},
        }
        for r in t.to_dict("records")
    }  # fmt: skip
    cov = {k: v for k, v in tr.diagnostic_coverage.items() if k != "cells"}
    return {"runs_with": 0, **cov, "rows": rows}


def index_stats(res: Results) -> dict:
    """The top-level stats.json: each task's headline and answers."""
    return _clean(
        {
            t: {"headline": tr.headline, **{f"{r.question}/{r.metric}": r.reported for r in tr.answers.itertuples()}}
            for t, tr in res.tasks.items()
        }
        | {"protocol_lock": res.lock.sentences() if res.lock else None}
    )
