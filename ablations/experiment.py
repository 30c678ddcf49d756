"""What to run: the params.yaml sections that decide the cells (tasks, models, SFT, reward model, PPO, the grid of
arms), validated before any compute (torch-free: the check takes well under a second). How the runs are judged
(the ``analysis`` section) is ablations/protocol_params.py; ablations/config.py validates the two together.

* Parsed by the YAML parser DVC uses (ruamel.yaml, safe loader, YAML 1.2), so the values the runner sees are the
  values DVC interpolates into stage names; a key given twice is refused.
* Every section is a strict pydantic model with ``extra="forbid"`` and **no defaults**: every value that changes a
  result is written once, in params.yaml. Booleans are not numbers, seeds are plain ints, coefficients finite
  floats; values that can only be mistakes (a billion iterations) are refused by upper bounds.
* A problem fails with one line naming the file, the key and the allowed values or keys.

A cell stage reads only this module (``load_experiment``), so a protocol change leaves every cell up to date.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import (
    BaseModel,
    Field,
    FiniteFloat,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from ablations.section import PACKAGED, STRICT, PPODefaults, Seed, TaskSection, _distinct, check_packaged
from ablations.tasks import TASKS
from rlhf.config import Estimator, KLConfig, PPOConfig

PARAMS_FILE = Path("params.yaml")
BASELINE = "none"  # the no-KL arm's name: in stage names, summaries and tables (ablations/grid.py, ablations/load.py)
RESERVED_ARMS = (BASELINE, "baseline")  # the no-KL baseline's names
MAX_NAME = 64  # an arm name is part of a stage name and of a directory name (runs/<task>/<kind>/<key>)


class ParamsError(ValueError):
    """A params.yaml problem, worded for the person editing the file (one line)."""


PPO_OVERRIDES = (  # the PPOConfig fields an arm may replace (rlhf/config.py documents each)
    "algorithm",
    "group_size",
    "cliprange_high",
    "dual_clip",
    "ratio_level",
    "entropy_coef",
    "pg_aggregation",
    "dr_grpo",
)
CONTROLLER = ("coef", "adaptive_target", "horizon")  # a KLConfig's strength: the grid's coefs or the matched cells


class _ArmMethods(BaseModel):
    """What every arm does with its fields (the fields themselves are KLConfig's and PPOConfig's, below)."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _no_none(cls, data):
        if isinstance(data, dict) and data.get("placement") == "none":
            raise ValueError(
                "placement 'none' is the no-KL baseline (it runs once per seed as stage 'baseline'), not an arm; "
                "allowed: 'reward', 'loss', 'both'"
            )
        return data

    def kl(self, coef: float, **controller) -> KLConfig:
        """This arm's KLConfig at ``coef`` (``controller``: a matched cell's adaptive_target and horizon)."""
        return KLConfig(**self.model_dump(exclude=set(PPO_OVERRIDES)), coef=coef, **controller)

    def ppo_overrides(self) -> dict:
        """The task's ppo values this arm replaces (algorithm, group_size, policy-loss options)."""
        return {k: v for k in PPO_OVERRIDES if (v := getattr(self, k)) is not None}


def _optional(field: FieldInfo) -> tuple:
    """A PPOConfig field as an arm's override: the same type and bounds, or None (the task's value)."""
    return (field.annotation | None, FieldInfo.merge_field_infos(field, default=None))


# One variant of the grid: a KLConfig without its strength (CONTROLLER: the grid's coefs, or the matched cells'
# controller, supply it), optionally under other PPOConfig values than the task's (PPO_OVERRIDES). Its fields are
# derived from those two models, so a new KL option is declared once, in rlhf/config.py.
Arm = create_model(
    "Arm",
    __base__=_ArmMethods,
    __doc__="One variant of the grid: KLConfig's fields but its strength, and PPOConfig's PPO_OVERRIDES (None: the "
    "task's value). rlhf/config.py documents every field; rlhf/kl.py CONTRACT each combination's expected gradient.",
    **{
        **{k: (f.annotation, f) for k, f in KLConfig.model_fields.items() if k not in CONTROLLER},
        "estimator": (Estimator, Field()),  # an arm has a KL: placement 'none' is the baseline, not an arm
        **{k: _optional(PPOConfig.model_fields[k]) for k in PPO_OVERRIDES},
    },
)


def spec_of(config: PPOConfig) -> dict:
    """The arm of a cell's whole config: its KL without the strength and every PPO_OVERRIDES value (typed; None or
    False when off). Two cells of one arm have the same spec; the analysis compares arms by it."""
    return {**config.kl.model_dump(exclude=set(CONTROLLER)), **{k: getattr(config, k) for k in PPO_OVERRIDES}}


def _spec_field(name: str) -> FieldInfo:
    return KLConfig.model_fields[name] if name in KLConfig.model_fields else PPOConfig.model_fields[name]


# The fields of ``spec_of``, derived from KLConfig and PPOConfig, in the order tables show them: those every arm sets
# (algorithm, group size, target, placement, estimator), then the options (a field with a default: off there), in
# KLConfig's then PPOConfig's order. A new KL or policy-loss option appears in every table without being listed.
_SPEC = (*(k for k in KLConfig.model_fields if k not in CONTROLLER), *PPO_OVERRIDES)
SPEC_OPTIONS = tuple(k for k in _SPEC if not _spec_field(k).is_required())
_REQUIRED = sorted((k for k in _SPEC if k not in SPEC_OPTIONS), key=lambda k: k not in PPO_OVERRIDES)  # PPO's first
SPEC_FIELDS = (*_REQUIRED, *SPEC_OPTIONS)
# summary.json's flat spec fields: the required ones and the options of its first version (before issue 18), set or
# not; frozen, so that a cell of then keeps its bytes: any later option is written only when on (``option_on``), so
# a new option is never added here
FIRST_OPTIONS = ("is_weight", "aggregation", "both_split", "return_to_go", "ref_sync_every", "ref_sync_alpha")
SUMMARY_ALWAYS = (*_REQUIRED, *FIRST_OPTIONS)


def option_on(name: str, value) -> bool:
    """Whether spec field ``name`` (an option of SPEC_OPTIONS) is switched on: ``value`` is not its default (None,
    False, or e.g. ratio_level 'token'). A NaN (None in a numeric pandas column) is off."""
    if isinstance(value, float) and value != value:
        return False
    return value != _spec_field(name).default


class MatchedParams(BaseModel):
    """The matched-KL cells: every arm steered by the adaptive controller to each task's kl_targets."""

    model_config = STRICT
    init_coef: FiniteFloat = Field(gt=0.0, le=1_000.0, description="the controller's initial coefficient")
    horizon: int = Field(gt=0, le=100_000_000, description="controller horizon (episodes)")


# what the calibration stage fixes for a design cell (grid.design): ``act`` the reference arm's coefficient where
# the penalty acts, ``control`` the margin-sized positive control's, ``tuned`` the arm's own best, ``level<k>``
# steered to the k-th frontier KL level (1-based, <task>.calibration.levels)
ROLES = ("act", "control", "tuned", "level")
SHARED = "shared"  # the design group that runs on every evaluation instance (the controls and the reference cells)


def split_entry(entry: str) -> tuple[str, str]:
    """'<arm>-<role>' -> (arm, role); a level role keeps its index ('level2')."""
    arm, _, role = entry.rpartition("-")
    return arm, role


def role_kind(role: str) -> str:
    """The role's name without a level's index: 'level2' -> 'level'."""
    return "level" if re.fullmatch(r"level[1-9][0-9]*", role) else role


class Grid(BaseModel):
    """The arms (the same for every task), the PPO seeds within each task instance, the matched-KL controller, the
    calibration cells and the evaluation design.

    Calibration cells (each task's calibration instances): the no-KL baseline and every ``calibration_arms`` arm at
    every ``<task>.calibration.coefs``. Evaluation cells (each task's ``instances``): the no-KL baseline and every
    ``design`` entry ``<arm>-<role>`` (the arm at the value the calibration stage fixed for the role: ``act`` the
    reference arm's coefficient where the penalty acts, ``control`` the margin-sized positive control's
    coefficient, ``tuned`` the arm's own best coefficient, ``level<k>`` steered to the k-th frontier KL level),
    grouped: the ``shared`` group runs on every evaluation instance, every other group on the instances
    ``<task>.allocation`` gives it (``make settle`` stops a group once every primary comparison using its cells is
    settled); and, for exploration, every arm at the task's ``coefs`` and ``kl_targets``. The planning instances
    run every design entry once. All x seeds."""

    model_config = STRICT
    arms: dict[str, Arm]
    seeds: list[Seed]
    matched: MatchedParams
    calibration_arms: list[str] = Field(description="arms run at every calibration coefficient")
    design: dict[str, list[str]] = Field(description="evaluation cells by group: '<arm>-<role>' per instance/seed")

    @model_validator(mode="after")
    def _design(self):
        for a in self.calibration_arms:
            if a not in self.arms:
                raise ValueError(f"grid.calibration_arms: {a!r} is not an arm; allowed: {', '.join(self.arms)}")
        _distinct("calibration arm", self.calibration_arms)
        if SHARED not in self.design:
            raise ValueError(f"grid.design must have a {SHARED!r} group (the cells every evaluation instance runs)")
        _distinct("design cell", [e for cells in self.design.values() for e in cells])
        for group, cells in self.design.items():
            if not re.fullmatch(r"[a-z][a-z0-9_]*", group) or len(group) > MAX_NAME:
                raise ValueError(f"grid.design: group name {group[:80]!r} must match [a-z][a-z0-9_]*")
            for entry in cells:
                arm, role = split_entry(entry)
                if arm not in self.arms or role_kind(role) not in ROLES:
                    raise ValueError(
                        f"grid.design.{group}: {entry!r} must be '<arm>-<role>' with an arm of grid.arms "
                        f"({', '.join(self.arms)}) and a role of act, control, tuned, level<k>"
                    )
                if role == "tuned" and arm not in self.calibration_arms:
                    raise ValueError(
                        f"grid.design.{group}: {entry!r} is tuned on calibration, so {arm} must be a calibration arm"
                    )
        return self

    def design_cells(self, group: str | None = None) -> list[tuple[str, str, str]]:
        """(group, arm, role) of every design entry (of ``group`` only, if given), in order."""
        return [(g, *split_entry(e)) for g, cells in self.design.items() if group in (None, g) for e in cells]

    @field_validator("arms")
    @classmethod
    def _arm_names(cls, arms):
        if not arms:
            raise ValueError("must name at least one arm")
        for name in arms:
            if name in RESERVED_ARMS:
                raise ValueError(f"arm name {name!r} is reserved for the no-KL baseline; reserved: {RESERVED_ARMS}")
            if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or len(name) > MAX_NAME:
                raise ValueError(
                    f"arm name {name[:80]!r} must match [a-z][a-z0-9_]* and have at most {MAX_NAME} characters "
                    "(it becomes part of a stage name and a directory name)"
                )
        return arms

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds):
        if not seeds:
            raise ValueError("must list at least one seed")
        return _distinct("seed", seeds)


class MLflowParams(BaseModel):
    model_config = STRICT
    experiment: str = Field(min_length=1, max_length=200, pattern=r"^\S(.*\S)?$")


class _Sections(BaseModel):
    """What the whole of params.yaml's what-to-run sections check and answer (the fields: ``Experiment`` below)."""

    model_config = STRICT

    @field_validator("pretrained", check_fields=False)  # the field is Experiment's (below)
    @classmethod
    def _packaged(cls, names):
        """Each a packaged model (ablations.section.PACKAGED) whose install is complete, once."""
        return [check_packaged(n) for n in _distinct("packaged model", names)]

    @model_validator(mode="after")
    def _cross(self):
        if not self.tasks():
            raise ValueError(f"no task runs: give at least one of {', '.join(TASKS)} instances")
        for task, section in self.tasks().items():  # a task starts from a packaged model its stage converts
            name = section.model.hf.pretrained if section.model.hf is not None else None
            if name in PACKAGED and name not in self.pretrained:
                raise ValueError(
                    f"{task}.model.hf.pretrained: {name!r} is a packaged model: list it in 'pretrained' too (its "
                    f"conversion stage pretrained@{name})"
                )
        m = self.grid.matched
        for name, arm in self.grid.arms.items():  # each cell must be a valid KLConfig
            for task, section in self.tasks().items():
                if arm.ref_sync_every is not None and arm.ref_sync_every > section.ppo.iterations:
                    raise ValueError(
                        f"grid.arms.{name}.ref_sync_every ({arm.ref_sync_every}) must be <= {task}.ppo.iterations "
                        f"({section.ppo.iterations}): the reference would never move"
                    )
                for kl in [{"coef": c} for c in [*section.coefs, *section.calibration.coefs]] + [
                    {"coef": m.init_coef, "adaptive_target": 1.0, "horizon": m.horizon}
                ]:
                    try:
                        section.ppo_config(arm.kl(**kl), 0, **arm.ppo_overrides())
                    except ValidationError as e:
                        raise ValueError(f"grid.arms.{name}: {_message(e.errors()[0])}") from None
        return self

    @model_validator(mode="after")
    def _allocation(self):
        groups = sorted(g for g in self.grid.design if g != SHARED)
        for task, section in self.tasks().items():
            if sorted(section.allocation) != groups:
                raise ValueError(
                    f"{task}.allocation must give every design group but {SHARED!r} its instances: "
                    f"{', '.join(groups) or 'none'} (got {', '.join(sorted(section.allocation)) or 'none'})"
                )
            n = len(section.calibration.levels)
            for _, arm, role in self.grid.design_cells():
                if role_kind(role) == "level" and not 1 <= int(role[5:]) <= n:
                    raise ValueError(f"grid.design: {arm}-{role}: {task} has {n} calibration.levels (level1..{n})")
        return self

    def tasks(self) -> dict[str, TaskSection]:
        """The task sections that run, by task name (a task with no instances does not run)."""
        return {name: section for name in TASKS if (section := getattr(self, name)).instances}


# One section per registered task (ablations/tasks.py, in report order), then the grid, analysis and mlflow.
Experiment = create_model(
    "Experiment",
    __base__=_Sections,
    __doc__="params.yaml as far as the cells are concerned: ``analysis`` is read as a mapping here and judged by "
    "ablations.config.Params (ablations/protocol_params.py).",
    **{name: (spec.section, Field()) for name, spec in TASKS.items()},
    grid=(Grid, Field()),
    pretrained=(list[str], Field(description="packaged models the pretrained@<name> stage converts (PACKAGED)")),
    analysis=(dict, Field()),
    mlflow=(MLflowParams, Field()),
)


# ---------------------------------------------------------------- messages


def _allowed_keys(loc: tuple, model: type[BaseModel]) -> list[str]:
    """The keys allowed at ``loc`` (a pydantic error location ending in the unknown key) of ``model``."""
    parts = list(loc[:-1])
    while parts:
        field = model.model_fields.get(parts.pop(0))
        ann = field.annotation if field else None
        if getattr(ann, "__origin__", None) is dict:  # e.g. grid.arms: the next part is an arm's name
            ann = ann.__args__[1]
            parts = parts[1:]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [k for k in model.model_fields if not (issubclass(model, PPODefaults) and k in ("kl", "seed"))]


def _message(err: dict, model: type[BaseModel] | None = None) -> str:
    """One pydantic error as 'key: what is wrong (got value)'."""
    loc = tuple(err["loc"])
    where = ".".join(str(p) for p in loc)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc, model or Experiment)
        return f"unknown key '{where}'" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    if err["type"] == "missing":
        return f"missing key '{where}'"
    inp = err.get("input")
    got = "" if isinstance(inp, dict | list) or "got" in msg or inp is None else f" (got {inp!r})"
    return f"{where}: {msg}{got}" if where else f"{msg}{got}"


def read_yaml(path: Path) -> dict:
    """params.yaml as DVC reads it (ruamel.yaml, safe loader), duplicate keys refused. ParamsError on any problem,
    one line with the file, line and column."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ParamsError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ParamsError(
            f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); save it as UTF-8"
        ) from None
    directive = re.search(r"^%YAML.*$", text, re.M)
    if directive:
        line = text.count("\n", 0, directive.start()) + 1
        raise ParamsError(
            f"{path}:{line}: {directive.group().strip()!r}: no %YAML directive; DVC and the runner read YAML 1.2"
        )
    try:
        raw = YAML(typ="safe", pure=True).load(text)
        if raw is None:  # empty, or nothing but comments
            raise ParamsError(f"{path}: empty (no key, only comments or nothing): it must be a mapping of sections")
        _plain_yaml(YAML(typ="safe", pure=True).compose(text), path)
    except RecursionError:
        raise ParamsError(f"{path}: nested too deeply (lists or mappings thousands of levels deep)") from None
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(str(x) for x in (e.context, e.problem) if x).replace("\n", " ")
        raise ParamsError(f"{where}: invalid YAML: {what}") from None
    except YAMLError as e:
        raise ParamsError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections; allowed: {', '.join(Experiment.model_fields)}")
    return raw


LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")  # YAML 1.1 reads 010 as 8, YAML 1.2 as 10


def _plain_yaml(node, path: Path, key: str = "", seen: set | None = None) -> None:
    """Refuses (ParamsError naming the key) what makes params.yaml mean something else to another reader, or grow
    inside DVC: anchors and aliases (DVC expands them: an alias bomb), and octal-looking ints (010)."""
    from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode

    seen = set() if seen is None else seen
    where = f"{path}:{node.start_mark.line + 1}: {key or 'the document'}"
    if id(node) in seen or node.anchor:
        raise ParamsError(f"{where}: no anchors or aliases (&, *) in params.yaml; write the values out")
    seen.add(id(node))
    if isinstance(node, ScalarNode) and node.style is None and LEADING_ZERO.fullmatch(node.value):
        raise ParamsError(f"{where}: {node.value!r}: write the number without leading zeros")
    if isinstance(node, MappingNode):
        for k, v in node.value:
            _plain_yaml(v, path, f"{key}.{k.value}" if key else str(k.value), seen)
    elif isinstance(node, SequenceNode):
        for i, v in enumerate(node.value):
            _plain_yaml(v, path, f"{key}.{i}", seen)


def validate(path: Path | str, model: type[BaseModel]):
    """Reads params.yaml and validates it as ``model``. Raises ParamsError with one line naming the key and what is
    allowed."""
    path = Path(path)
    raw = read_yaml(path)
    try:
        return model.model_validate(raw)
    except RecursionError:
        raise ParamsError(f"{path}: nested too deeply (lists or mappings thousands of levels deep)") from None
    except ValidationError as e:
        errors = e.errors()
        more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
        raise ParamsError(f"{path}: {_message(errors[0], model)}{more}") from None


def load_experiment(path: Path | str = PARAMS_FILE) -> Experiment:
    """params.yaml's what-to-run sections, validated (a cell stage's check; the runner checks the whole file with
    ablations.config.load_params before any compute)."""
    return validate(path, Experiment)
