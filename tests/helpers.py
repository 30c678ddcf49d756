"""Helpers shared by test modules (a test module imports these, never another test module)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CODE = ("rlhf", "ablations", "pipelines", "benchmarks")


def copy_params(dest: Path, params: dict | None = None, text: str | None = None) -> Path:
    """``dest``/params.yaml: ``params`` dumped, or ``text``, or the repository's own file; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    if params is not None:
        (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    elif text is not None:
        (dest / "params.yaml").write_text(text)
    else:
        shutil.copy(REPO / "params.yaml", dest / "params.yaml")
    return dest


def tracked_files(prefixes: tuple[str, ...], names: tuple[str, ...] = ()) -> list[str]:
    """The repository's files git lists (tracked, or untracked and not ignored) under ``prefixes`` or named."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    keep = lambda f: f.startswith(prefixes) or f in names
    return [f for f in files if keep(f) and (REPO / f).is_file()]  # a file may be deleted since git listed it


def copy_code(dest: Path, prefixes: tuple[str, ...] = tuple(f"{d}/" for d in CODE), names: tuple[str, ...] = ()):
    """Copies this checkout's files under ``prefixes`` (and those ``names``) into ``dest``."""
    for f in tracked_files(prefixes, names):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / f, dest / f)
