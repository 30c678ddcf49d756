"""params.yaml, validated in one place before any compute.

Every section is a pydantic model with ``extra="forbid"``: an unknown key, a misspelt placement or estimator, a
negative coefficient, an empty axis, a duplicate seed or a cell that makes no sense fails with one message that
names the key and the allowed values. ``python -m ablations.config [params.yaml]`` runs the check alone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhf import kl as K
from rlhf.ppo import KLConfig, PPOConfig

PARAMS_FILE = Path("params.yaml")
STRICT = ConfigDict(extra="forbid", frozen=True)


class ParamsError(ValueError):
    """A params.yaml problem, worded for the person editing the file."""


class TaskParams(BaseModel):
    model_config = STRICT
    seed: int = 0
    n_words: int = Field(24, ge=2)
    n_successors: int = Field(4, ge=1)
    p_eos: float = Field(0.06, gt=0.0, lt=1.0)
    illegal_penalty: float = Field(2.0, ge=0.0)
    prompt_len: int = Field(4, ge=2)
    max_new_tokens: int = Field(12, ge=1)
    n_demos: int = Field(4000, gt=0)
    n_train_prompts: int = Field(2048, gt=0)
    n_eval_prompts: int = Field(256, gt=0)

    @model_validator(mode="after")
    def _fits(self):
        if self.n_successors > self.n_words:
            raise ValueError(f"n_successors ({self.n_successors}) cannot exceed n_words ({self.n_words})")
        return self


class ModelParams(BaseModel):
    model_config = STRICT
    d_model: int = Field(64, gt=0)
    n_layers: int = Field(2, gt=0)
    n_heads: int = Field(4, gt=0)

    @model_validator(mode="after")
    def _heads(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        return self


class SFTParams(BaseModel):
    model_config = STRICT
    steps: int = Field(800, gt=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(3e-3, gt=0.0)
    seed: int = 0


class RMParams(BaseModel):
    model_config = STRICT
    n_pairs: int = Field(2500, gt=0)
    n_heldout_pairs: int = Field(500, gt=0)
    label_noise: float = Field(0.1, ge=0.0, description="Bradley-Terry temperature on gold differences")
    steps: int = Field(800, gt=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(1e-3, gt=0.0)
    seed: int = 0


class PPODefaults(PPOConfig):
    """The ``ppo`` section: every PPOConfig field except ``kl`` and ``seed``, which come from the grid cell."""

    @model_validator(mode="after")
    def _no_cell_keys(self):
        bad = {"kl", "seed"} & self.model_fields_set
        if bad:
            raise ValueError(f"{', '.join(sorted(bad))} belong in 'grid' (arms, coefs, seeds), not in 'ppo'")
        return self


class Arm(BaseModel):
    """One KL variant of the grid: a KLConfig without its coefficient."""

    model_config = STRICT
    target: K.Target = "reference"
    placement: Literal["reward", "loss", "both"]
    estimator: K.Estimator
    adaptive_target: float | None = Field(None, gt=0.0)
    horizon: int = Field(10_000, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _no_none(cls, data):
        if isinstance(data, dict) and data.get("placement") == "none":
            raise ValueError(
                "placement 'none' is the no-KL baseline (it runs once per seed as stage 'baseline'), not an arm; "
                "an arm's placement is one of 'reward', 'loss', 'both'"
            )
        return data

    def kl(self, coef: float) -> KLConfig:
        return KLConfig(coef=coef, **self.model_dump())


class Grid(BaseModel):
    model_config = STRICT
    arms: dict[str, Arm]
    coefs: list[float]
    seeds: list[int]

    @field_validator("arms")
    @classmethod
    def _arm_names(cls, arms):
        if not arms:
            raise ValueError("must name at least one arm")
        for name in arms:
            if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                raise ValueError(f"arm name {name!r} must match [a-z][a-z0-9_]* (it becomes part of a stage name)")
        return arms

    @field_validator("coefs")
    @classmethod
    def _coefs(cls, coefs):
        if not coefs:
            raise ValueError("must list at least one coefficient")
        if any(c <= 0 for c in coefs):
            raise ValueError(
                f"every coefficient must be > 0 (got {coefs}); the no-KL baseline runs once per seed by itself"
            )
        if len(set(coefs)) != len(coefs):
            raise ValueError(f"duplicate coefficient in {coefs}")
        return coefs

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds):
        if not seeds:
            raise ValueError("must list at least one seed")
        if any(s < 0 for s in seeds):
            raise ValueError(f"seeds must be >= 0 (got {seeds})")
        dup = sorted({s for s in seeds if seeds.count(s) > 1})
        if dup:
            raise ValueError(f"duplicate seed {dup[0]} in {seeds}")
        return seeds


class AnalysisParams(BaseModel):
    """The statistics protocol, fixed before running (see ablations/stats.py)."""

    model_config = STRICT
    metric: Literal["final_gold"] = "final_gold"
    reference_arm: str = "reward_k1"
    margin: float = Field(0.05, gt=0.0, description="equivalence margin, gold-reward units")
    alpha: float = Field(0.05, gt=0.0, lt=1.0)
    power: float = Field(0.8, gt=0.0, lt=1.0)
    kl_budgets: list[float] = Field(default_factory=lambda: [2.0, 3.0, 4.0])

    @field_validator("kl_budgets")
    @classmethod
    def _budgets(cls, b):
        if not b or any(x <= 0 for x in b) or len(set(b)) != len(b):
            raise ValueError(f"must be a non-empty list of distinct KL values > 0 (got {b})")
        return b


class MLflowParams(BaseModel):
    model_config = STRICT
    experiment: str = "kl-placement"


class Params(BaseModel):
    model_config = STRICT
    task: TaskParams = TaskParams()
    model: ModelParams = ModelParams()
    sft: SFTParams = SFTParams()
    rm: RMParams = RMParams()
    ppo: PPODefaults = PPODefaults()
    grid: Grid
    analysis: AnalysisParams = AnalysisParams()
    mlflow: MLflowParams = MLflowParams()

    @model_validator(mode="after")
    def _cross(self):
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
                    raise ValueError(f"grid.arms.{name}: {e.errors()[0]['msg']}") from None
        return self

    def ppo_config(self, kl: KLConfig, seed: int) -> PPOConfig:
        return PPOConfig(**self.ppo.model_dump(exclude={"kl", "seed"}), kl=kl, seed=seed)


def _describe(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    got = f" (got {err['input']!r})" if err["type"] not in ("missing",) and not isinstance(err["input"], dict) else ""
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return f"unknown key '{loc}'"
    return f"{loc}: {msg}{got}" if loc else f"{msg}{got}"


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    """Reads and validates params.yaml (yaml.safe_load). Raises ParamsError with one readable message."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ParamsError(f"{path}: cannot read: {e}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections")
    raw.pop("vars", None)  # DVC templating helpers, if any
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(f"{path}: " + "; ".join(_describe(err) for err in e.errors())) from None


if __name__ == "__main__":
    try:
        load_params(sys.argv[1] if len(sys.argv) > 1 else PARAMS_FILE)
    except ParamsError as e:
        sys.exit(f"error: {e}")
    print("params OK")
