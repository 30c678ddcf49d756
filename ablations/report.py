"""The words of the analysis: the headline and the primary questions with their numbers and scope, report.md and
answer.md (the README's answer block) per task, and stats.json. Formats results computed elsewhere
(ablations/primary.py, questions.py, descriptive.py); imports only the result containers, never
ablations.analysis. Tables are in ablations/tables.py."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ablations import tables as T
from ablations.diagnostics import METRICS
from ablations.results import Results, TaskResults

_f, _ci = T.fmt, T.ci


HEADLINE_WORDS = {
    "matters": "where the KL penalty goes matters: a primary question shows a difference beyond its margin",
    "does not matter": "where the KL penalty goes does not matter within the calibrated margins: every primary "
    "question is equivalent, each with its margin-sized control detected",
    "not settled": "these runs do not settle whether it matters (no primary question shows a material difference, "
    "and not every one is shown equivalent)",
}


def _where(r: dict) -> str:
    return f"{r['levels']}"


def primary_sentence(r: dict) -> str:
    """One primary question's result with its numbers."""
    lvl = f"{1 - r['a_j']:.4%}" if r.get("a_j") else "–"
    ctrl = {True: "detected", False: "NOT detected", None: "–"}[r["control_detected"]]
    head = f"**{r['question']} ({r['comparison']}, {r['metric']}, {_where(r)}) — {r['verdict']}**"
    if r["n"] == 0:
        return f"{head}: no complete batch of evaluation instances yet ({r['n_available']} available)."
    return (
        f"{head} ({r['status']} at n = {r['n']}): Δ {_f(r['estimate'], sign=True)}, exact {lvl} CI "
        f"{_ci(r['lo'], r['hi'])}, margin ±{r['margin']:.3g}; exact sign-flip p {T.pval(r['p_exact'])} "
        f"(paired t beside it: p {T.pval(r['t_p'])}, CI {_ci(r['t_lo'], r['t_hi'])}{_rliable(r)}); margin-sized "
        f"control {ctrl} (Δ {_f(r['control_effect'], sign=True)}, calibrated {_f(r['control_calibrated'], sign=True)})."
    )


def _rliable(r: dict) -> str:
    """rliable's interval estimates beside the exact result (ablations/primary.py beside_rliable), never deciding."""
    if "p_improve" not in r:
        return ""
    better = r["comparison"].replace(" − ", " > ")
    return (
        f"; rliable: bootstrap 95% CI of mean Δ {_ci(r['boot_mean_lo'], r['boot_mean_hi'])}, IQM Δ "
        f"{_f(r['boot_iqm'], sign=True)} {_ci(r['boot_iqm_lo'], r['boot_iqm_hi'])}, P({better}) "
        f"{_f(r['p_improve'])} {_ci(r['p_improve_lo'], r['p_improve_hi'], sign=False)}"
    )


def answer_paragraph(tr: TaskResults, proto) -> list[str]:
    """The headline and one line per primary question."""
    L = [f"**Answer ({tr.headline}).** On {tr.scope}: {HEADLINE_WORDS[tr.headline]}.", ""]
    L += [f"- {primary_sentence(r)}" for r in tr.primary]
    return L


def _as_calibrated(ok: bool) -> str:
    return "direction as calibrated" if ok else "direction NOT as calibrated"


def primary_table(tr: TaskResults) -> str:
    """One row per primary question: comparison, where, margin, verdict, n, estimate, CIs, p, controls."""
    rows = []
    for r in tr.primary:
        rows.append({
            "question": r["question"], "comparison": r["comparison"], "metric": r["metric"], "cells": r["levels"],
            "margin": f"±{r['margin']:.3g}", "verdict": r["verdict"], "status": r["status"],
            "n": f"{r['n']} of {r['n_available']}", "level a_j": T.g3(r["a_j"]) if r.get("a_j") else "–",
            "Δ": _f(r["estimate"], sign=True), "exact CI (1−a_j)": _ci(r["lo"], r["hi"]),
            "exact CI (1−2a_j)": _ci(r["lo90"], r["hi90"]), "exact p": T.pval(r["p_exact"]),
            "t p [CI]": f"{T.pval(r['t_p'])} {_ci(r['t_lo'], r['t_hi'])}",
            "margin control": {True: "detected", False: "not detected", None: "–"}[r["control_detected"]],
            "no-KL control": f"{_f(r['no_kl_effect'], sign=True)} ({_as_calibrated(r['no_kl_direction_ok'])})",
        })  # fmt: skip
    return T.md(rows)


def budget_lines(tr: TaskResults) -> list[str]:
    """The error budget of the headline: alpha split over the questions and spent over the looks."""
    b = tr.budget
    looks = ", ".join(
        f"n = {n}: {T.g3(a)}{'' if ok else ' (no difference can be shown there: 2/2^n > a_j)'}"
        for n, a, ok in zip(b["looks"], b["levels"], b["reachable"])
    )
    return [
        f"Family-wise error of the whole headline ≤ α = {b['alpha']:g}: each of the {b['questions']} primary questions "
        f"gets α/{b['questions']} = {T.g3(b['per_question'])} (Bonferroni), spent over its looks by a union bound "
        f"(valid for any dependence between looks and any stopping): {looks}. Within a question at most one of its "
        "two nulls (no difference; a difference of at least the margin) is true, so its difference and equivalence "
        "tests share that level. A question is *settled* at the first look with a material difference (the "
        "(1 − a_j) CI entirely beyond the margin) or an equivalence (the (1 − 2a_j) CI inside the margin, with the "
        "margin-sized control detected at the same level); *difference* means the (1 − a_j) CI excludes 0 but not "
        "the margin; *insensitive* an equivalence whose control was not detected; otherwise *inconclusive*. "
        "*open*: not settled and below the cap (`make settle` adds the next batch).",
    ]


def protocol_lines(tr: TaskResults) -> list[str]:
    """The frozen protocol: file, hash, commit, and what calibration fixed."""
    p, fr = tr.protocol, tr.protocol.get("frozen", {})
    commit = fr.get("commit") or "not committed yet"
    tuned = ", ".join(f"{a} β {c:g}" for a, c in p["tuned"].items())
    nk = p["no_kl"]
    return [
        f"**Protocol (frozen).** `{fr.get('path', '?')}` sha256 `{fr.get('sha256', '?')[:16]}`, committed at "
        f"{commit}. Fixed by the `{tr.task}_calibrate` stage on calibration instances "
        f"{', '.join(map(str, p['calibration_instances']))} only (never on an evaluation instance): no-KL gain "
        f"{_f(nk['gain'])} ({p['rules']['gain']} gold {_f(nk[p['rules']['gain'] + '_gold'])} − SFT "
        f"{_f(nk['sft_gold'])}) → margin ±{p['margins']['gold']:.3g} ({p['rules']['margin_fraction']:g} of it); "
        f"KL target {p['kl_target']:.3g} nats; β (reference arm's best) {p['coef']:g}; tuned: {tuned}; "
        f"margin-sized control: reference arm at β {p['coef']:g} vs {p['control_coef']:g} "
        f"(calibrated Δ gold {_f(p['control_effect']['gold'], sign=True)}).",
    ]


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


def amendment_lines(tr: TaskResults) -> list[str]:
    """Every amendment with the primary verdicts before it and now (ablations/lock.py keeps the earlier report)."""
    if not tr.amendments:
        return []
    rows = [{"amendment": a["commit"][:10], "changed": a["keys"], "question": a["question"], "before": a["before"],
             "now": a["now"]} for a in tr.amendments]  # fmt: skip
    head = "**Amendments** (protocol changes after evaluation results existed; both verdicts shown):"
    return [head, "", T.md(rows), ""]


def render_task(tr: TaskResults, res: Results, images: dict[str, str]) -> str:
    """A task's report.md: the answer, scope, protocol and lock, the primary questions with the error budget, then
    the exploratory families, descriptive tables, figures and methods."""
    p = res.judged.get(tr.task, res.protocol)
    tp = p.tasks[tr.task]
    L = [f"# Does it matter where the KL penalty goes? Task `{tr.task}`", ""]
    L += answer_paragraph(tr, p)
    L += [
        "",
        f"> **Scope.** Every claim here is about {tr.scope}, and about this protocol. Synthetic task, tiny models: not "
        "evidence about large language models until reproduced on one.",
        "",
        *protocol_lines(tr),
        "",
        "**Protocol lock.** " + " ".join(res.lock.sentences() if res.lock else ["not checked (no git information)."]),
        "",
        *amendment_lines(tr),
        "## Primary questions (confirmatory: these alone carry the answer)",
        "",
        primary_table(tr),
        "",
        *budget_lines(tr),
        "",
        "## Exploratory families (not confirmatory: Holm within each family only)",
        "",
        "Every other comparison the evaluation runs allow. No claim of the answer above rests on them. Positive "
        "controls and exact-test floors per family (the no-KL control must pass at α/m):",
        "",
        T.families_table(tr.families, p.alpha),
        "",
        "### Q1 Restraint",
        "",
        f"Per instance, log(final exact KL / no-KL final exact KL); *restrains* when the mean is shown below "
        f"−{tp.margins['log_kl']:.3g} (the arm at least {1 - math.exp(-tp.margins['log_kl']):.0%} below no "
        f"KL), *does not restrain* when shown above it (one-sided t-tests at α = {p.alpha:g}, Holm within each "
        "coefficient).",
        "",
        T.restraint_table(tr.restraint),
        "",
        f"Collapse: final gold more than {tp.collapse_drop:.3g} (the gold margin) below the run's own SFT gold (per "
        "run; exact Clopper–Pearson 95% CI; runs of one instance are not independent when it has several seeds).",
        "",
        T.collapse_table(tr.collapse, tr.cells),
        "",
    ]
    for q, title in (("Q2", "Q2 Matched coefficient"), ("Q3", "Q3 Matched KL, by construction")):
        L += [f"### {title}", ""]
        if q == "Q3":
            L += [
                f"Hit: final exact KL within ±{tp.kl_tolerance:.0%} of the target. A miss is a failure, counted "
                f"here and kept in the comparisons below with its final values (intention to treat); an arm that "
                f"hits in fewer than {p.min_hit_rate:.0%} of its runs is *not steerable* at that target.",
                "",
                T.steering_table(tr.steering),
                "",
            ]
        comps = tr.comparisons
        for m in tp.metrics:
            c = comps[(comps.question == q) & (comps.metric == m)] if len(comps) else comps
            if len(c):
                L += [f"**{m}** (margin ±{tp.margins[m]:.3g})", "", T.comparison_table(c), ""]
    L += ["### Factorial view: placement × estimator (final gold)", "", f"Crossed set: {tr.crossed}.", ""]
    L += [T.factorial_table(tr.factorial), ""] if len(tr.factorial) else []
    L += ["### Secondary outcomes: response length and empty responses", "", *T.secondary_lines(tr.secondary, p), ""]
    L += ["### Gradient diagnostics: each arm's KL gradient against the true one", "", *diagnostic_lines(tr, p), ""]
    L += ["## Figures", ""]
    for title, name in images.items():
        L += [f"### {title}", "", f"![{title}]({name})", ""]
    L += T.methods(tr, p)
    return "\n".join(L) + "\n"


def answer_block(tr: TaskResults, proto) -> str:
    """reports/<task>/answer.md: the task's part of the README's answer (pipelines/readme.py splices it in)."""
    p = tr.protocol
    L = [f"#### Task `{tr.task}`: {tr.headline}", "", f"{HEADLINE_WORDS[tr.headline].capitalize()}.", ""]
    L += [f"Scope: {tr.scope}.", "", primary_table(tr), ""]
    L += [
        f"Calibrated on instances {', '.join(map(str, p['calibration_instances']))}: margin "
        f"±{p['margins']['gold']:.3g} gold, KL target {p['kl_target']:.3g} nats, β {p['coef']:g}; α "
        f"{tr.budget['alpha']:g} over {tr.budget['questions']} primary questions. Full report: "
        f"[reports/{tr.task}/report.md](reports/{tr.task}/report.md).",
        "",
    ]
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
    """stats.json of a task (DVC metrics): headline, scope, the primary questions (with their paths), the error
    budget, the protocol's record, exploratory positive controls, collapse and hit rates, every exploratory
    difference."""
    c, f = tr.comparisons, tr.families
    lvl = lambda r: "" if r.level is None or pd.isna(r.level) else f"@{r.level:g}"
    return _clean(
        {
            "headline": tr.headline,
            "n_instances": int(tr.runs.instance.nunique()),
            "n_runs": len(tr.runs),
            "carried_by": tr.carried_by,
            "primary": {r["comparison"]: r for r in tr.primary},
            "budget": tr.budget,
            "protocol": tr.protocol.get("frozen", {}),
            "plan": tr.protocol.get("plan_frozen", {}),
            "amendments": tr.amendments,
            "positive_controls": {r.family: bool(r.pc_pass) for r in f.itertuples()},
            "collapse_rate": {f"{r.arm}/{r.kind}{lvl(r)}": r.rate for r in tr.collapse.itertuples()},
            "hit_rate": {f"{r.arm}@{r.target:g}": r.rate for r in tr.steering.itertuples()},
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
