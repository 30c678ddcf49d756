"""DVC stage `analysis`: reads runs/ppo/* and runs/baseline/* of the params.yaml grid, writes reports/.

    python -m pipelines.analysis [params.yaml] [reports]

Outputs (ablations.analysis.OUTPUTS): reports/report.md, stats.json (metrics), comparisons.csv, runs.csv
and figures/{gold_vs_kl,learning_curves,forest}.png. Everything is written to a temporary sibling folder first
and moved into place only when complete, so an interrupted run leaves the previous report (or none), never half
of one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ablations import analysis
from ablations.config import PARAMS_FILE, ParamsError, load_params
from ablations.grid import cells
from ablations.load import ExpectedRun
from ablations.lock import protocol_lock
from pipelines import tracking

REPORTS_DIR = Path("reports")
PROTOCOL_KEYS = ("analysis", "grid.coefs", "grid.kl_targets")  # params.yaml keys the protocol lock watches


def main(
    params_file: Path | str = PARAMS_FILE, out_dir: Path | str = REPORTS_DIR, root: Path | str = "."
) -> list[Path]:
    """Runs the analysis of the runs under ``root`` and moves its outputs into ``out_dir``; returns their paths."""
    params = load_params(params_file)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"analysis": params.analysis.model_dump(), "grid": params.grid.model_dump()}
    with tracking.stage_run("analysis", params.mlflow.experiment, config) as (client, run_id):
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-tmp-") as tmp:
            expected = [ExpectedRun(c.stage, c.out_dir) for c in cells(params)]
            # the KL targets are chosen from the no-KL runs, so only the KL arms' results must postdate the protocol
            judged = {r.stage for r in expected if Path(r.path).parent.name != "baseline"}
            lock = protocol_lock(root, PROTOCOL_KEYS, judged)
            produced = [f.relative_to(tmp) for f in analysis.run(params.analysis, expected, tmp, root, lock)]
            for rel in produced:  # same file system: each move is atomic; report.md comes last
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(Path(tmp) / rel, out / rel)
        written = [out / rel for rel in produced]
        # MLflow is only a mirror: the run directories were the input, reports/ is the output.
        stats = json.loads((out / "stats.json").read_text())
        tracking.log_final(client, run_id, tracking.flatten_numbers(stats))
        for path in written:
            sub = path.parent.relative_to(out)
            client.log_artifact(run_id, str(path), artifact_path=None if sub == Path(".") else str(sub))
    return written


if __name__ == "__main__":
    try:
        written = main(*sys.argv[1:3])
    except (ParamsError, analysis.MissingResultsError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(map(str, written)))
