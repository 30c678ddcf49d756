"""Outputs that appear whole or not at all, and the cleanup of what a killed process left (torch-free: the runner
imports it).

Every writer here goes through a hidden temporary sibling, ``.<name>.tmp-<8 hex>``, renamed into place when
complete (POSIX ``rename`` is atomic). A process killed before the rename leaves that sibling behind; ``clean_temp``
removes such leftovers (and ``tempfile``'s ``.<name>-tmp-<8 chars>``, used by the analysis stage) at the runner's
start, so they are never hashed into a stage's inputs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

TEMP_NAME = re.compile(r"\..+(\.tmp-[0-9a-f]{8}|-tmp-[a-z0-9_]{8})")
OUTPUT_DIRS = ("data", "models", "metrics", "runs", "reports")  # where the stages write (dvc.yaml outs)


def temp_sibling(path: Path) -> Path:
    """A fresh hidden name next to ``path`` that ``clean_temp`` recognises."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_dir(path: Path):
    """Yields a temporary sibling directory that replaces ``path`` only if the block finishes.

    An interrupted stage leaves no half-written output that DVC or the analysis could take as complete: the old
    directory is renamed aside, the new one renamed into place, then the old one deleted (a kill in between leaves
    ``path`` absent, never partly deleted, and a temporary sibling that ``clean_temp`` removes)."""
    tmp = temp_sibling(path)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        old = temp_sibling(path)
        if path.exists():
            os.rename(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_atomic(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def clean_temp(root: Path | str = ".") -> list[Path]:
    """Removes the temporary files and directories killed processes left at the top of ``root`` and anywhere in
    its output directories; returns them. Call it only while no stage runs (the runner holds its lock)."""
    root, found = Path(root), []
    for top in (root, *(root / d for d in OUTPUT_DIRS)):
        if not top.is_dir() or top.is_symlink():
            continue
        dirs = [top] if top == root else [top, *(p for p in top.rglob("*") if p.is_dir() and not p.is_symlink())]
        found += [p for d in dirs for p in d.iterdir() if TEMP_NAME.fullmatch(p.name)]
    for p in sorted(found, key=lambda p: len(p.parts)):  # parents first; a nested leftover goes with its parent
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return found
