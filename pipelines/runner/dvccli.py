"""DVC's command line as the runner calls it: through pipelines.runner.lockfile (dvc.lock replaced whole), in its own
process session, with Ctrl-C and SIGTERM forwarded; and the check that DVC's stage commands run this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

from pipelines import tracking
from pipelines.runner import lockfile
from pipelines.runner.signals import POLL_S, RunnerError, Signals, last_line

STATE = Path(".dvc/tmp/runner")  # the runner's lock file and dvc.lock's last good copy (.dvc/tmp is git-ignored)
# DVC's CLI, dvc.lock replaced whole; waiting its turn for DVC's repository lock (a `dvc repro` started beside the
# runner holds it until its first stage is refused: tracking.refuse_beside_runner) instead of failing after 3 s
DVC = [sys.executable, "-m", "pipelines.runner.lockfile", "dvc", "--wait-for-lock"]
COMMIT = [sys.executable, "-m", "pipelines.runner.lockfile", "commit"]  # `dvc commit --force STAGE...`, one pass
PROBE = "python -c 'import sys; print(sys.prefix); print(sys.executable)'"


def stage_env() -> dict[str, str]:
    """The environment of every DVC call: this interpreter's directory first on PATH, so that the `python` of
    dvc.yaml's commands is this one even when the environment is not activated; and this runner's pid, so that
    DVC and its stage commands die with the runner and pass tracking.refuse_beside_runner."""
    path = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), os.getenv("PATH")]))
    return {**os.environ, "PATH": path, tracking.RUNNER_ENV: str(os.getpid())}


def check_interpreter(env: dict[str, str]) -> None:
    """Fails (one line) unless `python`, resolved as DVC resolves it for a stage command (lockfile.shell_probe),
    runs in this interpreter's environment. Otherwise the stages after the grid would die with a missing package."""
    try:
        cmd, fixed = lockfile.shell_probe(env, PROBE)
        out = subprocess.run(cmd, env=fixed, capture_output=True, text=True, timeout=120)
        prefix, executable = out.stdout.splitlines()[:2] if out.returncode == 0 else ("", "")
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        prefix, executable, out = "", "", e
    if not prefix or os.path.realpath(prefix) != os.path.realpath(sys.prefix):
        what = f"{executable} (environment {prefix})" if prefix else f"nothing that works ({last_line(out)})"
        raise RunnerError(
            f"DVC's stage commands would run `python` = {what}, not this interpreter, {sys.executable} "
            f"(environment {sys.prefix}); run `make repro`, or activate the environment (`. .venv/bin/activate`)",
            2,
        )


def dvc(args: list[str], env: dict[str, str], sig: Signals, capture: bool = False) -> str:
    """Runs `dvc ARGS` in its own process session and forwards Ctrl-C and SIGTERM to it (to DVC and its stage
    command). Returns its stdout if ``capture`` (else it goes to the terminal); a failure raises RunnerError."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([*DVC, *args], env=env, stdout=out if capture else None, start_new_session=True)
        forwarded = 0
        while proc.poll() is None:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(POLL_S)
            if sig.count > forwarded:
                forwarded = sig.count
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig.signum)
        out.seek(0)
        text = out.read()
    sig.check(f"stopped during `dvc {' '.join(args)}`")
    if proc.returncode:
        raise RunnerError(f"`dvc {' '.join(args)}` failed (exit {proc.returncode}); DVC's message is above")
    return text
