"""DVC stage `<task>_planning`: each primary comparison's sample size from its noise on the planning instances ->
protocol/<task>.plan.json.

    python -m pipelines.plan grammar

Reads only the plan cells (runs/<task>/plan*/) and the calibrated protocol; ablations/plan.py has the rule. The JSON
is written atomically and kept in git (dvc.yaml: cache false), with protocol/<task>.json: together they are the
frozen protocol, committed before any evaluation cell runs (`make calibrate`, then commit).
"""

from __future__ import annotations

import json
import sys

from ablations.config import ParamsError, load_params
from ablations.grid import plan_cells, plan_path, protocol_path
from ablations.load import ExpectedRun, MissingResultsError, load_runs
from ablations.plan import plan
from pipelines.calibrate import write_json


def main(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    try:
        params = load_params()
    except ParamsError as e:
        sys.exit(f"error: {e}")
    tasks = params.tasks()
    if len(args) != 1 or args[0] not in tasks:
        sys.exit(f"usage: python -m pipelines.plan <task>; allowed: {', '.join(tasks)} (got {' '.join(args)!r})")
    task = args[0]
    path = protocol_path(task)
    if not path.is_file():
        sys.exit(f"error: {path} not found: run the calibration first (dvc repro {task}_calibrate)")
    try:
        protocol = json.loads(path.read_text())
    except ValueError as e:
        sys.exit(f"error: {path} is not valid JSON ({e}); rerun `dvc repro {task}_calibrate`")
    expected = [ExpectedRun(c.stage, c.out_dir) for c in plan_cells(params) if c.task == task]
    try:
        runs, evals = load_runs(expected)
    except MissingResultsError as e:
        what = str(e).splitlines()[0].removeprefix("analysis needs every expected run; ")
        sys.exit(f"error: {task}_planning needs every plan run; {what[:400]}{'...' * (len(what) > 400)}")
    try:
        out = plan(runs, evals, task, params.analysis, protocol)
    except ValueError as e:
        sys.exit(f"error: {e}")
    write_json(plan_path(task), out)
    caps = {k: v["cap"] for k, v in out["comparisons"].items()}
    print(f"{plan_path(task)}: caps {caps}")
    return out


if __name__ == "__main__":
    main()
