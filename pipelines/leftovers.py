"""What killed processes leave behind, and its cleanup (torch-free: the runner imports it).

Every writer of the stages goes through a hidden temporary sibling, ``.<name>.tmp-<8 hex>`` (pipelines/common.py
``atomic_dir``, ``write_atomic``, ``save_checkpoint``; pipelines/runner/lockfile.py for dvc.lock; pipelines/calibrate.py
for protocol/<task>.json; pipelines/profile.py for params.yaml, profiles and make settle alike), renamed into place
when complete (POSIX ``rename`` is atomic). A process killed before the rename leaves that sibling behind, as it leaves
``tempfile``'s ``.<name>-tmp-<8 chars>`` of the analysis stage. ``clean_temp`` removes them at the runner's start,
so that they are never hashed into a stage's inputs (the analysis depends on the whole ``runs`` directory).
"""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

TEMP_NAME = re.compile(r"\..+(\.tmp-[0-9a-f]{8}|-tmp-[a-z0-9_]{8})")
OUTPUT_DIRS = ("data", "models", "metrics", "runs", "reports", "protocol")  # where the stages write (dvc.yaml outs)


def temp_sibling(path: Path) -> Path:
    """A fresh hidden name next to ``path`` that ``clean_temp`` recognises."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


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
