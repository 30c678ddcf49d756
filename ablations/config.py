"""params.yaml, validated in one place before any compute (torch-free: the check takes well under a second).

* Parsed by the YAML parser DVC uses (ruamel.yaml, safe loader, YAML 1.2), so the values the runner sees are the
  values DVC interpolates into stage names; a key given twice is refused.
* Every section is a strict pydantic model with ``extra="forbid"`` and **no defaults**: every value that changes a
  result is written once, in params.yaml. Booleans are not numbers, seeds are plain ints, coefficients finite
  floats; values that can only be mistakes (a billion iterations) are refused by upper bounds.
* A problem fails with one line naming the file, the key and the allowed values or keys.

``python -m ablations.config [params.yaml]`` runs the check alone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, ValidationError, field_validator, model_validator

from rlhf.config import Estimator, KLConfig, PPOConfig, Target

PARAMS_FILE = Path("params.yaml")
STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)
RESERVED_ARMS = ("none", "baseline")  # the no-KL baseline's names
MAX_SEED = 2**31 - 1

Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class ParamsError(ValueError):
    """A params.yaml problem, worded for the person editing the file (one line)."""


class TaskParams(BaseModel):
    """The synthetic language and its gold reward (rlhf/task.py has the formula)."""

    model_config = STRICT
    seed: Seed
    n_words: int = Field(ge=2, le=10_000)
    n_successors: int = Field(ge=1, description="legal successors per word, among the other words")
    p_eos: FiniteFloat = Field(gt=0.0, lt=1.0)
    quality_mean: FiniteFloat = Field(ge=-100.0, le=100.0, description="mean gold quality of a word")
    illegal_penalty: FiniteFloat = Field(ge=0.0, le=1_000.0)
    prompt_len: int = Field(ge=2, le=1_000)
    max_new_tokens: int = Field(ge=2, le=1_000, description="a demonstration has at least one word and EOS")
    n_demos: int = Field(gt=0, le=10_000_000)
    n_train_prompts: int = Field(gt=0, le=10_000_000)
    n_eval_prompts: int = Field(gt=0, le=1_000_000)

    @model_validator(mode="after")
    def _fits(self):
        if self.n_successors >= self.n_words:
            raise ValueError(
                f"n_successors ({self.n_successors}) must be below n_words ({self.n_words}): no word may follow itself"
            )
        return self

    def grammar_kwargs(self) -> dict:
        """The arguments of ``rlhf.task.make_grammar`` (every one of them, none left to a default)."""
        return self.model_dump(exclude={"n_demos", "n_train_prompts", "n_eval_prompts"})


class ModelParams(BaseModel):
    model_config = STRICT
    d_model: int = Field(gt=0, le=65_536)
    n_layers: int = Field(gt=0, le=1_000)
    n_heads: int = Field(gt=0, le=1_024)

    @model_validator(mode="after")
    def _heads(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        return self


class SFTParams(BaseModel):
    model_config = STRICT
    steps: int = Field(gt=0, le=10_000_000)
    batch_size: int = Field(gt=0, le=1_000_000)
    lr: FiniteFloat = Field(gt=0.0, le=1.0)
    n_heldout: int = Field(gt=0, description="the last demonstrations, held out for NLL")
    seed: Seed


class RMParams(BaseModel):
    model_config = STRICT
    n_pairs: int = Field(gt=0, le=10_000_000)
    n_heldout_pairs: int = Field(ge=20, le=1_000_000, description="enough for an accuracy and a correlation")
    label_noise: FiniteFloat = Field(ge=0.0, description="Bradley-Terry temperature on gold differences")
    steps: int = Field(gt=0, le=10_000_000)
    batch_size: int = Field(gt=0, le=1_000_000)
    lr: FiniteFloat = Field(gt=0.0, le=1.0)
    seed: Seed


class PPODefaults(PPOConfig):
    """The ``ppo`` section: every PPOConfig field except ``kl`` and ``seed``, which come from the grid cell."""

    kl: KLConfig | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _no_cell_keys(self):
        bad = {"kl", "seed"} & self.model_fields_set
        if bad:
            raise ValueError(f"{', '.join(sorted(bad))} belong in 'grid' (arms, coefs, seeds), not in 'ppo'")
        return self


class Arm(BaseModel):
    """One KL variant of the grid: a KLConfig without its coefficient (the grid's coefs supply it)."""

    model_config = STRICT
    target: Target
    placement: Literal["reward", "loss", "both"]
    estimator: Estimator
    adaptive_target: FiniteFloat | None = Field(None, gt=0.0)
    horizon: int | None = Field(None, gt=0, le=100_000_000)

    @model_validator(mode="before")
    @classmethod
    def _no_none(cls, data):
        if isinstance(data, dict) and data.get("placement") == "none":
            raise ValueError(
                "placement 'none' is the no-KL baseline (it runs once per seed as stage 'baseline'), not an arm; "
                "allowed: 'reward', 'loss', 'both'"
            )
        return data

    def kl(self, coef: float) -> KLConfig:
        return KLConfig(coef=coef, **self.model_dump())


class Grid(BaseModel):
    model_config = STRICT
    arms: dict[str, Arm]
    coefs: list[FiniteFloat]
    seeds: list[Seed]

    @field_validator("arms")
    @classmethod
    def _arm_names(cls, arms):
        if not arms:
            raise ValueError("must name at least one arm")
        for name in arms:
            if name in RESERVED_ARMS:
                raise ValueError(f"arm name {name!r} is reserved for the no-KL baseline; reserved: {RESERVED_ARMS}")
            if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                raise ValueError(f"arm name {name!r} must match [a-z][a-z0-9_]* (it becomes part of a stage name)")
        return arms

    @field_validator("coefs", mode="before")
    @classmethod
    def _coefs_as_written(cls, coefs):
        # DVC names a stage by the value as written (`1` -> "1", `1.0` -> "1.0"): one spelling per coefficient.
        if isinstance(coefs, list):
            for c in coefs:
                if isinstance(c, int) and not isinstance(c, bool):
                    raise ValueError(f"write every coefficient as a decimal number ({c}.0, not {c})")
        return coefs

    @field_validator("coefs")
    @classmethod
    def _coefs(cls, coefs):
        if not coefs:
            raise ValueError("must list at least one coefficient")
        bad = [c for c in coefs if not 0 < c <= 1_000]
        if bad:
            raise ValueError(
                f"every coefficient must be in (0, 1000] (got {bad[0]}); the no-KL baseline runs by itself"
            )
        if len(set(coefs)) != len(coefs):
            raise ValueError(f"duplicate coefficient in {coefs}")
        return coefs

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds):
        if not seeds:
            raise ValueError("must list at least one seed")
        dup = sorted({s for s in seeds if seeds.count(s) > 1})
        if dup:
            raise ValueError(f"duplicate seed {dup[0]} in {seeds}")
        return seeds


class AnalysisParams(BaseModel):
    """The statistics protocol, fixed before running (see ablations/stats.py)."""

    model_config = STRICT
    metric: Literal["final_gold"]
    reference_arm: str
    margin: FiniteFloat = Field(gt=0.0, description="equivalence margin, gold-reward units")
    alpha: FiniteFloat = Field(gt=0.0, lt=1.0)
    power: FiniteFloat = Field(gt=0.0, lt=1.0)
    kl_budgets: list[FiniteFloat]

    @field_validator("kl_budgets")
    @classmethod
    def _budgets(cls, b):
        if not b or any(x <= 0 for x in b) or len(set(b)) != len(b):
            raise ValueError(f"must be a non-empty list of distinct KL values > 0 (got {b})")
        return b


class MLflowParams(BaseModel):
    model_config = STRICT
    experiment: str = Field(min_length=1, max_length=200, pattern=r"^\S(.*\S)?$")


class Params(BaseModel):
    model_config = STRICT
    task: TaskParams
    model: ModelParams
    sft: SFTParams
    rm: RMParams
    ppo: PPODefaults
    grid: Grid
    analysis: AnalysisParams
    mlflow: MLflowParams

    @model_validator(mode="after")
    def _cross(self):
        if self.sft.n_heldout >= self.task.n_demos:
            raise ValueError(
                f"sft.n_heldout ({self.sft.n_heldout}) must be smaller than task.n_demos ({self.task.n_demos}): "
                "SFT trains on the rest"
            )
        if self.analysis.reference_arm not in self.grid.arms:
            raise ValueError(
                f"analysis.reference_arm {self.analysis.reference_arm!r} is not an arm; "
                f"allowed: {', '.join(self.grid.arms)}"
            )
        for name, arm in self.grid.arms.items():  # each cell must be a valid KLConfig
            for coef in self.grid.coefs:
                try:
                    arm.kl(coef)
                except ValidationError as e:
                    raise ValueError(f"grid.arms.{name}: {_message(e.errors()[0])}") from None
        return self

    def ppo_config(self, kl: KLConfig, seed: int) -> PPOConfig:
        return PPOConfig(**self.ppo.model_dump(exclude={"kl", "seed"}), kl=kl, seed=seed)


# ---------------------------------------------------------------- messages


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys allowed at ``loc`` (a pydantic error location ending in the unknown key)."""
    model, parts = Params, list(loc[:-1])
    while parts:
        field = model.model_fields.get(parts.pop(0))
        ann = field.annotation if field else None
        if getattr(ann, "__origin__", None) is dict:  # e.g. grid.arms: the next part is an arm's name
            ann = ann.__args__[1]
            parts = parts[1:]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [k for k in model.model_fields if not (model is PPODefaults and k in ("kl", "seed"))]


def _message(err: dict) -> str:
    """One pydantic error as 'key: what is wrong (got value)'."""
    loc = tuple(err["loc"])
    where = ".".join(str(p) for p in loc)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc)
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
        text = path.read_text()
    except OSError as e:
        raise ParamsError(f"{path}: cannot read: {e.strerror}") from None
    try:
        raw = YAML(typ="safe", pure=True).load(text)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(str(x) for x in (e.context, e.problem) if x).replace("\n", " ")
        raise ParamsError(f"{where}: invalid YAML: {what}") from None
    except YAMLError as e:
        raise ParamsError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections; allowed: {', '.join(Params.model_fields)}")
    return raw


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    """Reads and validates params.yaml. Raises ParamsError with one line naming the key and what is allowed."""
    path = Path(path)
    raw = read_yaml(path)
    raw.pop("vars", None)  # DVC templating helpers, if any
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
        raise ParamsError(f"{path}: {_message(errors[0])}{more}") from None


if __name__ == "__main__":
    try:
        load_params(sys.argv[1] if len(sys.argv) > 1 else PARAMS_FILE)
    except ParamsError as e:
        sys.exit(f"error: {e}")
    print("params OK")
