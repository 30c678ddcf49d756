"""The runner's errors, worded for the user, and its handling of SIGINT/SIGTERM (a flag, checked where it is safe)."""

from __future__ import annotations

import signal

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
POLL_S = 0.2


class RunnerError(Exception):
    """A failure worded for the user: one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class StageError(RuntimeError):
    """A stage's failure already worded as one line (e.g. by the Ray worker that ran it): shown as it is."""


class Interrupted(RunnerError):
    def __init__(self, signum: int, message: str):
        super().__init__(f"{signal.Signals(signum).name}: {message}", EXIT[signum])


class Signals:
    """SIGINT and SIGTERM only set a flag: the runner stops where it chooses, never inside a commit."""

    def __init__(self):
        self.signum: int | None = None
        self.count = 0

    def _handle(self, signum, frame) -> None:
        self.count += 1
        self.signum = self.signum or signum

    def __enter__(self) -> Signals:
        self._old = {s: signal.signal(s, self._handle) for s in EXIT}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def check(self, message: str) -> None:
        if self.signum:
            raise Interrupted(self.signum, message)


def last_line(x) -> str:
    """The last non-empty line of a process's output or an exception's message (with its type, but for a
    StageError, whose message is the line)."""
    text = getattr(x, "stderr", None) or str(x)
    lines = [s.strip() for s in str(text).strip().splitlines() if s.strip()]
    last = lines[-1] if lines else "no message"
    return f"{type(x).__name__}: {last}" if isinstance(x, BaseException) and not isinstance(x, StageError) else last
