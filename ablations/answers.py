"""One answer per question, their stability across two halves of the instances, and the task's headline.

Answers (per question and metric):
  matters       Q1: some arm is shown NOT to restrain KL in a family whose positive control passes (the reference
                arm restrains there). Q2-Q4: some comparison shows a Holm-significant difference not shown to lie
                within the margin; Q3 also: some arm is not steerable to a target the reference arm is steered to.
  insensitive   nothing matters, but some family's positive control (no KL vs the reference arm) was not detected:
                that family cannot support "equivalent".
  equivalent    every family's positive control passes and every comparison is equivalent (TOST, Holm) or a real
                difference within the margin (Q1: every arm restrains; Q3: every arm steerable).
  inconclusive  otherwise.
  not run       the design has no runs for the question.

Stability: the instances are split into two halves (stats.halves) and every question is answered on each half with
the same protocol. A comparison's half verdicts agree when equal; they conflict when both are definite and differ
(a difference of the other sign, or a difference against an equivalence). An answer is "unsettled" -- reported
instead of a verdict -- when the halves give contradicting definite answers (matters vs equivalent), when a half
contradicts the full-data answer, or when a comparison that carries a "matters" (on the full data or on a half) has
conflicting halves. For this check a difference within the margin counts as equivalent.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ablations import stats as S
from ablations.config import AnalysisParams
from ablations.questions import answer_questions

MATTERS, INSENSITIVE, EQUIV, INCONC, NOT_RUN, UNSETTLED = (
    "matters",
    "insensitive",
    "equivalent",
    "inconclusive",
    "not run",
    "unsettled",
)
QUESTIONS = {
    "Q1": "Restraint: does the variant keep the policy near the reference at all?",
    "Q2": "Matched coefficient: what moving the same β between placements does",
    "Q3": "Matched KL, by construction: gold when every arm is steered to the same KL",
    "Q4": "Tuned: each arm at its best coefficient (cross-fitted)",
}


def question_keys(proto: AnalysisParams, task: str) -> list[tuple[str, str]]:
    """(question, metric) pairs answered for ``task``: Q1 on KL, Q2-Q4 on every metric with a margin."""
    return [("Q1", "kl")] + [(q, m) for m in proto.tasks[task].margins for q in ("Q2", "Q3", "Q4")]


def _unsteerable(steering: pd.DataFrame, reference: str) -> pd.DataFrame:
    """Matched cells whose arm is not steerable at a target the reference arm is steered to."""
    if steering.empty:
        return steering
    ok_ref = set(steering[(steering.arm == reference) & steering.steerable].target)
    return steering[~steering.steerable & steering.target.isin(ok_ref) & (steering.arm != reference)]


def answer(q: str, metric: str, res: dict, proto: AnalysisParams) -> dict:
    """The answer to one question on one metric from answer_questions() output, with the rows that carry it."""
    fams = res["families"]
    fams = fams[(fams.question == q) & (fams.metric == metric)] if len(fams) else fams
    if fams.empty:
        return dict(question=q, metric=metric, answer=NOT_RUN, families=0, insensitive=0, carriers=[])
    insensitive = int((~fams.pc_pass.astype(bool)).sum())
    if q == "Q1":
        rows = res["restraint"]
        sensitive = set(fams.family[fams.pc_pass.astype(bool)])
        bad = rows[(rows.verdict == S.NO_RESTRAINT) & rows.family.isin(sensitive)]
        carriers = [("Q1", r.family, r.arm) for r in bad.itertuples()]
        all_ok = (rows.verdict == S.RESTRAINS).all()
    else:
        c = res["comparisons"]
        c = c[(c.question == q) & (c.metric == metric) & c.in_family.astype(bool)]
        mat = c[c.material.astype(bool)]
        carriers = [(q, r.family, r.label) for r in mat.itertuples()]
        all_ok = ((c.verdict == S.EQUIVALENT) | c.within_margin.astype(bool)).all()
        if q == "Q3":
            uns = _unsteerable(res["steering"], proto.reference_arm)
            carriers += [("Q3", f"steer {r.target:g}", r.arm) for r in uns.itertuples()]
            all_ok = all_ok and bool(res["steering"].steerable.all())
    if carriers:
        a = MATTERS
    elif insensitive:
        a = INSENSITIVE
    elif all_ok:
        a = EQUIV
    else:
        a = INCONC
    return dict(question=q, metric=metric, answer=a, families=len(fams), insensitive=insensitive, carriers=carriers)


def answers(res: dict, proto: AnalysisParams, task: str) -> pd.DataFrame:
    """One row per (question, metric): the answer and what carries it."""
    return pd.DataFrame([answer(q, m, res, proto) for q, m in question_keys(proto, task)])


# ---------------------------------------------------------------- stability


def _signed(r) -> str:
    """A comparison's verdict for the stability check: a difference beyond what the margin allows with its sign
    ("difference+" / "difference-"); a difference within the margin counts as equivalent (both say |Δ| < margin)."""
    if r.verdict == S.DIFFERENCE and r.within_margin:
        return S.EQUIVALENT
    if r.verdict == S.DIFFERENCE and np.isfinite(r.diff):
        return S.DIFFERENCE + ("+" if r.diff > 0 else "-")
    return r.verdict


def _verdicts(res: dict) -> pd.Series:
    """(question, metric, family, item) -> signed verdict, for every in-family comparison and Q1 row."""
    out = {}
    for r in res["restraint"].itertuples():
        out[("Q1", "kl", r.family, r.arm)] = r.verdict
    c = res["comparisons"]
    for r in c[c.in_family.astype(bool)].itertuples() if len(c) else []:
        out[(r.question, r.metric, r.family, r.label)] = _signed(r)
    return pd.Series(out, dtype=object)


def _definite(v: str) -> bool:
    return v.startswith(S.DIFFERENCE) or v in (S.EQUIVALENT, S.RESTRAINS, S.NO_RESTRAINT)


def _contradict(a: str, b: str) -> bool:
    return {a, b} == {MATTERS, EQUIV}


def split_half(runs: pd.DataFrame, task: str, proto: AnalysisParams, full: dict, full_answers: pd.DataFrame):
    """Answers every question on each half of the instances. Returns (per-comparison table with the full and half
    verdicts, ``agree`` and ``conflict``; per-question table with the half answers and the stability status;
    the two halves)."""
    halves = S.halves(runs.instance.unique())
    res = [answer_questions(runs[runs.instance.isin(h)], task, proto, permutation=False) for h in halves]
    v = pd.concat([_verdicts(full), _verdicts(res[0]), _verdicts(res[1])], axis=1, keys=["full", "half_a", "half_b"])
    v = v.fillna(S.INCONCLUSIVE)
    v["agree"] = v.half_a == v.half_b
    v["conflict"] = [_definite(a) and _definite(b) and a != b for a, b in zip(v.half_a, v.half_b)]
    v.index.names = ["question", "metric", "family", "item"]
    v = v.reset_index()
    rows = []
    for r in full_answers.itertuples():
        half = [answer(r.question, r.metric, x, proto) for x in res]
        ha, hb = (h["answer"] for h in half)
        carried = {(c[1], c[2]) for c in [*r.carriers, *half[0]["carriers"], *half[1]["carriers"]]}
        shaky = v[v.conflict & np.array([(f, i) in carried for f, i in zip(v.family, v.item)], dtype=bool)]
        if _contradict(ha, hb) or _contradict(r.answer, ha) or _contradict(r.answer, hb) or len(shaky):
            status = UNSETTLED
        elif ha == hb == r.answer:
            status = "stable"
        elif r.answer in (ha, hb):
            status = "partly replicated"
        else:
            status = "not replicated in the halves"
        rows.append(dict(question=r.question, metric=r.metric, full=r.answer, half_a=ha, half_b=hb, status=status))
    return v, pd.DataFrame(rows), halves


def final_answers(full_answers: pd.DataFrame, stability: pd.DataFrame) -> pd.DataFrame:
    """The reported answers: the full-data answer, replaced by "unsettled" where the halves contradict."""
    out = full_answers.merge(stability[["question", "metric", "status"]], on=["question", "metric"], how="left")
    out["reported"] = np.where(out.status == UNSETTLED, UNSETTLED, out.answer)
    return out


def headline(reported: pd.DataFrame) -> str:
    """ "does not matter" only when every question says equivalent on every metric (so every positive control
    passed and no answer is unsettled); "matters" when any says matters; else "not settled"."""
    if len(reported) and (reported.reported == EQUIV).all():
        return "does not matter"
    if (reported.reported == MATTERS).any():
        return "matters"
    return "not settled"
