"""The cells of the experiment named by params.yaml, their DVC stage names, and where each cell's results live.

For every task with instances (params.yaml ``grammar``, ...), every PPO seed s, on its CALIBRATION instances c
(``<task>.calibration.instances``):

    <task>_calibration_baseline@<c>-<s>                 the no-KL arm
    <task>_calibration@<c>-<arm>-<coef>-<s>             each calibration arm at each calibration coefficient

then, after the stage ``<task>_calibrate`` has fixed the protocol (protocol/<task>.json), on its PLANNING
instances p (``<task>.calibration.plan_instances``), whose noise the stage ``<task>_plan`` turns into each
comparison's sample size (protocol/<task>.plan.json):

    <task>_plan_baseline@<p>-<s>                        the no-KL arm
    <task>_plan@<p>-<arm>-<role>-<s>                    every grid.design entry, of every group

and then on its EVALUATION instances i (``<task>.instances``; a design group but ``shared`` only on the instances
``<task>.allocation`` gives it):

    <task>_baseline@<i>-<s>                             the no-KL arm ("none")
    <task>_design@<i>-<arm>-<role>-<s>                  each grid.design.shared entry: the arm at its role's value
    <task>_design_<group>@<i>-<arm>-<role>-<s>          each entry of design group <group>
    <task>_fixed@<i>-<arm>-<coef>-<s>                   exploratory: each arm at each of <task>.coefs
    <task>_matched@<i>-<arm>-<target>-<s>               exploratory: each arm steered to each of <task>.kl_targets

exactly as DVC names the matrix stages of dvc.yaml (``stage_name`` is the one function that makes them, the way
DVC does; tests/ablations/test_grid.py checks it against DVC itself). A cell's outputs live in
runs/<task>/<kind>/<matrix key>/. A design cell's KL config depends on the calibration (``resolve``); its stage name
does not, so the grid is known before the calibration has run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ablations.experiment import BASELINE, SHARED, Experiment, role_kind
from ablations.tasks import TASKS
from rlhf.config import KLConfig, PPOConfig, no_kl

RUNS_DIR = Path("runs")
PROTOCOL_DIR = Path("protocol")
CALIBRATION_KINDS = ("calibration_baseline", "calibration")
PLAN_KINDS = ("plan_baseline", "plan")
KINDS = ("baseline", "design", "fixed", "matched")
ROLE_CELL = ("design", "plan")  # the kinds whose cells take their strength from a calibrated role


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
    """One PPO run: a task instance, an arm and its strength (a fixed coef, a KL target, or a design role whose
    value the calibration fixes), a seed, and the whole PPOConfig of its run: None for a design cell until ``resolve``
    fills it in."""

    task: str
    kind: str  # one of CALIBRATION_KINDS + KINDS
    instance: int
    arm: str  # BASELINE for the no-KL arm
    seed: int
    config: PPOConfig | None  # the run's whole config, built once here (``cell_config``)
    coef: float | None = None  # fixed and calibration cells (design cells once resolved)
    kl_target: float | None = None  # matched cells (level-role design cells once resolved)
    role: str | None = None  # design and plan cells: act | control | tuned | level<k>
    design_group: str | None = None  # design and plan cells: their grid.design group

    @property
    def kl(self) -> KLConfig | None:
        return None if self.config is None else self.config.kl

    @property
    def group(self) -> str:
        """The dvc.yaml stage group (matrix) of the cell."""
        if self.kind in ROLE_CELL and self.design_group not in (None, SHARED):
            return f"{self.task}_{self.kind}_{self.design_group}"
        return f"{self.task}_{self.kind}"

    @property
    def values(self) -> tuple:
        """The matrix values of the stage, in dvc.yaml's order."""
        if self.kind in ("baseline", "calibration_baseline", "plan_baseline"):
            return (self.instance, self.seed)
        if self.kind in ROLE_CELL:
            return (self.instance, f"{self.arm}-{self.role}", self.seed)
        return (self.instance, self.arm, self.kl_target if self.kind == "matched" else self.coef, self.seed)

    @property
    def stage(self) -> str:
        return stage_name(self.group, *self.values)

    @property
    def out_dir(self) -> Path:
        """runs/<task>/<kind>/<matrix key>; must match the outs of dvc.yaml."""
        return RUNS_DIR / self.task / self.kind / self.stage.split("@", 1)[1]

    @property
    def result_kind(self) -> str:
        """The kind the analysis sees in summary.json: a design or plan cell is a fixed cell (a coefficient) or, with
        a level role, a matched one; a calibration or plan baseline is itself."""
        if self.kind in ROLE_CELL:
            return "matched" if role_kind(self.role) == "level" else "fixed"
        return self.kind

    @property
    def calibration(self) -> bool:
        return self.kind in CALIBRATION_KINDS

    @property
    def plan(self) -> bool:
        return self.kind in PLAN_KINDS

    @property
    def chain(self) -> str:
        """The prefix of the upstream chain the cell's instance belongs to, as dvc.yaml names its stages
        (``<task>_<chain>sft@<instance>``): "calibration_", "plan_" or ""."""
        return "calibration_" if self.calibration else "plan_" if self.plan else ""


def protocol_path(task: str) -> Path:
    """Where the calibration stage writes what it fixed for ``task`` (a DVC output, kept in git)."""
    return PROTOCOL_DIR / f"{task}.json"


class ProtocolFileError(ValueError):
    """A protocol/<task>.json that is not the calibration's JSON (cut, edited into invalid JSON); one line."""


def read_protocol(path: Path) -> dict:
    """What the calibration (or the plan) fixed, from ``path`` (a protocol/<task>.json or protocol/<task>.plan.json);
    ProtocolFileError naming the file and the stage that writes it when it is cut or not a JSON object,
    FileNotFoundError when it is missing."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        why = f"not JSON ({e.msg} at line {e.lineno}, column {e.colno}: cut or edited)"
    except UnicodeDecodeError:
        why = "not UTF-8 text"
    else:
        if isinstance(doc, dict):
            return doc
        why = f"a JSON {type(doc).__name__}, not the calibration's object"
    task, _, plan = path.name.removesuffix(".json").partition(".")  # <task>.json or <task>.plan.json
    stage = f"{task}_planning" if plan else f"{task}_calibrate"
    raise ProtocolFileError(f"{path}: {why}; restore it (`git checkout {path}`) or re-create it (`dvc repro {stage}`)")


def plan_path(task: str) -> Path:
    """Where the planning stage writes each comparison's sample size for ``task`` (a DVC output, kept in git)."""
    return PROTOCOL_DIR / f"{task}.plan.json"


def role_value(protocol: dict, arm: str, role: str) -> float:
    """The calibrated value of a design role (protocol/<task>.json, ablations/calibration.py): the coefficient
    where the penalty acts (``act``), the positive control's (``control``), ``arm``'s own best (``tuned``), or the
    k-th frontier KL level (``level<k>``)."""
    if role == "tuned":
        return float(protocol["tuned"][arm])
    if role_kind(role) == "level":
        return float(protocol["levels"][int(role[5:]) - 1])
    return float(protocol[{"act": "coef", "control": "control_coef"}[role]])


def cell_config(params: Experiment, task: str, arm: str, seed: int, coef: float = 0.0, target: float | None = None):
    """The whole PPOConfig of one cell: ``task``'s ppo values with ``arm``'s overrides and its KL at ``coef``, or
    steered to the KL ``target`` by the matched controller (grid.matched); the no-KL config for BASELINE."""
    section = getattr(params, task)
    if arm == BASELINE:
        return section.ppo_config(no_kl(), seed)
    spec, m = params.grid.arms[arm], params.grid.matched
    kl = spec.kl(coef) if target is None else spec.kl(m.init_coef, adaptive_target=target, horizon=m.horizon)
    return section.ppo_config(kl, seed, **spec.ppo_overrides())


def resolve(cell: Cell, params: Experiment, protocol: dict) -> Cell:
    """A design or plan cell with its config, from the calibrated ``protocol``; any other cell unchanged."""
    if cell.kind not in ROLE_CELL:
        return cell
    value = role_value(protocol, cell.arm, cell.role)
    if role_kind(cell.role) == "level":
        return replace(cell, config=cell_config(params, cell.task, cell.arm, cell.seed, target=value), kl_target=value)
    return replace(cell, config=cell_config(params, cell.task, cell.arm, cell.seed, coef=value), coef=value)


def calibration_cells(params: Experiment) -> list[Cell]:
    """The cells of every task's calibration instances: the no-KL baseline and every calibration arm at every
    calibration coefficient, x seeds."""
    g, out = params.grid, []
    cfg = lambda *a, **kw: cell_config(params, *a, **kw)
    for task, section in params.tasks().items():
        cal = section.calibration
        for i in cal.instances:
            out += [Cell(task, "calibration_baseline", i, BASELINE, s, cfg(task, BASELINE, s)) for s in g.seeds]
            for arm in g.calibration_arms:
                for coef in cal.coefs:
                    out += [Cell(task, "calibration", i, arm, s, cfg(task, arm, s, coef), coef=coef) for s in g.seeds]
    return out


def plan_cells(params: Experiment) -> list[Cell]:
    """The cells of every task's planning instances: the no-KL baseline and every design entry (all groups), x
    seeds. Plan cells are unresolved (``resolve``): they need the calibration's protocol."""
    g, out = params.grid, []
    for task, section in params.tasks().items():
        for i in section.calibration.plan_instances:
            out += [
                Cell(task, "plan_baseline", i, BASELINE, s, cell_config(params, task, BASELINE, s)) for s in g.seeds
            ]
            for group, arm, role in g.design_cells():
                out += [Cell(task, "plan", i, arm, s, None, role=role, design_group=group) for s in g.seeds]
    return out


def allocated(section, group: str) -> list[int]:
    """The evaluation instances design ``group``'s cells run on: all of them for the shared group."""
    return list(section.instances) if group == SHARED else list(section.allocation[group])


def evaluation_cells(params: Experiment) -> list[Cell]:
    """Every evaluation cell, in a stable order: by task, instance, kind (baseline, design, fixed, matched), arm,
    strength, seed. Design cells are unresolved (``resolve``); a design group's cells exist on the instances
    allocated to it."""
    g, out = params.grid, []
    cfg = lambda *a, **kw: cell_config(params, *a, **kw)
    for task, section in params.tasks().items():
        for i in section.instances:
            out += [Cell(task, "baseline", i, BASELINE, s, cfg(task, BASELINE, s)) for s in g.seeds]
            for group, arm, role in g.design_cells():
                if i in allocated(section, group):
                    out += [Cell(task, "design", i, arm, s, None, role=role, design_group=group) for s in g.seeds]
            for arm in g.arms:
                for coef in section.coefs:
                    out += [Cell(task, "fixed", i, arm, s, cfg(task, arm, s, coef), coef=coef) for s in g.seeds]
                for target in section.kl_targets:
                    out += [
                        Cell(task, "matched", i, arm, s, cfg(task, arm, s, target=target), kl_target=target)
                        for s in g.seeds
                    ]
    return out


def cells(params: Experiment) -> list[Cell]:
    """Every cell of the current params: the calibration cells, the plan cells, then the evaluation cells."""
    return calibration_cells(params) + plan_cells(params) + evaluation_cells(params)


def find_cell(params: Experiment, stage: str) -> Cell:
    """The cell of ``params`` whose DVC stage name is ``stage`` (KeyError naming the stage otherwise)."""
    for c in cells(params):
        if c.stage == stage:
            return c
    raise KeyError(f"no cell named {stage!r} in params.yaml (stale dvc.yaml entry, or a grid value was removed)")


def upstream_stages(params: Experiment) -> list[str]:
    """The DVC stage groups every cell depends on: `dvc repro` of these builds data, SFT, (for a learned-reward
    task) reward models and the iteration-0 evaluations of the calibration, planning and evaluation instances."""
    return [f"{t}_{p}eval0" for t in params.tasks() for p in ("calibration_", "plan_", "")]


def calibrate_stages(params: Experiment) -> list[str]:
    """The stages that fix each task's protocol from its calibration cells (dvc.yaml ``<task>_calibrate``)."""
    return [f"{task}_calibrate" for task in params.tasks()]


def plan_stages(params: Experiment) -> list[str]:
    """The stages that plan each task's sample sizes from its plan cells (dvc.yaml ``<task>_planning``)."""
    return [f"{task}_planning" for task in params.tasks()]


def upstream_chains(params: Experiment, evaluation: bool = True) -> list[list[str]]:
    """The upstream stages of each task instance in the order they run (data, sft, rm for a learned-reward task,
    eval0), as DVC names them, calibration and planning instances first (only those without ``evaluation``): every
    cell of the instance depends on its chain."""
    chains = []
    for task, section in params.tasks().items():
        kinds = ["data", "sft", "rm", "eval0"] if TASKS[task].learned_reward else ["data", "sft", "eval0"]
        cal = section.calibration
        sets = [("calibration_", cal.instances), ("plan_", cal.plan_instances)] + [("", section.instances)] * evaluation
        for prefix, instances in sets:
            chains += [[stage_name(f"{task}_{prefix}{k}", i) for k in kinds] for i in instances]
    return chains
