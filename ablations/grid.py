"""The grid of PPO cells named by params.yaml, and where each cell's results live.

Stage names match dvc.yaml: ``ppo@<arm>-<coef>-<seed>`` (a DVC matrix over grid.arms x grid.coefs x grid.seeds)
and ``baseline@<seed>`` (the no-KL arm, once per seed; its coefficient is irrelevant).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ablations.config import Params
from rlhf.ppo import KLConfig

RUNS_DIR = Path("runs")
BASELINE = "none"


@dataclass(frozen=True)
class Cell:
    arm: str
    coef: float
    seed: int
    kl: KLConfig

    @property
    def stage(self) -> str:
        return f"baseline@{self.seed}" if self.arm == BASELINE else f"ppo@{self.arm}-{self.coef}-{self.seed}"

    @property
    def out_dir(self) -> Path:
        """runs/<stage group>/<cell>; must match the outs of dvc.yaml."""
        if self.arm == BASELINE:
            return RUNS_DIR / "baseline" / str(self.seed)
        return RUNS_DIR / "ppo" / f"{self.arm}-{self.coef}-{self.seed}"


def baseline_cell(seed: int) -> Cell:
    return Cell(BASELINE, 0.0, seed, KLConfig(placement="none", estimator=None, coef=0.0))


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
