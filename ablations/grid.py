"""The cells of the experiment named by params.yaml, their DVC stage names, and where each cell's results live.

For every task with instances (params.yaml ``grammar``, ...), every instance i and PPO seed s:

    <task>_baseline@<i>-<s>                     the no-KL arm ("none")
    <task>_fixed@<i>-<arm>-<coef>-<s>           each arm at each of the task's fixed coefficients (<task>.coefs)
    <task>_matched@<i>-<arm>-<target>-<s>       each arm steered by the adaptive controller to each KL target

exactly as DVC names the matrix stages of dvc.yaml (``stage_name`` is the one function that makes them, the way
DVC does; tests/ablations/test_grid.py checks it against DVC itself). A cell's outputs live in
runs/<task>/<kind>/<matrix key>/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ablations.config import Params
from rlhf.config import KLConfig, no_kl

RUNS_DIR = Path("runs")
BASELINE = "none"
KINDS = ("baseline", "fixed", "matched")


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
    """One PPO run: a task instance, an arm and its strength (a fixed coef, or a KL target), a seed."""

    task: str
    kind: str  # one of KINDS
    instance: int
    arm: str  # BASELINE for the no-KL arm
    seed: int
    kl: KLConfig
    coef: float | None = None  # fixed cells
    kl_target: float | None = None  # matched cells
    ppo: tuple[tuple[str, object], ...] = ()  # the task's ppo values this arm replaces (algorithm, group_size)

    @property
    def group(self) -> str:
        return f"{self.task}_{self.kind}"

    @property
    def values(self) -> tuple:
        """The matrix values of the stage, in dvc.yaml's order."""
        strength = {"baseline": (), "fixed": (self.arm, self.coef), "matched": (self.arm, self.kl_target)}
        return (self.instance, *strength[self.kind], self.seed)

    @property
    def stage(self) -> str:
        return stage_name(self.group, *self.values)

    @property
    def out_dir(self) -> Path:
        """runs/<task>/<kind>/<matrix key>; must match the outs of dvc.yaml."""
        return RUNS_DIR / self.task / self.kind / self.stage.split("@", 1)[1]


def cells(params: Params) -> list[Cell]:
    """Every cell of the current params, in a stable order: by task, instance, kind (baseline first), arm,
    strength, seed."""
    g = params.grid
    out = []
    for task, section in params.tasks().items():
        for i in section.instances:
            out += [Cell(task, "baseline", i, BASELINE, s, no_kl()) for s in g.seeds]
            for arm, spec in g.arms.items():
                ppo = tuple(spec.ppo_overrides().items())
                for coef in section.coefs:
                    out += [Cell(task, "fixed", i, arm, s, spec.kl(coef), coef=coef, ppo=ppo) for s in g.seeds]
                for target in section.kl_targets:
                    kl = spec.kl(g.matched.init_coef, adaptive_target=target, horizon=g.matched.horizon)
                    out += [Cell(task, "matched", i, arm, s, kl, kl_target=target, ppo=ppo) for s in g.seeds]
    return out


def find_cell(params: Params, stage: str) -> Cell:
    """The cell of ``params`` whose DVC stage name is ``stage`` (KeyError naming the stage otherwise)."""
    for c in cells(params):
        if c.stage == stage:
            return c
    raise KeyError(f"no cell named {stage!r} in params.yaml (stale dvc.yaml entry, or a grid value was removed)")


def upstream_stages(params: Params) -> list[str]:
    """The DVC stage groups every cell depends on: `dvc repro` of these builds data, SFT and (for a learned-reward
    task) reward models."""
    return [f"{task}_rm" if hasattr(section, "rm") else f"{task}_sft" for task, section in params.tasks().items()]


def upstream_chains(params: Params) -> list[list[str]]:
    """The upstream stages of each task instance in the order they run (data, sft, and rm for a learned-reward
    task), as DVC names them: every cell of the instance depends on its chain."""
    chains = []
    for task, section in params.tasks().items():
        kinds = ["data", "sft", "rm"] if hasattr(section, "rm") else ["data", "sft"]
        chains += [[stage_name(f"{task}_{k}", i) for k in kinds] for i in section.instances]
    return chains
