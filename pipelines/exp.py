"""Try a variation as a DVC experiment, run by the grid runner: `dvc exp run`'s `-S`, the runner's parallel cells.

    python -m pipelines.exp run -S 'grammar.coefs=[0.3]' [-S KEY=VALUE ...] [-n NAME] [-- RUNNER ARGS]
    python -m pipelines.exp run --queue -S 'grid.arms.loss_k3.estimator=k2' [-n NAME]   # queue it, run nothing
    python -m pipelines.exp start [-- RUNNER ARGS]     # run the queued variations, one after another
    python -m pipelines.exp queue                      # list them
    dvc exp show                                       # each one beside the workspace, metrics.json as columns

Plain `dvc exp run -S ...` works too, but runs the stale stages one at a time (DVC's `repro`), a few hours for an
arm's design cells; this runs them as `make repro` does. ``run`` sets each ``KEY=VALUE`` in params.yaml (the value
parsed as YAML, as `dvc exp run -S` does; params.yaml validated, its comments kept), runs the grid runner
(`python -m pipelines.run`: the stale chains and cells in parallel, then the calibrate and analysis stages), then
records the workspace as a DVC experiment (`dvc exp save`, with the reports and protocol files it wrote). Only the
stages DVC finds stale run: a new coefficient or instance runs its new cells; a changed arm runs that arm's cells
and, because the design stages declare all of ``grid.arms``, every design cell. As after `dvc exp run`, the
workspace is left at the experiment; `python -m pipelines.profile --reset` (`make reset`) returns it to the commit's
params, lock and reports. ``start`` resets the workspace before each queued variation, so each is compared with the
commit, not with the one before, and leaves the workspace at the last one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML

from ablations.config import PARAMS_FILE, ParamsError
from pipelines.profile import edit, reset

QUEUE = Path(".dvc/tmp/exps-queue.jsonl")  # one queued variation per line: {"name": ..., "set": [KEY=VALUE, ...]}
# what an experiment writes that git tracks or should: DVC's `exp save` needs the untracked ones named
OUTPUTS = ("reports", "protocol", "metrics")


def assignment(text: str) -> tuple[list[str], object]:
    """``KEY=VALUE`` (KEY dotted, VALUE YAML) -> (the key's parts, the parsed value); ParamsError if malformed."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip() or any(not p for p in key.strip().split(".")):
        raise ParamsError(f"-S {text!r}: expected KEY=VALUE with a dotted params.yaml key, e.g. grammar.ppo.lr=0.002")
    return key.strip().split("."), YAML().load(value) if value.strip() else None


def set_values(doc, assignments: list[str]) -> list[str]:
    """Sets each ``KEY=VALUE`` in the round-trip params document ``doc`` (a missing last key is added, a missing
    section is an error naming it). Returns the keys set."""
    done = []
    for text in assignments:
        parts, value = assignment(text)
        node = doc
        for i, p in enumerate(parts[:-1]):
            if not isinstance(node, dict) or p not in node:
                raise ParamsError(f"-S {text!r}: params.yaml has no section {'.'.join(parts[: i + 1])}")
            node = node[p]
        if not isinstance(node, dict):
            raise ParamsError(f"-S {text!r}: {'.'.join(parts[:-1])} is not a section of params.yaml")
        node[parts[-1]] = value
        done.append(".".join(parts))
    return done


def apply(assignments: list[str], params: Path = PARAMS_FILE) -> list[str]:
    """``set_values`` on params.yaml, validated as params.yaml is; nothing written on error."""
    return edit(params, lambda doc: set_values(doc, assignments), f"{params} with -S {' -S '.join(assignments)}")


def untracked(paths=OUTPUTS) -> list[str]:
    """The files under ``paths`` that git does not track yet (new reports, plots)."""
    out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--", *paths], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return out.split()


def run_one(assignments: list[str], name: str | None, runner_args: list[str]) -> int:
    """Applies ``assignments``, runs the grid runner, saves the experiment. Returns an exit status."""
    keys = apply(assignments)
    print(f"params.yaml: set {', '.join(keys)}", flush=True)
    status = subprocess.run([sys.executable, "-m", "pipelines.run", *runner_args]).returncode
    if status:
        print(f"error: the runner failed (exit {status}); the workspace keeps the variation, nothing saved",
              file=sys.stderr)  # fmt: skip
        return status
    cmd = [sys.executable, "-m", "dvc", "exp", "save", "--force", *(["-n", name] if name else [])]
    cmd += [a for f in untracked() for a in ("-I", f)]
    cmd += ["-m", f"pipelines.exp: -S {' -S '.join(assignments)}"]
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    runner_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m pipelines.exp", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one variation now (or --queue it)")
    r.add_argument("-S", "--set-param", dest="set", action="append", required=True, metavar="KEY=VALUE")
    r.add_argument("-n", "--name", help="the experiment's name (default: DVC makes one up)")
    r.add_argument("--queue", action="store_true", help="queue it for `start`, run nothing")
    sub.add_parser("start", help="run the queued variations one after another")
    sub.add_parser("queue", help="list the queued variations")
    args = ap.parse_args(argv)
    try:
        if args.command == "run" and args.queue:
            for text in args.set:
                assignment(text)  # a malformed one fails now, not when the queue runs
            QUEUE.parent.mkdir(parents=True, exist_ok=True)
            with QUEUE.open("a") as f:
                f.write(json.dumps({"name": args.name, "set": args.set}) + "\n")
            print(f"queued: -S {' -S '.join(args.set)}; `python -m pipelines.exp start` runs the queue")
            return 0
        if args.command == "run":
            return run_one(args.set, args.name, runner_args)
        queued = [json.loads(line) for line in QUEUE.read_text().splitlines()] if QUEUE.is_file() else []
        if args.command == "queue":
            print("\n".join(f"{q['name'] or '-'}: -S {' -S '.join(q['set'])}" for q in queued) or "the queue is empty")
            return 0
        for k, q in enumerate(queued):
            reset()
            status = run_one(q["set"], q["name"], runner_args)
            QUEUE.write_text("".join(json.dumps(x) + "\n" for x in queued[k + (0 if status else 1) :]))
            if status:
                return status  # the failed variation and those after it stay queued
        print("done; `dvc exp show` compares them with the workspace" if queued else "the queue is empty")
        return 0
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
