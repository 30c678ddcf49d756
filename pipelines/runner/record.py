"""Recording finished cells (or upstream stages) in dvc.lock while the others run."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from contextlib import suppress

from ablations.grid import Cell
from pipelines.runner import dvccli, lockfile
from pipelines.runner.signals import POLL_S, RunnerError, last_line


class Recorder:
    """Records finished cells (or upstream stages: ``what``) in dvc.lock while the others run: one commit process
    at a time, a new batch when the last commit ended ``every_s`` ago. Each commit runs in its own process session,
    so a terminal's Ctrl-C does not reach it, and ``finish`` waits for it: a commit always completes."""

    def __init__(self, env: dict[str, str], every_s: float, what: str = "cells"):
        self.env, self.every_s, self.what = env, every_s, what
        self.log = dvccli.STATE / "commit.log"
        self.waiting: list[Cell] = []
        self.batch: list[Cell] = []
        self.recorded: list[Cell] = []
        self.stale: list[str] = []  # finished, but what they ran with changed before they were recorded: left stale
        self.ran_with: dict[str, dict] = {}
        self.proc: subprocess.Popen | None = None
        self.last = float("-inf")
        self.retried = False  # a commit killed by a signal is retried once

    def add(self, cell: Cell, ran_with: dict | str | None) -> None:
        """Queues a finished cell for recording (``ran_with``: pipelines/runner/worker.py ``ran_with``; a bare string
        is the params.yaml text alone), unless params.yaml changed while the cell read it."""
        if isinstance(ran_with, str):
            ran_with = {"params": ran_with, "files": {}}
        if ran_with is None or ran_with.get("params") is None:
            return self._left_stale(f"{cell.stage}: params.yaml changed while it was read")
        self.ran_with[cell.stage] = ran_with
        self.waiting.append(cell)

    def _left_stale(self, why: str) -> None:
        """``why``: "<stage>: <what changed>"."""
        self.stale.append(why.split(":")[0])
        print(f"{lockfile.REFUSED}{why}; it stays stale", flush=True)

    def poll(self, flush: bool = False) -> None:
        """Collects a finished commit; starts the next batch when due (``flush``: as soon as possible)."""
        if self.proc is not None and self.proc.poll() is not None:
            self._collect()
        if self.proc is None and self.waiting and (flush or time.monotonic() - self.last >= self.every_s):
            self.batch, self.waiting = self.waiting, []
            self._start()

    def _start(self) -> None:
        ran_with = dvccli.STATE / "commit-ran-with.json"  # what each cell of the batch ran with, for lockfile.commit
        ran_with.write_text(json.dumps({c.stage: self.ran_with.get(c.stage) for c in self.batch}))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [*dvccli.COMMIT, f"--ran-with={ran_with}", *(c.stage for c in self.batch)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _collect(self) -> None:
        rc, self.proc, self.last = self.proc.returncode, None, time.monotonic()
        if rc < 0 and not self.retried:  # killed (e.g. by the OOM killer): dvc.lock is whole, record the batch again
            self.retried = True
            return self._start()
        if rc:
            why = f"killed by {signal.Signals(-rc).name}" if rc < 0 else last_line(self.log.read_text())
            raise RunnerError(f"recording {len(self.batch)} finished {self.what} in dvc.lock failed: {why}")
        log = self.log.read_text()
        refused = lockfile.refused(log)
        for line in log.splitlines():
            if line.startswith(lockfile.REFUSED):
                self._left_stale(line.removeprefix(lockfile.REFUSED))
        self.recorded += [c for c in self.batch if c.stage not in refused]
        n, total = len(self.batch) - len(refused), len(self.recorded)
        print(f"dvc.lock: recorded {n} more finished {self.what} ({total} so far)", flush=True)

    def finish(self) -> None:
        """Waits for the commit in progress, then records every cell still waiting."""
        while self.proc is not None or self.waiting:
            self.poll(flush=True)
            if self.proc is not None:
                with suppress(subprocess.TimeoutExpired):
                    self.proc.wait(POLL_S)


def check_stale(recorder: Recorder) -> None:
    """Fails (one line) if finished stages were left unrecorded because what they ran with changed under them."""
    if recorder.stale:
        n, names = len(recorder.stale), ", ".join(recorder.stale)
        raise RunnerError(
            f"params.yaml or a protocol file changed while the runner ran: {n} finished {recorder.what} were left "
            f"stale, not recorded ({names}); run again to compute them with the current values"
        )
