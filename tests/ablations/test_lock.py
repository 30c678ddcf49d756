"""Protocol lock (ablations/lock.py) on small temporary git repositories."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from ablations.lock import AmendmentRow, LockStatus, earlier_verdicts, protocol_lock, watched_keys

WATCHED = ("analysis", "grid.kl_targets")
CELLS = {"fixed@a", "fixed@b"}


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)  # fmt: skip


def commit(repo, msg, params=None, lock=None):
    if params is not None:
        (repo / "params.yaml").write_text(yaml.safe_dump(params))
    if lock is not None:
        (repo / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": lock}))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def params(margin, targets=(2.0, 8.0), lr=0.001):
    return {"ppo": {"lr": lr}, "grid": {"kl_targets": list(targets)}, "analysis": {"margins": {"gold": margin}}}


def outs(md5):
    return {"cmd": "x", "outs": [{"path": "runs/x", "md5": md5}]}


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q")
    return tmp_path


def test_results_after_the_lock_and_no_amendments(repo):
    c1 = commit(repo, "protocol", params(0.03))
    commit(repo, "unrelated param", params(0.03, lr=0.002))  # not a watched key: not a protocol change
    c3 = commit(repo, "results", lock={"fixed@a": outs("1"), "fixed@b": outs("2"), "rm": outs("9")})
    s = protocol_lock(repo, WATCHED, CELLS)
    assert s.available and s.lock.commit == c1 and s.lock.keys == WATCHED
    assert s.results_first.commit == s.results_last.commit == c3
    assert s.results_after_lock is True and not s.same_commit and s.amendments == ()
    assert "Every result was recorded after the protocol lock." in " ".join(s.sentences())


def test_a_change_after_results_is_an_amendment(repo):
    c1 = commit(repo, "protocol", params(0.03))
    c2 = commit(repo, "results a", lock={"fixed@a": outs("1")})
    c3 = commit(repo, "results b", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    c4 = commit(repo, "narrow the targets", params(0.03, targets=(2.0, 4.0)))
    s = protocol_lock(repo, WATCHED, CELLS)
    assert s.lock.commit == c4 and s.lock.keys == ("grid.kl_targets",)
    assert (s.results_first.commit, s.results_last.commit) == (c2, c3)
    assert s.results_after_lock is False
    assert [a.commit for a in s.amendments] == [c4]
    assert "Amendments" in " ".join(s.sentences()) and "grid.kl_targets" in " ".join(s.sentences())
    # the freeze the results were judged under is named, and the results are after it, not "BEFORE the lock"
    assert s.frozen.commit == c1 and s.frozen.keys == WATCHED
    text = " ".join(s.sentences())
    assert f"frozen at commit {c1[:10]}" in text and f"last changed at commit {c4[:10]}" in text
    assert "Every result was recorded after the frozen protocol" in text and "BEFORE" not in text


def test_rerun_after_the_change_is_judged_by_the_new_protocol(repo):
    commit(repo, "protocol", params(0.03))
    commit(repo, "results", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    c3 = commit(repo, "new margin", params(0.05))
    c4 = commit(repo, "rerun", lock={"fixed@a": outs("3"), "fixed@b": outs("4")})
    s = protocol_lock(repo, WATCHED, lambda stage: stage.startswith("fixed@"))
    assert s.lock.commit == c3 and s.results_first.commit == c4
    assert s.results_after_lock is True and s.amendments == ()


def test_committed_params_are_read_as_yaml_1_2(repo):
    """As DVC and the params check read params.yaml (YAML 1.2): 1e-3 and 0.001 are the same number (YAML 1.1 reads
    1e-3 as a string, so rewriting it looked like a protocol amendment) and 010 is 10, not octal 8."""
    text = "analysis:\n  margins: {gold: 1e-3}\n  cap: 010\ngrid:\n  kl_targets: [2.0, 8.0]\n"
    (repo / "params.yaml").write_text(text)
    c1 = commit(repo, "protocol")
    commit(repo, "results", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    (repo / "params.yaml").write_text(text.replace("1e-3", "0.001").replace("010", "10"))
    commit(repo, "the same values, written otherwise")
    s = protocol_lock(repo, WATCHED, CELLS)
    assert s.lock.commit == c1 and s.amendments == ()


def test_same_commit_and_uncommitted_changes_are_reported(repo):
    commit(repo, "protocol and results together", params(0.03), {"fixed@a": outs("1"), "fixed@b": outs("2")})
    (repo / "params.yaml").write_text(yaml.safe_dump(params(0.04)))
    (repo / "dvc.lock").write_text(yaml.safe_dump({"stages": {"fixed@a": outs("5"), "fixed@b": outs("2")}}))
    s = protocol_lock(repo, WATCHED, CELLS)
    assert s.same_commit and s.results_after_lock is False
    assert s.protocol_uncommitted and s.results_uncommitted == 1
    text = " ".join(s.sentences())
    assert "cannot show which came first" in text and "uncommitted" in text


def test_outside_git_it_degrades_gracefully(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params(0.03)))
    s = protocol_lock(tmp_path, WATCHED, CELLS)
    assert not s.available and "not a git repository" in s.reason
    assert s.sentences() == [f"Protocol lock not checked: {s.reason}."]


# --- watched_keys: the lock watches what the stages declare -----------------------------------------------------

DVC_YAML = {
    "stages": {
        "grammar_sft": {"cmd": "x", "params": ["grammar.sft", "grammar.model"]},
        "grammar_fixed": {
            "matrix": {"arm": ["a", "b"]},
            "cmd": "x",
            "params": ["grammar.ppo", "grid.arms.${item.arm}", "grid.arms.${item.arm}"],
        },
        "grammar_matched": {"cmd": "x", "params": ["grid.arms.${item.arm}.beta", "grid.matched"]},
        "grammar_analysis": {
            "cmd": "x",
            "params": [
                {"params.yaml": ["analysis.margins", "grammar.kl_targets"]},
                {"protocol/extra.yaml": ["q.${item.q}", "fixed"]},
                {"whole.yaml": None},
                {"whole.yaml": ["k"]},
            ],
        },
        "arithmetic_ppo": {"cmd": "x", "params": ["arithmetic.ppo", "analysis"]},
        "arithmetic_loop": {"foreach": [1, 2], "do": {"cmd": "x", "params": ["arithmetic.${item}"]}},
    }
}


@pytest.fixture
def dvc_yaml(tmp_path):
    path = tmp_path / "dvc.yaml"
    path.write_text(yaml.safe_dump(DVC_YAML))
    return path


def test_watched_keys_of_a_task_are_its_stages_params(dvc_yaml):
    """Catches: templated keys kept verbatim or dropped, dict-form params.yaml keys ignored, keys of another file
    mistaken for params.yaml keys or dropped, a file listed without keys dropped, no deduplication, and stages of
    another task leaking in (arithmetic.ppo, analysis)."""
    assert watched_keys(dvc_yaml, ["grammar_"]) == [
        "analysis.margins",
        "grammar.kl_targets",
        "grammar.model",
        "grammar.ppo",
        "grammar.sft",
        "grid.arms",  # grid.arms.${item.arm} and grid.arms.${item.arm}.beta, cut back
        "grid.matched",
        "protocol/extra.yaml:fixed",
        "protocol/extra.yaml:q",
        "whole.yaml",  # covers whole.yaml:k
    ]


def test_watched_keys_reduce_to_covering_prefixes(dvc_yaml):
    """Catches: a key kept although a listed prefix covers it (``analysis`` covers ``analysis.margins``), and a
    fully templated key (``arithmetic.${item}`` -> ``arithmetic``) or the foreach/do form being ignored."""
    keys = watched_keys(dvc_yaml)
    assert "analysis" in keys and "analysis.margins" not in keys
    assert "arithmetic" in keys and "arithmetic.ppo" not in keys
    assert keys == sorted(keys) and len(keys) == len(set(keys))
    assert watched_keys(dvc_yaml, ["arithmetic_"]) == ["analysis", "arithmetic"]
    assert watched_keys(dvc_yaml, ["nothing_"]) == []


def test_watched_keys_of_the_repository_cover_the_hand_picked_protocol():
    """Catches: the derived list watching less than the hand-picked one it replaces (analysis, coefs, KL targets,
    the matched-KL controller), for each task of the real dvc.yaml."""
    root = Path(__file__).resolve().parents[2]
    from ablations.tasks import TASKS

    for task in TASKS:
        keys = watched_keys(root / "dvc.yaml", [f"{task}_"])
        for wanted in ["analysis", f"{task}.coefs", f"{task}.kl_targets", "grid.matched", f"{task}.ppo"]:
            assert any(wanted == k or wanted.startswith(k + ".") for k in keys), (task, wanted, keys)
        assert not any(k.startswith(f"{other}.") for other in TASKS if other != task for k in keys)


# --- watched files, keys of other files, amendments keep the earlier results --------------------------------------


def test_a_watched_file_and_a_key_of_another_file_are_compared_by_content(repo):
    """Catches: watched_files ignored, a formatting-only change counted as a change, a change not reported under the
    file's name, a key of another file (``protocol/extra.yaml:margin``) read from params.yaml instead."""
    (repo / "protocol").mkdir()
    (repo / "protocol" / "grammar.json").write_text('{"q": [1, 2]}')
    (repo / "protocol" / "extra.yaml").write_text("margin: 0.1\nother: 1\n")
    c1 = commit(repo, "protocol", params(0.03))
    (repo / "protocol" / "grammar.json").write_text('{\n  "q": [1, 2]\n}\n')  # same value, other formatting
    (repo / "protocol" / "extra.yaml").write_text("margin: 0.1\nother: 2\n")  # an unwatched key of that file
    commit(repo, "reformat")
    c3 = commit(repo, "results", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    (repo / "protocol" / "grammar.json").write_text('{"q": [1, 3]}')
    c4 = commit(repo, "change the questions")
    (repo / "protocol" / "extra.yaml").write_text("margin: 0.2\nother: 2\n")
    c5 = commit(repo, "change the margin")
    watched = (*WATCHED, "protocol/extra.yaml:margin")
    s = protocol_lock(repo, watched, CELLS, watched_files=["protocol/grammar.json"])
    assert s.results_first.commit == c3
    assert [(a.commit, a.keys) for a in s.amendments] == [
        (c4, ("protocol/grammar.json",)),
        (c5, ("protocol/extra.yaml:margin",)),
    ]
    assert s.lock.commit == c5 and not s.protocol_uncommitted
    first = protocol_lock(repo, watched, CELLS, watched_files=["protocol/grammar.json"])
    assert first == s  # deterministic
    s0 = protocol_lock(repo, WATCHED, CELLS)  # without them, none of this is a protocol change
    assert s0.lock.commit == c1 and s0.amendments == ()
    (repo / "protocol" / "grammar.json").write_text('{"q": [9]}')
    s = protocol_lock(repo, watched, CELLS, watched_files=["protocol/grammar.json"])
    assert s.protocol_uncommitted and s.uncommitted_keys == ("protocol/grammar.json",)
    assert "protocol/grammar.json" in " ".join(s.sentences())


def test_a_whole_file_entry_from_watched_keys_is_watched(repo):
    """Catches: an entry naming a whole file (what watched_keys returns for ``{other.yaml: null}``) being read as
    a params.yaml key that never exists, so its changes go unseen."""
    (repo / "other.yaml").write_text("a: 1\n")
    commit(repo, "protocol", params(0.03))
    commit(repo, "results", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    (repo / "other.yaml").write_text("a: 2\n")
    c3 = commit(repo, "change other")
    s = protocol_lock(repo, [*WATCHED, "other.yaml"], CELLS)
    assert [(a.commit, a.keys) for a in s.amendments] == [(c3, ("other.yaml",))]


def stats(verdict):
    return {"answers": {"Q1/kl": {"reported": verdict}, "Q2/gold": {"reported": "inconclusive"}}}


def reported(doc):
    return {q: a["reported"] for q, a in doc["answers"].items()}


def test_an_amendment_keeps_the_earlier_results(repo):
    """Catches: earlier_verdicts reading the report at the amendment commit itself (or HEAD) instead of its first
    parent, ``before`` not filled (or filled without report_path), and amendment_rows losing a question or
    mixing up before and after."""
    (repo / "reports").mkdir()
    commit(repo, "protocol", params(0.03))
    (repo / "reports" / "stats.json").write_text(json.dumps(stats("matters")))
    commit(repo, "results", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    (repo / "reports" / "stats.json").write_text(json.dumps(stats("insensitive")))  # committed with the change
    c3 = commit(repo, "narrow the targets", params(0.03, targets=(2.0, 4.0)))
    s = protocol_lock(repo, WATCHED, CELLS, report_path="reports/stats.json")
    assert [a.commit for a in s.amendments] == [c3]
    assert earlier_verdicts(repo, s.amendments[0], "reports/stats.json") == stats("matters")
    assert earlier_verdicts(repo, s.amendments[0], "reports/absent.json") is None
    assert s.before == ((s.amendments[0], stats("matters")),)
    rows = s.amendment_rows(reported, stats("insensitive"))
    assert [(r.commit, r.keys, r.question, r.before, r.after) for r in rows] == [
        (c3, ("grid.kl_targets",), "Q1/kl", "matters", "insensitive"),
        (c3, ("grid.kl_targets",), "Q2/gold", "inconclusive", "inconclusive"),
    ]
    assert [r.after for r in s.amendment_rows(reported)] == [None, None]  # for the caller to fill
    with pytest.raises(ValueError, match="report_path"):
        protocol_lock(repo, WATCHED, CELLS).amendment_rows(reported)


def test_an_amendment_before_any_report_gets_one_row(repo):
    """Catches: an amendment silently vanishing from the table when no earlier report exists."""
    commit(repo, "protocol", params(0.03))
    commit(repo, "results", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    c3 = commit(repo, "narrow the targets", params(0.03, targets=(2.0, 4.0)))
    s = protocol_lock(repo, WATCHED, CELLS, report_path="reports/stats.json")
    assert s.before == ((s.amendments[0], None),)
    date = s.amendments[0].date
    assert s.amendment_rows(reported) == [AmendmentRow(c3, date, ("grid.kl_targets",), None, None, None)]
    assert [r.question for r in s.amendment_rows(reported, stats("matters"))] == ["Q1/kl", "Q2/gold"]


# --- the no-amendment sentence is a claim only when results exist ---------------------------------------------------


def test_no_amendment_claim_only_when_committed_results_exist(repo):
    """Catches: "No protocol change was made after results existed" printed when there are no results (or only
    uncommitted ones), when git is unavailable, or unqualified while the protocol has uncommitted changes."""
    claim = "No protocol change was made after results existed"
    commit(repo, "protocol", params(0.03))
    s = protocol_lock(repo, WATCHED, CELLS)
    assert s.amendments == () and claim not in " ".join(s.sentences())
    (repo / "dvc.lock").write_text(yaml.safe_dump({"stages": {"fixed@a": outs("1")}}))
    s = protocol_lock(repo, WATCHED, CELLS)
    assert s.results_uncommitted == 1 and claim not in " ".join(s.sentences())
    commit(repo, "results")
    s = protocol_lock(repo, WATCHED, CELLS)
    assert s.results_first is not None and claim in " ".join(s.sentences())
    (repo / "params.yaml").write_text(yaml.safe_dump(params(0.05)))
    text = " ".join(protocol_lock(repo, WATCHED, CELLS).sentences())
    assert claim not in text and "No committed protocol change" in text
    assert claim not in " ".join(LockStatus(False, "no git").sentences())


def _both_readings(text: str) -> tuple[dict, dict]:
    from ablations.lock import _load, _lock, _outs

    every = lambda stage: True
    return _outs(_lock(text.encode()), every), _outs(_load(text), every)


def test_a_dvc_written_lock_reads_the_same_with_libyaml_as_with_the_yaml_1_2_reader():
    """The walk reads dvc.lock with libyaml (``_lock``): the outs it compares are what the YAML 1.2 reader reads,
    for hashes (hex digits, or a directory's hex digits and ".dir") that look like numbers to either YAML version,
    written as DVC writes them (ruamel). (A YAML 1.1-only form such as ``12:30`` or ``yes`` is not hex, and every
    out path of this pipeline starts with its folder, so none can occur.)"""
    import io

    from ruamel.yaml import YAML

    tricky = ["0123", "1e5", "12345678", "deadbeef", "007", "0e0", "1e10", "1234e5.dir", "0123.dir", "9" * 32, "ab"]
    stages = {
        f"s@{i}": {"cmd": "x", "outs": [{"path": f"runs/{h}", "md5": h, "size": i, "hash": "md5"}]}
        for i, h in enumerate(tricky)
    }
    buf = io.StringIO()
    YAML().dump({"schema": "2.0", "stages": stages}, buf)  # DVC's writer: ruamel round-trip, YAML 1.2
    fast, exact = _both_readings(buf.getvalue())
    assert fast == exact and len(fast) == len(tricky)
    assert json.loads(fast["s@0"])[0]["md5"] == "0123"


@pytest.mark.slow
def test_the_repositorys_dvc_lock_reads_the_same_with_libyaml_as_with_the_yaml_1_2_reader():
    lock = Path(__file__).resolve().parents[2] / "dvc.lock"
    if not lock.is_file():
        pytest.skip("no dvc.lock")
    fast, exact = _both_readings(lock.read_text())
    assert fast == exact and fast
