"""pipelines/store.py: the DVC remote committed with the repository (dvc-remote/). The push -> clone -> pull round
trip is tests/pipelines/test_dvc_share.py (slow); here, the configuration and the failure paths."""

from __future__ import annotations

from pathlib import Path

from pipelines import store
from pipelines.runner import dvccli
from tests.helpers import REPO as ROOT


def test_the_default_dvc_remote_is_the_folder_committed_with_the_repository():
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:  # DVC's own reading of .dvc/config (a relative url is resolved against .dvc/)
        config = repo.config
    assert config["core"]["remote"] == "repo" and config["core"]["analytics"] is False
    assert Path(config["remote"]["repo"]["url"]) == ROOT / "dvc-remote"
    assert "/dvc-remote/" in (ROOT / ".dvcignore").read_text().splitlines()  # never scanned as a workspace path
    assert not any(line.strip("/") == "dvc-remote" for line in (ROOT / ".gitignore").read_text().splitlines())


def test_pull_tolerates_missing_objects_and_push_is_plain(monkeypatch):
    calls = []
    monkeypatch.setattr(store.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert store.main(["pull"]) == 0 and store.main(["push"]) == 0
    assert [c[len(dvccli.DVC) :] for c in calls] == [["pull", "--allow-missing", "--quiet"], ["push", "--quiet"]]
    # the runner's DVC: it waits for DVC's repository lock (a `dvc repro` beside it) instead of failing after 3 s
    assert all(c[: len(dvccli.DVC)] == dvccli.DVC for c in calls) and "--wait-for-lock" in dvccli.DVC


def test_a_failed_sync_is_one_warning_line_and_exit_status_1(monkeypatch, capsys):
    monkeypatch.setattr(store.subprocess, "call", lambda cmd: 255)
    assert store.main(["pull"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("warning: `dvc pull --allow-missing --quiet` failed (exit 255): the runner computes"), err
    assert store.main(["push"]) == 1
    assert "run it again before committing" in capsys.readouterr().err


def test_an_unknown_command_is_refused_with_the_usage(capsys):
    assert store.main(["fetch"]) == 2 and store.main([]) == 2
    assert "usage: python -m pipelines.store {pull|push}" in capsys.readouterr().err
