"""The words of the analysis: the headline and the primary questions with their numbers and scope, report.md and
answer.md (the README's answer block) per task, and stats.json. Formats results computed elsewhere
(ablations/primary.py, questions.py, descriptive.py); imports only the result containers, never
ablations.analysis. Tables are in ablations/tables.py."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ablations import tables as T
from ablations.config import AnalysisParams
from ablations.diagnostics import METRICS
from ablations.results import Results, TaskResults

_f, _ci = T.fmt, T.ci


HEADLINE_WORDS = {
    "matters": "where the KL penalty goes matters: a placement comparison shows a difference beyond its margin",
    "does not matter": "where the KL penalty goes does not matter within the calibrated margins: every placement "
    "comparison is equivalent, each with its margin-sized control detected and the penalty shown to act",
    "not settled": "these runs do not settle whether it matters (no placement comparison shows a material "
    "difference, and not every one is shown equivalent)",
}
PRECEDENCE = (
    "Outcomes, in order of precedence: *material difference* (the (1 − a_j) CI of the median difference lies beyond "
    "the margin) > *equivalent* (the (1 − 2a_j) CI inside the margin, the margin-sized control detected and the "
    "penalty shown to act, at the same level; *a non-zero difference inside the margin* when the (1 − a_j) CI also "
    "excludes 0) > *non-zero, materiality undetermined* (the (1 − a_j) CI excludes 0, not the margin) > "
    "*inconclusive*. An equivalence whose control is not detected reads *insensitive*; one where removing the "
    "penalty is not shown to change the metric beyond its margin reads *inert* (placement is not testable there); "
    "a frontier comparison where an arm hits its KL level in fewer than the minimum share of runs reads *not "
    "steerable* (not compared). *settled*: material or equivalent at a look; *open*: neither, below its planned cap "
    "(`make settle` adds the next batch to it); *unsettled at cap*: neither, at its cap; *closed: not steerable by its "
    "cap* (amendment 1): not steerable, and an arm has missed its level in so many runs that no look up to the cap "
    "can be steerable, so its cells stop (the frozen rule read *open*; the verdict is the same)."
)
KIND_WORDS = {
    "placement": "placement",
    "penalty": "the penalty itself (not placement)",
    "practice": "practice: estimator and β change with the placement",
}


def where(r: dict) -> str:
    """Where a primary comparison is asked, in words: its KL level, or the β its role fixes."""
    if r["level"] is not None:
        return f"KL level {r['level']:.3g} nats"
    return {"act": "β where the penalty acts", "tuned": "each at its own best β"}.get(r["role"], r["role"])


def _check(value, words=("shown", "NOT shown", "–")) -> str:
    return {True: words[0], False: words[1], None: words[2]}[value]


def primary_sentence(r: dict) -> str:
    """One primary comparison's result with its numbers."""
    lvl = f"{1 - r['a_j']:.4%}" if r.get("a_j") else "–"
    head = f"**{r['comparison']}** ({r['contrast']}, {r['metric']}, {where(r)}; {KIND_WORDS[r['kind']]}) — {r['label']}"
    if r["n"] == 0:
        return f"{head}: no complete batch of evaluation instances yet ({r['n_available']} available)."
    return (
        f"{head} ({r['status']} at n = {r['n']} of its cap {r['cap']}): median Δ {_f(r['estimate'], sign=True)}, "
        f"exact {lvl} CI {_ci(r['lo'], r['hi'])}, margin ±{r['margin']:.3g}; sign-test p {T.pval(r['p_sign'])} "
        f"(mean Δ {_f(r['mean'], sign=True)}; paired t beside it, never deciding: p {T.pval(r['t_p'])}, CI "
        f"{_ci(r['t_lo'], r['t_hi'])}{_rliable(r)}); margin-sized control "
        f"{_check(r['control_detected'], ('detected', 'NOT detected', '–'))}; penalty acts {_check(r['acts'])}."
    )


def _rliable(r: dict) -> str:
    """rliable's interval estimates beside the exact result (ablations/primary.py beside_rliable), never deciding."""
    if "p_improve" not in r:
        return ""
    better = r["contrast"].replace(" − ", " > ")
    return (
        f"; rliable: bootstrap 95% CI of mean Δ {_ci(r['boot_mean_lo'], r['boot_mean_hi'])}, IQM Δ "
        f"{_f(r['boot_iqm'], sign=True)} {_ci(r['boot_iqm_lo'], r['boot_iqm_hi'])}, P({better}) "
        f"{_f(r['p_improve'])} {_ci(r['p_improve_lo'], r['p_improve_hi'], sign=False)}"
    )


def answer_paragraph(tr: TaskResults, proto) -> list[str]:
    """The headline, what carries it, and one line per primary comparison."""
    carried = f" Carried by: {', '.join(tr.carried_by)}." if tr.carried_by else ""
    L = [f"**Answer ({tr.headline}).** On {tr.scope}: {HEADLINE_WORDS[tr.headline]}.{carried}", ""]
    L += [f"- {primary_sentence(r)}" for r in tr.primary]
    return L


def _steer(r: dict) -> str:
    if r["hit_rate_arm"] is None:
        return "–"
    return f"{r['hit_rate_arm']:.0%} / {r['hit_rate_other']:.0%}"


def primary_table(tr: TaskResults) -> str:
    """One row per primary comparison: what it isolates, where, margin, verdict (label), n of its cap, the median
    and its CIs at the decided look, p, the controls, steerability; every number at that one n."""
    rows = []
    for r in tr.primary:
        rows.append({
            "comparison": r["comparison"], "isolates": r["kind"], "contrast": r["contrast"], "metric": r["metric"],
            "where": where(r), "margin": f"±{r['margin']:.3g}", "verdict": r["label"], "status": r["status"],
            "n (cap)": f"{r['n']} ({r['cap']})", "level a_j": T.g3(r["a_j"]) if r.get("a_j") else "–",
            "median Δ": _f(r["estimate"], sign=True), "CI (1−a_j)": _ci(r["lo"], r["hi"]),
            "CI (1−2a_j)": _ci(r["lo90"], r["hi90"]), "sign p": T.pval(r["p_sign"]),
            "control": _check(r["control_detected"], ("detected", "not detected", "–")),
            "penalty acts": _check(r["acts"], ("yes", "not shown", "–")),
            "no-KL contrast (median)": _f(r["acts_effect"], sign=True) if r["acts_direction"] else "–",
            "hit rate arm / other": _steer(r),
        })  # fmt: skip
    return T.md(rows)


def budget_lines(tr: TaskResults) -> list[str]:
    """The error budget: alpha split over the comparisons and spent over each one's reachable looks."""
    b = tr.budget
    return [
        f"Family-wise error of every primary claim of this task ≤ α = {b['alpha']:g}: each of the {b['comparisons']} "
        f"comparisons (a frontier question is one per KL level) gets α/{b['comparisons']} = "
        f"{T.g3(b['per_comparison'])} (Bonferroni), spent equally over the looks where its exact test can reach a "
        "decision (none is spent on a look that cannot decide), by a union bound valid for any dependence between "
        "looks and any stopping. The test is the exact sign test of the MEDIAN per-instance difference with "
        "order-statistic CIs: distribution-free (no symmetry assumed), so the bound holds for the skewed "
        "differences the tasks produce (tests/ablations/test_simulate.py resamples each v3 question's own "
        "residuals). The estimand is the median difference; the mean is shown beside it, never deciding. Caps come "
        "from the sample-size plan (below).",
        "",
        PRECEDENCE,
    ]


def plan_lines(tr: TaskResults, proto: AnalysisParams) -> list[str]:
    """The sample-size plan: per comparison its planning noise, cap and power at the cap."""
    pl = tr.protocol.get("plan") or {}
    fr = tr.protocol.get("plan_frozen", {})
    if not pl:
        return []
    rule = pl["rule"]
    rows = [
        {"comparison": k, "median Δ (plan)": _f(v["median"], sign=True), "SD / margin": _f(v["sd_margins"]),
         "skewness": _f(v["skewness"], sign=True), "cap": v["cap"], "power ±2 margins": f"{_f(v['power_neg'])} / "
         f"{_f(v['power_pos'])}", "reaches 80%": "yes" if v["reached"] else "NO (capped)",
         "P(equivalent) at Δ 0": _f(v["power_equivalent"])}
        for k, v in pl["comparisons"].items()
    ]  # fmt: skip
    return [
        f"**Sample-size plan** (`{fr.get('path', '?')}` sha256 `{fr.get('sha256', '?')[:16]}`, committed at "
        f"{fr.get('commit') or 'not committed yet'}): on planning instances "
        f"{', '.join(map(str, pl['plan_instances']))} (never evaluated), each comparison's per-instance rows "
        f"(difference, control, no-KL contrast) resampled as whole instances, skew kept, through the whole rule "
        f"({rule['simulations']} trials): its cap is the fewest instances (batches of {rule['batch_size']}, at most "
        f"{rule['max_cap']}) with power ≥ {rule['power']:g} to settle a {rule['effect_margins']:g}-margin "
        "difference of either sign.",
        "",
        T.md(rows),
        *check_lines(pl.get("checks") or {}, proto.checks),
    ]


def check_lines(checks: dict, specs: dict) -> list[str]:
    """The contract's sanity checks (``analysis.checks``) on the planning instances: descriptive, no error budget."""
    if not checks:
        return []
    rows = [
        {"check": k, "comparison": f"{specs[k].arm} − {specs[k].other}" if k in specs else "?",
         "metric": specs[k].metric if k in specs else "?", "n": v["n"], "median Δ": _f(v["median"], sign=True),
         f"exact CI ({v['level']:.0%})": f"[{_f(v['lo'], sign=True)}, {_f(v['hi'], sign=True)}]",
         "sign p": _f(v["p_sign"]), "margin": f"±{_f(v['margin'])}", "CI": v["ci"]}
        for k, v in checks.items()
    ]  # fmt: skip
    return [
        "",
        "**Contract checks** (`analysis.checks`, on the planning instances; descriptive: no error budget, not part "
        "of the headline). `k1_in_loss`: k1 in the loss has zero expected gradient (rlhf/kl.py CONTRACT), so it "
        "should restrain the policy no more than no penalty does; its log final KL minus k1-in-the-reward's is "
        "expected above zero.",
        "",
        T.md(rows),
    ]


def protocol_lines(tr: TaskResults) -> list[str]:
    """The frozen protocol: file, hash, commit, and what calibration fixed."""
    p, fr = tr.protocol, tr.protocol.get("frozen", {})
    commit = fr.get("commit") or "not committed yet"
    tuned = ", ".join(f"{a} β {c:g}" for a, c in p["tuned"].items())
    nk = p["no_kl"]
    acts = "" if p.get("acts_on_calibration", True) else " (NO calibration β acts: every equivalence there is inert)"
    ctrl = "interpolated" if p.get("control_interpolated") else "the nearest calibration β, not interpolated"
    return [
        f"**Protocol v4 (frozen).** `{fr.get('path', '?')}` sha256 `{fr.get('sha256', '?')[:16]}`, committed at "
        f"{commit}. Fixed by the `{tr.task}_calibrate` stage on calibration instances "
        f"{', '.join(map(str, p['calibration_instances']))} only (never on an evaluation instance): no-KL gain "
        f"{_f(nk['gain'])} ({p['rules']['gain']} gold {_f(nk[p['rules']['gain'] + '_gold'])} − SFT "
        f"{_f(nk['sft_gold'])}) → gold margin ±{p['margins']['gold']:.3g} ({p['rules']['margin_fraction']:g} of it); "
        f"β where the penalty acts (no-KL contrast ≥ {p['rules']['acts']:g} margins, best gold among those) "
        f"{p['coef']:g}{acts}; log-KL margin ±{p['margins']['log_kl']:.3g}; frontier KL levels "
        f"{', '.join(f'{x:.3g}' for x in p['levels'])} nats; tuned: {tuned}; margin-sized control: reference arm "
        f"at β {p['coef']:g} vs {p['control_coef']:.3g} ({ctrl}; calibrated Δ gold "
        f"{_f(p['control_effect']['gold'], sign=True)}).",
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
        "## Primary comparisons (confirmatory: the placement ones alone carry the answer)",
        "",
        primary_table(tr),
        "",
        *budget_lines(tr),
        "",
        *plan_lines(tr, p),
        "",
        "## Exploratory families (not confirmatory: Holm within each family only)",
        "",
        "Every other comparison the evaluation runs allow. No claim of the answer above rests on them. Positive "
        "controls and exact-test floors per family (the no-KL control must pass at α/m):",
        "",
        T.families_table(tr.families, p.alpha),
        "",
        "### E1 Restraint",
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
    for q, title in (("Q2", "E2 Matched coefficient"), ("Q3", "E3 Matched KL, by construction")):
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
    if tr.carried_by:
        L += [f"Carried by: {', '.join(tr.carried_by)}.", ""]
    L += [f"Scope: {tr.scope}.", "", primary_table(tr), ""]
    L += [
        f"Protocol v4, calibrated on instances {', '.join(map(str, p['calibration_instances']))}: gold margin "
        f"±{p['margins']['gold']:.3g}, log-KL margin ±{p['margins']['log_kl']:.3g}, β where the penalty acts "
        f"{p['coef']:g}, KL levels {', '.join(f'{x:.3g}' for x in p['levels'])} nats; α {tr.budget['alpha']:g} over "
        f"{tr.budget['comparisons']} comparisons, sign test of the median. {PRECEDENCE} Full report: "
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
