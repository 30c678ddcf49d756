"""Results are shared through DVC: push to a remote, clone, pull, and everything is there without rerunning a cell.
The remote here is the one that travels with the repository (dvc-remote/, pipelines/store.py): the clone reaches
nothing but the repository.

Slow (a tiny pipeline in a temporary git repository, about a minute): run with `make test-all`.

    python -m pipelines.store push;  git add dvc-remote dvc.lock; git commit   # the author (make settle pushes)
    git clone <repo>;  python -m pipelines.store pull                           # a collaborator (make repro pulls)
    dvc remote add -d storage <path or URL>;  dvc push / dvc pull               # the same through another remote
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.pipelines.tiny import TINY, make_repo, sh

from ..conftest import repo_params

pytestmark = pytest.mark.slow
DVC = (sys.executable, "-m", "dvc")
LOCK = "**Protocol lock.**"
FROZEN = "**Protocol v4 (frozen).**"
PLAN = "**Sample-size plan**"  # names the commit that froze protocol/<task>.plan.json too


def tree(root: Path, sub: str) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted((root / sub).rglob("*")) if p.is_file()}


def test_push_clone_pull_gives_every_result_and_the_same_report(tmp_path):
    author, clone = tmp_path / "author", tmp_path / "clone"
    author.mkdir()
    make_repo(author, repo_params(TINY))
    # the runner (calibration cells, grammar_calibrate, plan cells, grammar_planning, the evaluation cells, then the
    # analysis): plain `dvc repro` runs the stages one process at a time, over the 600 s of `sh` on a busy 2-core
    # machine
    sh(author, sys.executable, "-m", "pipelines.run", "--workers", "2")
    sh(author, sys.executable, "-m", "pipelines.store", "push")
    sh(author, "git", "add", "-A")
    sh(author, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "results")
    stored = sh(author, "git", "ls-files", "dvc-remote").stdout.split()
    assert stored and all(f.startswith("dvc-remote/files/md5/") for f in stored), stored  # in git, content-addressed

    sh(tmp_path, "git", "clone", "-q", str(author), str(clone))
    assert not (clone / "runs").exists() and not (clone / "models").exists()
    sh(clone, sys.executable, "-m", "pipelines.store", "pull")
    status = sh(clone, *DVC, "status", "--json").stdout
    assert json.loads(status or "{}") == {}, status
    assert tree(clone, "runs") == tree(author, "runs")  # every cell's summary, evals, history, curves
    assert tree(clone, "models") == tree(author, "models")
    for f in ("protocol/grammar.json", "protocol/grammar.plan.json"):  # in git
        assert (clone / f).read_bytes() == (author / f).read_bytes()
    metrics = sh(clone, *DVC, "metrics", "show", "--json").stdout
    assert "headline" in metrics and "same_beta_estimate" in metrics  # reports/grammar/metrics.json, the only metrics

    # The report is re-derived from the pulled results alone: nothing upstream runs, the bytes are identical.
    out = sh(clone, *DVC, "repro", "--force", "--single-item", "grammar_analysis").stdout
    ran = [line for line in out.splitlines() if line.startswith("Running stage")]
    assert ran == ["Running stage 'grammar_analysis':"], out
    # Every byte equal but what reads git history (the protocol-lock paragraph, and the commit that froze
    # protocol/grammar.json in the report and stats.json): the author's report was written before its first commit
    # ("not a git repository with commits", "not committed yet"), the clone's names that commit.
    assert without_lock(tree(clone, "reports")) == without_lock(tree(author, "reports"))
    assert "The reported results were recorded in commit" in lock_line(clone)
    assert "not a git repository with commits" in lock_line(author)
    head = sh(author, "git", "rev-parse", "HEAD").stdout.strip()
    assert f"committed at {head}." in lock_line(clone, FROZEN) and "committed at not committed yet" in lock_line(
        author, FROZEN
    )
    frozen = [json.loads((r / "reports/grammar/stats.json").read_text())["protocol"]["commit"] for r in (author, clone)]
    assert frozen == [None, head]
    planned = [json.loads((r / "reports/grammar/stats.json").read_text())["plan"]["commit"] for r in (author, clone)]
    assert planned == [None, head]
    assert json.loads(sh(clone, *DVC, "status", "--json").stdout or "{}") == {}


def lock_line(root: Path, start: str = LOCK) -> str:
    lines = (root / "reports/grammar/report.md").read_text().splitlines()
    return next(line for line in lines if line.startswith(start))


def without_lock(files: dict[str, bytes]) -> dict[str, bytes]:
    """The files without what reads git history: report.md's lock, frozen-protocol and plan lines, stats.json's
    protocol and plan commits."""
    out = {}
    for name, data in files.items():
        if name.endswith("report.md"):
            data = b"\n".join(
                line
                for line in data.split(b"\n")
                if not line.startswith((LOCK.encode(), FROZEN.encode(), PLAN.encode()))
            )
        elif name.endswith("stats.json"):
            stats = json.loads(data)
            stats["protocol"].pop("commit")
            stats["plan"].pop("commit")
            data = json.dumps(stats, sort_keys=True).encode()
        out[name] = data
    return out
