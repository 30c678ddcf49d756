"""Protocol lock (ablations/lock.py) on small temporary git repositories."""

import subprocess

import pytest
import yaml

from ablations.lock import protocol_lock

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
    commit(repo, "protocol", params(0.03))
    c2 = commit(repo, "results a", lock={"fixed@a": outs("1")})
    c3 = commit(repo, "results b", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    c4 = commit(repo, "narrow the targets", params(0.03, targets=(2.0, 4.0)))
    s = protocol_lock(repo, WATCHED, CELLS)
    assert s.lock.commit == c4 and s.lock.keys == ("grid.kl_targets",)
    assert (s.results_first.commit, s.results_last.commit) == (c2, c3)
    assert s.results_after_lock is False
    assert [a.commit for a in s.amendments] == [c4]
    assert "Amendments" in " ".join(s.sentences()) and "grid.kl_targets" in " ".join(s.sentences())


def test_rerun_after_the_change_is_judged_by_the_new_protocol(repo):
    commit(repo, "protocol", params(0.03))
    commit(repo, "results", lock={"fixed@a": outs("1"), "fixed@b": outs("2")})
    c3 = commit(repo, "new margin", params(0.05))
    c4 = commit(repo, "rerun", lock={"fixed@a": outs("3"), "fixed@b": outs("4")})
    s = protocol_lock(repo, WATCHED, lambda stage: stage.startswith("fixed@"))
    assert s.lock.commit == c3 and s.results_first.commit == c4
    assert s.results_after_lock is True and s.amendments == ()


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
