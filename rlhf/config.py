"""Typed configuration of the library's training loops, torch-free so that params.yaml is checked in milliseconds.

These are the *types* and *allowed values*; they carry no defaults for anything that changes a result. Every
number comes from params.yaml (read once by a stage script, ``ablations.config``) or from the caller. Optional
fields whose absence switches a feature off (``adaptive_target``) default to ``None``.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

Estimator = Literal["k1", "k2", "k3", "full"]
Placement = Literal["none", "reward", "loss", "both"]
Target = Literal["reference", "old_policy"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
PLACEMENTS: tuple[str, ...] = get_args(Placement)
TARGETS: tuple[str, ...] = get_args(Target)

# strict: a boolean is not a number, a float is not an int; frozen: a config never changes under a run
LIBRARY = ConfigDict(extra="forbid", frozen=True, strict=True)


class KLConfig(BaseModel):
    """Which KL, where, estimated how, and how strongly (``rlhf.kl`` has the formulas and sources).

    ``coef`` is the fixed coefficient, or the initial one when ``adaptive_target`` is set (Ziegler et al.
    adaptive controller, ``horizon`` episodes)."""

    model_config = LIBRARY
    target: Target
    placement: Placement
    estimator: Estimator | None
    coef: FiniteFloat = Field(ge=0.0)
    adaptive_target: FiniteFloat | None = Field(None, gt=0.0, description="per-sequence KL target (nats)")
    horizon: int | None = Field(None, gt=0, description="adaptive controller horizon (episodes)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.placement == "none" and self.estimator is not None:
            raise ValueError("estimator must be null when placement is 'none' (there is no KL to estimate)")
        if self.placement != "none" and self.estimator is None:
            raise ValueError(f"placement {self.placement!r} needs an estimator: one of {', '.join(ESTIMATORS)}")
        if self.adaptive_target is not None and self.target != "reference":
            raise ValueError("adaptive_target needs target 'reference' (KL to the rollout policy is 0 at rollout)")
        if (self.adaptive_target is None) != (self.horizon is None):
            raise ValueError(
                "adaptive_target and horizon go together (both set for the adaptive controller, or neither)"
            )
        return self


def no_kl() -> KLConfig:
    """The no-KL baseline: no penalty anywhere."""
    return KLConfig(target="reference", placement="none", estimator=None, coef=0.0)


class PPOConfig(BaseModel):
    """PPO hyper-parameters (the values in params.yaml follow lm-human-preferences / TRL where the task allows)."""

    model_config = LIBRARY
    iterations: int = Field(gt=0, le=100_000)
    batch_size: int = Field(gt=0, le=1_000_000, description="episodes per rollout")
    minibatch_size: int = Field(gt=0)
    epochs: int = Field(gt=0, le=1_000)
    lr: FiniteFloat = Field(gt=0.0, le=1.0)
    temperature: FiniteFloat = Field(gt=0.0, le=100.0)
    gamma: FiniteFloat = Field(ge=0.0, le=1.0)
    lam: FiniteFloat = Field(ge=0.0, le=1.0)
    cliprange: FiniteFloat = Field(gt=0.0)
    cliprange_value: FiniteFloat = Field(gt=0.0)
    vf_coef: FiniteFloat = Field(ge=0.0)
    whiten_rewards: bool
    missing_eos_score: FiniteFloat | None = Field(
        description="proxy score of a response without EOS (Huang et al. 2024: -1); None keeps the proxy's score"
    )
    eval_every: int = Field(gt=0)
    eval_seed: int = Field(ge=0, description="sampling seed of every held-out evaluation (the same for every arm)")
    seed: int = Field(ge=0)
    kl: KLConfig

    @model_validator(mode="after")
    def _divides(self):
        if self.batch_size % self.minibatch_size:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of minibatch_size {self.minibatch_size}")
        return self
