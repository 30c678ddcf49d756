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
from pipelines import tracking

REPORTS_DIR = Path("reports")


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
            produced = [f.relative_to(tmp) for f in analysis.run(params, tmp, root)]
            for rel in produced:  # same file system: each move is atomic; report.md comes last
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(Path(tmp) / rel, out / rel)
        written = [out / rel for rel in produced]
        log_to_mlflow(client, run_id, out, written)
    return written


def log_to_mlflow(client, run_id: str, out: Path, written: list[Path]) -> None:
    """Mirrors the report into the analysis run: every output as an artifact, the comparisons as a table
    (``comparisons.json``), stats.json's top-level strings (the headline answer) as tags and its verdict counts as
    metrics. Not one metric per comparison: the chart view would open on a bar chart of each. The verdict counts'
    keys have no "/", so the UI files them under "Model metrics", after the training curves.
    MLflow is only a mirror: the run directories were the input, reports/ is the output."""
    from mlflow.entities import RunTag

    stats = json.loads((out / "stats.json").read_text())
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in stats.items() if isinstance(v, str)])
    tracking.log_final(client, run_id, tracking.flatten_numbers(stats["verdicts"], "verdicts."))
    tracking.log_csv_table(client, run_id, out / "comparisons.csv", "comparisons.json", first=("label", "verdict"))
    for path in written:
        sub = path.parent.relative_to(out)
        client.log_artifact(run_id, str(path), artifact_path=None if sub == Path(".") else str(sub))


if __name__ == "__main__":
    try:
        written = main(*sys.argv[1:3])
    except (ParamsError, analysis.MissingResultsError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(map(str, written)))
