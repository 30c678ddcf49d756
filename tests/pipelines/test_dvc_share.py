"""Results are shared through DVC: push to a remote, clone, pull, and everything is there without rerunning a cell.

Slow (a tiny pipeline in a temporary git repository, about a minute): run with `make test-all`.

    dvc remote add -d storage <path or URL>;  dvc push          # the author
    git clone <repo>;  dvc pull                                   # a collaborator
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO, repo_params
from .test_e2e import TINY, sh, write_params

pytestmark = pytest.mark.slow
DVC = (sys.executable, "-m", "dvc")
LOCK = "**Protocol lock.**"


def copy_project(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if f.startswith(("rlhf/", "pipelines/", "ablations/", ".dvc/config", ".dvcignore")) or f in (
            "dvc.yaml",
            ".gitignore",
        ):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / f, dest / f)


def tree(root: Path, sub: str) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted((root / sub).rglob("*")) if p.is_file()}


def test_push_clone_pull_gives_every_result_and_the_same_report(tmp_path):
    author, remote, clone = tmp_path / "author", tmp_path / "remote", tmp_path / "clone"
    author.mkdir()
    copy_project(author)
    write_params(author, repo_params(TINY))
    sh(author, "git", "init", "-q")
    sh(author, *DVC, "init", "-q", "--force")
    sh(author, *DVC, "config", "core.analytics", "false")
    sh(author, *DVC, "repro")
    sh(author, *DVC, "remote", "add", "-d", "storage", str(remote))
    sh(author, *DVC, "push", "-q")
    sh(author, "git", "add", "-A")
    sh(author, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "results")

    sh(tmp_path, "git", "clone", "-q", str(author), str(clone))
    assert not (clone / "runs").exists() and not (clone / "models").exists()
    sh(clone, *DVC, "pull", "-q")
    status = sh(clone, *DVC, "status", "--json").stdout
    assert json.loads(status or "{}") == {}, status
    assert tree(clone, "runs") == tree(author, "runs")  # every cell's summary, evals, history, curves
    assert tree(clone, "models") == tree(author, "models")
    metrics = sh(clone, *DVC, "metrics", "show", "--json").stdout
    assert "final_gold" in metrics and "heldout_accuracy" in metrics

    # The report is re-derived from the pulled results alone: nothing upstream runs, the bytes are identical.
    out = sh(clone, *DVC, "repro", "--force", "--single-item", "grammar_analysis").stdout
    ran = [line for line in out.splitlines() if line.startswith("Running stage")]
    assert ran == ["Running stage 'grammar_analysis':"], out
    # Every byte equal but the protocol-lock paragraph, which reads git history: the author's report was written
    # before its first commit ("not a git repository with commits"), the clone's names that commit.
    assert without_lock(tree(clone, "reports")) == without_lock(tree(author, "reports"))
    assert "The reported results were recorded in commit" in lock_line(clone)
    assert "not a git repository with commits" in lock_line(author)
    assert json.loads(sh(clone, *DVC, "status", "--json").stdout or "{}") == {}


def lock_line(root: Path) -> str:
    lines = (root / "reports/grammar/report.md").read_text().splitlines()
    return next(line for line in lines if line.startswith(LOCK))


def without_lock(files: dict[str, bytes]) -> dict[str, bytes]:
    return {
        name: b"\n".join(line for line in data.split(b"\n") if not line.startswith(LOCK.encode()))
        if name.endswith("report.md")
        else data
        for name, data in files.items()
    }
