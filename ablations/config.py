"""params.yaml, validated in one place before any compute (torch-free: the check takes well under a second): what to
run (ablations/experiment.py: tasks, models, PPO, the grid) and how to judge it (ablations/protocol_params.py: the
``analysis`` section), with the checks that need both. The runner, the calibration and the analysis read this; a
cell stage reads only ablations.experiment, so a protocol change re-runs no cell.

``python -m ablations.config [params.yaml]`` runs the check alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import model_validator

from ablations.experiment import *  # noqa: F403 (the schema's names, for the callers of the whole params)
from ablations.experiment import PARAMS_FILE, SHARED, Experiment, ParamsError, validate
from ablations.protocol_params import *  # noqa: F403
from ablations.protocol_params import NO_KL, AnalysisParams, check_metrics
from ablations.section import *  # noqa: F403
from ablations.tasks import *  # noqa: F403


class Params(Experiment):
    """The whole params.yaml: the experiment and its protocol (``analysis``)."""

    analysis: AnalysisParams

    @model_validator(mode="after")
    def _protocol(self):
        if self.analysis.reference_arm not in self.grid.arms:
            raise ValueError(
                f"analysis.reference_arm {self.analysis.reference_arm!r} is not an arm; "
                f"allowed: {', '.join(self.grid.arms)}"
            )
        missing = [t for t in self.tasks() if t not in self.analysis.tasks]
        if missing:
            raise ValueError(
                f"analysis.tasks needs the protocol of every task that runs; missing: {', '.join(missing)}"
            )
        a, g = self.analysis, self.grid
        if a.reference_arm not in g.calibration_arms:
            raise ValueError(f"grid.calibration_arms must include the reference arm {a.reference_arm!r}")
        cells = {(arm, role) for _, arm, role in g.design_cells()}
        shared = {(arm, role) for _, arm, role in g.design_cells(SHARED)}
        for role in ("act", "control"):
            if (a.reference_arm, role) not in shared:
                raise ValueError(
                    f"grid.design.{SHARED} must include '{a.reference_arm}-{role}' (the controls of every question)"
                )
        n_levels = {len(s.calibration.levels) for s in self.tasks().values()}
        if len(n_levels) > 1:
            raise ValueError(f"every task's calibration.levels must have the same length (got {sorted(n_levels)})")
        levels = [f"level{k}" for k in range(1, (n_levels or {0}).pop() + 1)]
        for kind, questions in (("primary", a.primary), ("checks", a.checks)):
            for q, pr in questions.items():
                for arm in (pr.arm, pr.other):
                    if arm == NO_KL:
                        continue
                    for role in levels if pr.role == "levels" else [pr.role]:
                        if (arm, role) not in cells:
                            raise ValueError(
                                f"analysis.{kind}.{q}: needs the design cell '{arm}-{role}' in grid.design"
                            )
        for name, section in self.tasks().items():
            n, seq = len(section.instances), a.sequential
            if n % seq.batch_size or n > seq.max_cap:
                raise ValueError(
                    f"{name}.instances: {n} instances must be whole batches of analysis.sequential.batch_size "
                    f"({seq.batch_size}), at most the max cap ({seq.max_cap})"
                )
        check_metrics(self.analysis.tasks)
        return self


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    """Reads and validates the whole params.yaml. Raises ParamsError with one line naming the key and what is
    allowed."""
    return validate(path, Params)


if __name__ == "__main__":
    try:
        load_params(sys.argv[1] if len(sys.argv) > 1 else PARAMS_FILE)
    except ParamsError as e:
        sys.exit(f"error: {e}")
    print("params OK")
