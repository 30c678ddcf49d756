"""The README's answer is generated from the reports (pipelines/readme.py): the splice between the markers, the
block from reports/<task>/answer.md, ``--check``, and that no number in the answer section is one the reports do not
show. The last test runs on the repository's own README.md and reports/."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ablations.config import TASKS
from pipelines.readme import (
    BEGIN,
    CHECKED_SECTIONS,
    CONTRACT_BEGIN,
    CONTRACT_END,
    END,
    SUPERSEDED_DIR,
    VERSIONS_BEGIN,
    VERSIONS_END,
    answer_section,
    block,
    broken_links,
    main,
    numbers_not_in_reports,
    splice,
    versions_table,
)

ROOT = Path(__file__).resolve().parents[2]
README = f"# Title\n\nintro\n\n## The current answer\n\nbefore\n{BEGIN}\nold answer\n{END}\nafter\n\n## Next\n\ntail\n"
CONTRACT = f"\n## How it works\n\n{CONTRACT_BEGIN}\nold table\n{CONTRACT_END}\n"  # the other generated block


def test_splice_replaces_only_what_lies_between_the_markers():
    """Catches: the markers or the text around them lost, the old block kept, and a splice that is not idempotent
    (a newline added or lost on every run, so ``--check`` would never pass after a rewrite)."""
    out = splice(README, "new line 1\nnew line 2\n\n\n")
    assert out == README.replace("old answer", "new line 1\nnew line 2")
    assert splice(out, "new line 1\nnew line 2\n") == out
    assert splice(out, "") == README.replace("old answer\n", "")
    assert splice(splice(out, ""), "x") == README.replace("old answer", "x")


@pytest.mark.parametrize(
    "text, block_text, problem",
    [
        (README.replace(BEGIN, ""), "x", "exactly one begin marker"),
        (README.replace(END, ""), "x", "exactly one end marker"),
        (README + BEGIN + "\n", "x", r"exactly one begin marker .*found 2"),
        (README + END + "\n", "x", r"exactly one end marker .*found 2"),
        (README.replace(BEGIN, "@@").replace(END, BEGIN).replace("@@", END), "x", "before its begin marker"),
        (README, f"a\n{END}\nb", "block contains the end marker"),
    ],
    ids=["no-begin", "no-end", "two-begins", "two-ends", "out-of-order", "marker-in-block"],
)
def test_splice_names_a_broken_marker(text, block_text, problem):
    """Catches: a missing, duplicated or reversed marker (or a block that would plant one) silently splicing the
    wrong span or appending the answer somewhere, instead of a ValueError naming the problem."""
    with pytest.raises(ValueError, match=problem):
        splice(text, block_text)


@pytest.fixture
def reports(tmp_path):
    for task, text in [("grammar", "**grammar answer** 0.92\n\n"), ("arithmetic", "arithmetic answer\n")]:
        (tmp_path / "reports" / task).mkdir(parents=True)
        (tmp_path / "reports" / task / "answer.md").write_text(text)
    (tmp_path / "reports" / "nothing").mkdir()
    return tmp_path / "reports"


def test_block_concatenates_the_answers_in_task_order(reports):
    """Catches: tasks in file-system order instead of the given order, a task without answer.md failing instead of
    being skipped, answers run together without a blank line, a stray trailing blank line."""
    assert block(["grammar", "nothing", "arithmetic"], reports) == "**grammar answer** 0.92\n\narithmetic answer\n"
    assert block(["arithmetic", "grammar"], reports) == "arithmetic answer\n\n**grammar answer** 0.92\n"
    assert block(["nothing", "absent"], reports) == ""


def cli(readme, reports, *extra):
    return main(["--readme", str(readme), "--reports", str(reports), "--tasks", "grammar", "arithmetic", *extra])


def test_main_rewrites_atomically_and_check_compares(tmp_path, reports, capsys):
    """Catches: --check rewriting the file or passing on a stale block, a check that prints more than one line,
    the rewrite losing the file's mode or leaving its temporary file, and a rewrite that --check then rejects; the
    KL contract table is generated the same way (rlhf.kl.CONTRACT)."""
    from rlhf.kl import contract_markdown

    readme = tmp_path / "README.md"
    readme.write_text(README + CONTRACT)
    os.chmod(readme, 0o600)  # not what a new file gets
    assert cli(readme, reports, "--check") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python -m pipelines.readme" in err
    assert readme.read_text() == README + CONTRACT
    assert cli(readme, reports) == 0
    answered = splice(README, block(["grammar", "arithmetic"], reports))
    assert readme.read_text() == answered + CONTRACT.replace("old table", contract_markdown())
    assert "**grammar answer** 0.92\n\narithmetic answer\n" + END in readme.read_text()
    assert stat.S_IMODE(readme.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "reports"]
    assert cli(readme, reports, "--check") == 0
    (reports / "grammar" / "answer.md").write_text("changed\n")
    assert cli(readme, reports, "--check") == 1
    readme.write_text(answered.replace("0.92", "changed") + CONTRACT)  # the answer current, the table stale
    (reports / "grammar" / "answer.md").write_text("**grammar answer** changed\n")
    assert cli(readme, reports, "--check") == 1 and "contract table" in capsys.readouterr().err.splitlines()[-1]


def test_main_refuses_broken_markers_or_no_answers(tmp_path, reports, capsys):
    """Catches: a README without markers getting the answer appended (or a traceback), and a run before any
    answer.md exists wiping the README's answer."""
    readme = tmp_path / "README.md"
    readme.write_text(README.replace(END, "") + CONTRACT)
    assert cli(readme, reports) == 1
    assert "end marker" in capsys.readouterr().err and readme.read_text() == README.replace(END, "") + CONTRACT
    readme.write_text(README)  # no contract markers
    assert cli(readme, reports) == 1
    assert "contract:begin" in capsys.readouterr().err and readme.read_text() == README
    readme.write_text(README + CONTRACT)
    assert main(["--readme", str(readme), "--reports", str(reports), "--tasks", "nothing"]) == 1
    assert "no " in capsys.readouterr().err and readme.read_text() == README + CONTRACT


REPORT_MD = "Δ -1.361 (95% CI [-2.044, -0.679]); gold 0.924 and −0.42; in 2024; 24.5 nats; 3.1% empty; 1,000 instances"


@pytest.mark.parametrize(
    "written, flagged",
    [
        ("0.92", False),  # 0.924 rounded
        ("0.924", False),
        ("0.93", True),  # not how 0.924 rounds
        ("10.92", True),
        ("−0.92", True),  # the report's 0.924 is positive
        ("−0.42", False),  # unicode minus in the report too
        ("+1.36", False),  # the difference written the other way round
        ("-1.36", False),
        ("+2.04", False),  # -2.044
        ("24", True),  # only in 2024 and 24.5
        ("2024", False),
        ("3.1%", False),
        ("95%", False),
        ("1,000", False),
        ("14%", False),  # the fraction 0.14 in stats.json
        ("0.262", True),
        ("7", True),
    ],
)
def test_numbers_not_in_reports(tmp_path, written, flagged):
    """Catches: a number the reports do not show passing (misrounded, wrong sign, a substring of another number
    such as 24 in 2024) or one they do show flagged (unicode minus, leading '+', a rounding, a fraction as a
    percentage, thousands separators)."""
    (tmp_path / "reports" / "grammar").mkdir(parents=True)
    (tmp_path / "reports" / "grammar" / "report.md").write_text(REPORT_MD)
    (tmp_path / "reports" / "grammar" / "stats.json").write_text('{"empty": 0.14}')
    readme = f"## The current answer\n\nThe value is {written} here.\n"
    assert numbers_not_in_reports(readme, tmp_path / "reports") == ([written] if flagged else [])


def test_numbers_are_read_only_where_they_are_claims(tmp_path):
    """Catches: numbers outside the answer section checked, numbers inside words (k5, v0.7, commit e687b75269) or in
    link targets flagged, the bare question numbers 1-4 flagged, and a number in a file that is not a report
    (reports/notes.txt) counting as shown; a README without the section raising instead of passing vacuously."""
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "notes.txt").write_text("0.55 77")
    (tmp_path / "reports" / "answer.md").write_text("0.5")
    readme = (
        "# T\n\n0.999 before\n\n## The current answer\n\nQ1 to Q4, questions 1 and 3, k1, k5, v0.7, commit e687b75269, "
        "[fig](docs/fig2025_0.77.png), ![x](a/9.9.png), 0.5 and 0.55 and 77.\n\n## Next\n\n0.888 after\n"
    )
    assert answer_section(readme).startswith("## The current answer") and "0.888" not in answer_section(readme)
    assert numbers_not_in_reports(readme, tmp_path / "reports") == ["0.55", "77"]
    assert numbers_not_in_reports(readme, tmp_path / "reports", "## Next") == ["0.888"]  # another checked section
    with pytest.raises(ValueError, match="The current answer"):
        numbers_not_in_reports("# T\n\n## Other\n\n0.5\n", tmp_path / "reports")


def test_broken_links(tmp_path):
    """Catches: a link copied from answer.md relative to its own folder (figures/x.png) passing, and URLs,
    anchors or existing paths flagged."""
    (tmp_path / "reports" / "grammar" / "figures").mkdir(parents=True)
    (tmp_path / "reports" / "grammar" / "report.md").write_text("x")
    text = (
        "[r](reports/grammar/report.md) [r2](reports/grammar/report.md#q1) [f](reports/grammar/figures) "
        "[u](https://example.org/a.png) [a](#the-current-answer) ![bad](figures/x.png) [bad2](report.md)"
    )
    assert broken_links(text, tmp_path) == ["figures/x.png", "report.md"]


def test_readme_answer_is_generated_from_reports():
    """On the repository itself. Catches: a hand edit of the README's generated answer block (or reports regenerated
    without ``python -m pipelines.readme``), a number in the answer section that no report shows, and a link in the
    generated block that points nowhere from the README."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    if BEGIN not in text and END not in text:
        pytest.skip("README.md has no answer markers yet: its answer section is not generated (pipelines/readme.py)")
    generated = block(TASKS, ROOT / "reports")
    assert generated, "README.md has answer markers but no reports/<task>/answer.md exists"
    assert splice(text, generated) == text, "README.md's answer block is stale: run python -m pipelines.readme"
    for heading, reports in CHECKED_SECTIONS.items():  # the answer; the variants section against the profile's
        missing = numbers_not_in_reports(text, ROOT / reports, heading)
        assert missing == [], f"numbers in README's {heading!r} that no report in {reports} shows"
    assert broken_links(generated, ROOT) == [], "links in the generated answer that point nowhere from README.md"
    if VERSIONS_BEGIN in text:
        table = versions_table(TASKS, ROOT / "reports", ROOT / SUPERSEDED_DIR)
        assert table and splice(text, table, VERSIONS_BEGIN, VERSIONS_END) == text, "stale v3/v4 table: regenerate"


def _stats(path: Path, doc: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "stats.json").write_text(__import__("json").dumps(doc))


V4_ROW = dict(contrast="loss_k3 − reward_k3", metric="gold", level=None, role="act", label="material difference",
              estimate=-0.4217, lo=-1.0316, hi=-0.2259, n=16, status="settled")  # fmt: skip


def test_versions_table_puts_each_v3_question_beside_its_v4_comparisons(tmp_path):
    """v3's Q2 beside v4's same_beta, Q3 beside every frontier level (and nothing else: not kl_vs_none's levels),
    a v4-only question "not asked" on the v3 side, Q1 beside the contract check; a task without both files skipped.
    Catches: a question paired with the wrong one, a level comparison lost or one of another question pulled in, the
    estimand (mean vs median) not stated, a missing CI bound crashing instead of printing "–"."""
    v3 = {"headline": "not settled", "primary": {
        "Q1": dict(question="Q1", comparison="loss_k1 − reward_k1", metric="log_kl", levels="β 0.1 / β 0.1",
                   verdict="equivalent", estimate=0.191, lo=0.017, hi=0.468, n=12),
        "Q2": dict(question="Q2", comparison="loss_k3 − reward_k3", metric="gold", levels="β 0.1 / β 0.1",
                   verdict="equivalent", estimate=-0.013, lo=None, hi=0.025, n=12)}}  # fmt: skip
    level = lambda c, k, lvl: V4_ROW | dict(comparison=f"{c}_level{k}", level=lvl, role="levels", status="open")
    v4 = {"headline": "matters", "carried_by": ["same_beta"], "primary": {
        "same_beta": V4_ROW | {"comparison": "same_beta"},
        "frontier_level1": level("frontier", 1, 0.11), "frontier_level2": level("frontier", 2, 0.219),
        "kl_vs_none_level1": level("kl_vs_none", 1, 0.11)}}  # fmt: skip
    _stats(tmp_path / "v4" / "arithmetic", v4)
    _stats(tmp_path / "v3" / "arithmetic", v3)
    _stats(tmp_path / "v4" / "grammar", v4)  # no v3 report: skipped
    table = versions_table(["grammar", "arithmetic"], tmp_path / "v4", tmp_path / "v3").splitlines()
    assert "mean Δ, exact sign-flip CI" in table[0] and "median Δ, exact sign-test CI" in table[0]
    rows = {line.split(" | ")[1]: line.split(" | ")[2:] for line in table[2:]}
    assert all(line.startswith("| arithmetic |") for line in table[2:])
    assert rows["**the answer**"] == ["**not settled**", "**matters** (carried by same_beta) |"]
    assert rows["same estimator, same β (placement)"] == [
        "Q2: loss_k3 − reward_k3, gold, β 0.1 / β 0.1: **equivalent**, Δ -0.013 [–, +0.025], n 12",
        "same_beta: loss_k3 − reward_k3, gold, β where the penalty acts: **material difference**, "
        "Δ -0.422 [-1.032, -0.226], n 16 (settled) |"]  # fmt: skip
    matched = rows["matched KL (placement)"]
    assert matched[0] == "not asked" and matched[1].count("<br>") == 1
    assert "frontier_level1" in matched[1] and "KL level 0.219 nats" in matched[1] and "kl_vs_none" not in matched[1]
    assert rows["same expected gradient (placement)"] == ["not asked", "not asked |"]
    assert rows["k1 in the loss"][0].startswith("Q1: loss_k1 − reward_k1, log_kl") and "Contract checks" in rows[
        "k1 in the loss"][1]  # fmt: skip
    assert versions_table(["grammar"], tmp_path / "v4", tmp_path / "v3") == ""


def test_main_splices_the_versions_table_where_the_readme_has_its_markers(tmp_path, reports, monkeypatch):
    """The table is spliced between its markers and left out of the number check (its v3 numbers are not the
    reports'); a README without the markers is left without it. Catches: the table spliced into the answer block,
    --check passing on a stale table, the number check failing on the generated v3 numbers."""
    _stats(reports / "grammar", {"headline": "matters", "carried_by": [], "primary": {"same_beta": V4_ROW | {
        "comparison": "same_beta"}}})  # fmt: skip
    _stats(tmp_path / SUPERSEDED_DIR / "grammar", {"headline": "matters", "primary": {}})
    readme = tmp_path / "README.md"
    readme.write_text(
        README.replace("after\n", f"{VERSIONS_BEGIN}\nold versions table\n{VERSIONS_END}\nafter\n") + CONTRACT
    )
    monkeypatch.chdir(tmp_path)  # SUPERSEDED_DIR is relative to the repository root
    assert cli(readme, reports, "--check") == 1
    assert cli(readme, reports) == 0
    text = readme.read_text()
    assert cli(readme, reports, "--check") == 0
    assert (
        "old versions table" not in text
        and "| grammar | **the answer** | **matters** | **matters** (carried by none) |" in text
    )
    assert text.index(END) < text.index(VERSIONS_BEGIN)
    assert "0.422" in text and numbers_not_in_reports(text, reports) == []
