"""The grid of PPO cells named by params.yaml, their DVC stage names, and where each cell's results live.

Stage names match dvc.yaml: ``ppo@<arm>-<coef>-<seed>`` (a DVC matrix over grid.arms x grid.coefs x grid.seeds)
and ``baseline@<seed>`` (the no-KL arm, once per seed; its coefficient is irrelevant). ``stage_name`` is the one
function that makes them, the same way DVC does (tests/ablations/test_grid.py checks it against DVC itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ablations.config import Params
from rlhf.config import KLConfig, no_kl

RUNS_DIR = Path("runs")
BASELINE = "none"


def matrix_key(value) -> str:
    """How DVC writes one matrix value into a stage name (dvc/parsing/interpolate.py ``to_str``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def stage_name(group: str, *values) -> str:
    """``group@v1-v2-...``: DVC's name for the matrix stage of ``group`` at these values (dvc/parsing
    ``MatrixDefinition``: the values joined by '-' after '@')."""
    return f"{group}@" + "-".join(matrix_key(v) for v in values)


@dataclass(frozen=True)
class Cell:
    arm: str
    coef: float
    seed: int
    kl: KLConfig

    @property
    def stage(self) -> str:
        if self.arm == BASELINE:
            return stage_name("baseline", self.seed)
        return stage_name("ppo", self.arm, self.coef, self.seed)

    @property
    def out_dir(self) -> Path:
        """runs/<stage group>/<matrix key>; must match the outs of dvc.yaml."""
        group, key = self.stage.split("@")
        return RUNS_DIR / group / key


def upstream_stages(params: Params) -> list[str]:
    """The DVC stages (or stage groups) every cell depends on: `dvc repro` of these builds data, SFT and reward
    models before the cells run."""
    return ["rm"]


def baseline_cell(seed: int) -> Cell:
    return Cell(BASELINE, 0.0, seed, no_kl())


def cells(params: Params) -> list[Cell]:
    """Every cell of the current grid, baseline first, in a stable order."""
    out = [baseline_cell(s) for s in params.grid.seeds]
    for arm, spec in params.grid.arms.items():
        for coef in params.grid.coefs:
            out += [Cell(arm, coef, s, spec.kl(coef)) for s in params.grid.seeds]
    return out


def find_cell(params: Params, arm: str, coef: float, seed: int) -> Cell:
    for c in cells(params):
        if (c.arm, c.seed) == (arm, seed) and (arm == BASELINE or c.coef == coef):
            return c
    raise KeyError(f"no grid cell arm={arm} coef={coef} seed={seed} in params.yaml")
