"""DVC stage `<task>_calibrate`: fixes the protocol of one task on its calibration cells -> protocol/<task>.json.

    python -m pipelines.calibrate grammar

Reads only the calibration cells of the grid (runs/<task>/calibration*/); ablations/calibration.py has the rules.
The JSON is written atomically and kept in git (dvc.yaml: cache false), so the commit that froze the protocol is in
its history; every evaluation design cell depends on it, so none can run before it exists (DVC's DAG, and the
runner's order: calibration cells, this stage, then the evaluation cells).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from ablations.calibration import calibrate
from ablations.config import ParamsError, load_params
from ablations.grid import calibration_cells, protocol_path
from ablations.load import ExpectedRun, MissingResultsError, load_runs


def write_json(path: Path, obj: dict) -> None:
    """Writes ``obj`` as JSON atomically (a temporary sibling, then os.replace): never half a protocol file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")  # killed: pipelines.leftovers.clean_temp
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    try:
        params = load_params()
    except ParamsError as e:
        sys.exit(f"error: {e}")
    tasks = params.tasks()
    if len(args) != 1 or args[0] not in tasks:
        sys.exit(f"usage: python -m pipelines.calibrate <task>; allowed: {', '.join(tasks)} (got {' '.join(args)!r})")
    task = args[0]
    expected = [ExpectedRun(c.stage, c.out_dir) for c in calibration_cells(params) if c.task == task]
    try:
        runs, evals = load_runs(expected)
    except MissingResultsError as e:  # one line (the analysis's message goes on to list each stage on a line)
        what = str(e).splitlines()[0].removeprefix("analysis needs every expected run; ")
        sys.exit(f"error: {task}_calibrate needs every calibration run; {what[:400]}{'...' * (len(what) > 400)}")
    try:
        protocol = calibrate(
            runs,
            evals,
            task=task,
            rules=tasks[task].calibration,
            reference_arm=params.analysis.reference_arm,
            arms=params.grid.calibration_arms,
            metrics=params.analysis.tasks[task].metrics,
        )
    except ValueError as e:  # e.g. no gain to scale a margin by: the calibration cannot fix the protocol
        sys.exit(f"error: {e}")
    write_json(protocol_path(task), protocol)
    show = {k: protocol[k] for k in ("margins", "levels", "coef", "acts_on_calibration", "control_coef", "tuned")}
    print(f"{protocol_path(task)}: {show}")
    return protocol


if __name__ == "__main__":
    main()
