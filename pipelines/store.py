"""The DVC remote that travels with the repository: ``dvc-remote/`` (remote ``repo`` in .dvc/config, the default),
committed to git beside the dvc.lock whose outputs it holds.

A fresh clone has no DVC cache, and every recorded stage would otherwise be computed again before `make settle`
could add a batch (protocol v4's calibration, planning and first five looks: about 3 hours on 2 cores, more than one
stretch of this project's machines). So `make repro` and `make settle` first restore what dvc.lock records and the
workspace lacks from ``dvc-remote/`` (what it does not hold is computed, as before), and `make settle` pushes every
recorded output there after each look, to be committed with dvc.lock. The remote is content-addressed (DVC's
``files/md5/<2>/<30>`` layout, the DVC cache's own): an output that does not change is stored once, and git keeps
each object once. Pushing is plain `dvc push` to the default remote: `dvc remote add -d <name> <url>` points both
commands at another remote (S3, SSH, ...), and `dvc push -r repo` still fills this one.

    python -m pipelines.store pull     # `dvc pull --allow-missing`: what the workspace lacks, from the remote
    python -m pipelines.store push     # `dvc push`: every cached output dvc.lock records, to the remote
"""

from __future__ import annotations

import subprocess
import sys

# DVC as the runner calls it: waits for DVC's repository lock, writes dvc.lock atomically
from pipelines.runner.dvccli import DVC

COMMANDS = {
    "pull": ["pull", "--allow-missing", "--quiet"],  # a missing object is computed by the runner, not an error
    "push": ["push", "--quiet"],
}


def sync(command: str) -> int:
    """Runs ``dvc pull`` or ``dvc push`` as COMMANDS says, through the runner's DVC command line (a `dvc repro` or a
    runner recording beside it holds DVC's lock: this waits its turn instead of failing after 3 s); 0 on success.
    A failure costs time, never a result: a pull that fails (an output the user changed, a remote not there) leaves
    the runner to compute what is missing, a push that fails leaves the outputs in the local cache (push again); so
    it is one warning line and exit status 1."""
    rc = subprocess.call([*DVC, *COMMANDS[command]])
    if rc:
        what = "the runner computes what was not restored" if command == "pull" else "run it again before committing"
        print(f"warning: `dvc {' '.join(COMMANDS[command])}` failed (exit {rc}): {what}", file=sys.stderr)
    return 1 if rc else 0


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in COMMANDS:
        print(f"usage: python -m pipelines.store {{{'|'.join(COMMANDS)}}}", file=sys.stderr)
        return 2
    return sync(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
