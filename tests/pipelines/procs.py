"""Processes of the runner's tests: waiting for a condition, finding children by command line, DVC's status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.pipelines.tiny import sh

PY = sys.executable
# How long a test waits for a runner subprocess before calling it hung: an hour (TEST_HANG_S), so that only a hang
# fails a test, never a loaded machine's slowness (issue 30: fixed 120 s timeouts failed 5 tests at load 20)
HANG_S = float(os.environ.get("TEST_HANG_S", "3600"))


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """A live process (a zombie waiting for its reaper does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def children(pid: int, word: bytes) -> list[int]:
    """Child processes of ``pid`` whose command line (arguments joined by NUL) contains ``word``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and word in (stat.parent / "cmdline").read_bytes():
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def worker_pids(workdir: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in (workdir / "fake").glob("worker-*")]


def wait_while_running(proc: subprocess.Popen, tmp: Path, condition) -> None:
    """Waits (up to 10 min) for ``condition``; fails at once, with the runner's output, if the runner ends."""

    def check() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"runner ended ({proc.returncode}):\n{(tmp / 'out.txt').read_text()}\n{(tmp / 'err.txt').read_text()}"
            )
        return bool(condition())

    wait_for(check, timeout=600)


def status(root: Path) -> dict:
    return json.loads(sh(root, PY, "-m", "dvc", "status", "--json").stdout or "{}")
