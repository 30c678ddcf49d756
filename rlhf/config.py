"""Typed configuration of the library's training loops, torch-free so that params.yaml is checked in milliseconds.

These are the *types* and *allowed values*; they carry no defaults for anything that changes a result. Every
number comes from params.yaml (read once by a stage script, ``ablations.config``) or from the caller. Optional
features whose absence switches them off (``adaptive_target``, ``is_weight``, ``return_to_go``, ``both_split``,
the moving reference, ``aggregation``'s placement-native default, ``diagnostics``) default to off.

Every invalid combination fails with one message naming the field and the allowed values (``_consistent``).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

Estimator = Literal["k1", "k2", "k3", "full", "k1+", "k3+"]
Placement = Literal["none", "reward", "loss", "both"]
Target = Literal["reference", "old_policy"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
Algorithm = Literal["ppo", "grpo", "rloo", "reinforce_pp"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
PLACEMENTS: tuple[str, ...] = get_args(Placement)
TARGETS: tuple[str, ...] = get_args(Target)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
STRAIGHT_THROUGH = ("k1+", "k3+")  # verl names: the value of k1/k3 with the gradient of k2
GROUPED = ("grpo", "rloo")  # algorithms whose baseline is the other samples of the same prompt

# strict: a boolean is not a number, a float is not an int; frozen: a config never changes under a run
LIBRARY = ConfigDict(extra="forbid", frozen=True, strict=True)


def _allowed(values) -> str:
    return ", ".join(repr(v) for v in values)


class KLConfig(BaseModel):
    """Which KL, where, estimated how, and how strongly (``rlhf.kl`` has the formulas and sources).

    ``coef`` is the fixed coefficient, or the initial one when ``adaptive_target`` is set (Ziegler et al.
    adaptive controller, ``horizon`` episodes, fed with the exact per-sequence KL to the frozen reference for every
    arm, whatever its target, estimator or moving reference).

    Variants (each off by default; ``rlhf.kl`` applies each in one function):
        estimator 'k1+'/'k3+'  straight-through: value of k1/k3, gradient of k2 (verl)     loss side only
        is_weight              loss-side k times pi_theta/sg(pi_old) (DeepSeek-V3.2)       loss side only
        aggregation            token-mean | seq-mean-token-sum | seq-mean-token-mean for the KL term; None =
                               placement-native (reward: per-token sum along the sequence, loss: token-mean)
        both_split             placement 'both': the reward gets both_split * coef, the loss the rest;
                               None = coef in each place (coef + coef)
        return_to_go           loss-side score-function term for the future KL (Tang & Munos 2025)
        ref_sync_every/alpha   moving reference: every N iterations ref <- alpha * policy + (1 - alpha) * ref

    Under grpo and rloo a reward-side KL enters each response's return R_i as its sum before the group baseline
    (TRL), and grpo divides it by the group's reward std with the score, which changes the objective from
    score - beta * KL (``rlhf.algorithms``); a loss-side KL is untouched by the advantages under every algorithm.
    """

    model_config = LIBRARY
    target: Target
    placement: Placement
    estimator: Estimator | None
    coef: FiniteFloat = Field(ge=0.0)
    adaptive_target: FiniteFloat | None = Field(None, gt=0.0, description="per-sequence KL target (nats)")
    horizon: int | None = Field(None, gt=0, description="adaptive controller horizon (episodes)")
    is_weight: bool = False
    aggregation: Aggregation | None = None
    both_split: FiniteFloat | None = Field(None, gt=0.0, lt=1.0, description="share of coef in the reward")
    return_to_go: bool = False
    ref_sync_every: int | None = Field(None, gt=0, description="moving reference: iterations between updates")
    ref_sync_alpha: FiniteFloat | None = Field(None, gt=0.0, le=1.0, description="1 = reset, < 1 = EMA")

    @model_validator(mode="after")
    def _consistent(self):
        loss_side = ("loss", "both")
        if self.placement == "none":
            if self.estimator is not None:
                raise ValueError("estimator must be null when placement is 'none' (there is no KL to estimate)")
            on = [f for f in ("is_weight", "return_to_go") if getattr(self, f)]
            on += [f for f in ("aggregation", "both_split", "ref_sync_every") if getattr(self, f) is not None]
            if on:
                raise ValueError(f"{on[0]} needs a KL: placement one of {_allowed(PLACEMENTS[1:])} (got 'none')")
        elif self.estimator is None:
            raise ValueError(f"placement {self.placement!r} needs an estimator: one of {', '.join(ESTIMATORS)}")
        if self.estimator in STRAIGHT_THROUGH and self.placement not in loss_side:
            raise ValueError(
                f"estimator {self.estimator!r} differs from {self.estimator[:2]!r} only in its gradient, which a "
                f"reward-side KL does not use: placement one of {_allowed(loss_side)} (got {self.placement!r})"
            )
        if self.is_weight and self.placement not in loss_side:
            raise ValueError(f"is_weight weights a loss-side KL: placement one of {_allowed(loss_side)}")
        if self.is_weight and self.estimator == "full":
            sampled = [e for e in ESTIMATORS if e != "full"]
            raise ValueError(f"is_weight needs a sampled-token estimator: one of {_allowed(sampled)} (got 'full')")
        if self.return_to_go and self.placement not in loss_side:
            raise ValueError(
                f"return_to_go is a loss-side term (the reward placement has it through the returns): placement "
                f"one of {_allowed(loss_side)}"
            )
        if self.both_split is not None and self.placement != "both":
            raise ValueError(
                f"both_split splits coef between reward and loss: placement 'both' (got {self.placement!r})"
            )
        if (self.adaptive_target is None) != (self.horizon is None):
            raise ValueError(
                "adaptive_target and horizon go together (both set for the adaptive controller, or neither)"
            )
        if (self.ref_sync_every is None) != (self.ref_sync_alpha is None):
            raise ValueError(
                "ref_sync_every and ref_sync_alpha go together (both set for a moving reference, or neither)"
            )
        if self.ref_sync_every is not None and self.target != "reference":
            raise ValueError("ref_sync_every moves the reference: target 'reference' (got 'old_policy')")
        return self


def no_kl() -> KLConfig:
    """The no-KL baseline: no penalty anywhere."""
    return KLConfig(target="reference", placement="none", estimator=None, coef=0.0)


class DiagnosticsConfig(BaseModel):
    """Gradient diagnostics (``rlhf.diagnostics``): at the start of each iteration in ``at``, the arm's KL-gradient
    estimate against the true gradient of the sequence KL to the reference, on-policy and after the arm's own
    off-policy updates. ``n_true`` samples for the true gradient, ``n_minibatches`` independent minibatches (of the
    run's minibatch_size) for the arm's estimate, ``seed`` for their sampling (the run's own sampling is untouched).
    """

    model_config = LIBRARY
    at: list[int] = Field(min_length=1)
    n_true: int = Field(ge=16, le=10_000_000, description="samples for the true gradient (8 chunks)")
    n_minibatches: int = Field(gt=1, le=100_000)
    seed: int = Field(ge=0)


class PPOConfig(BaseModel):
    """Hyper-parameters of the training loop (the values in params.yaml follow lm-human-preferences / TRL where the
    task allows). ``algorithm`` picks the advantage function (``rlhf.algorithms``); ``group_size`` responses are
    sampled per prompt (1 = independent prompts). Critic-free algorithms ignore lam, cliprange_value, vf_coef."""

    model_config = LIBRARY
    algorithm: Algorithm
    iterations: int = Field(gt=0, le=100_000)
    batch_size: int = Field(gt=0, le=1_000_000, description="episodes per rollout")
    group_size: int = Field(gt=0, le=1_000_000, description="responses sampled per prompt")
    minibatch_size: int = Field(gt=0)
    epochs: int = Field(gt=0, le=1_000)
    lr: FiniteFloat = Field(gt=0.0, le=1.0)
    adam_eps: FiniteFloat = Field(gt=0.0, le=1.0, description="Adam's epsilon (lm-human-preferences: 1e-5)")
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
    diagnostics: DiagnosticsConfig | None = None

    @model_validator(mode="after")
    def _divides(self):
        if self.batch_size % self.minibatch_size:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of minibatch_size {self.minibatch_size}")
        if self.batch_size % self.group_size:
            divisors = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            raise ValueError(
                f"group_size must divide batch_size {self.batch_size}: one of {', '.join(map(str, divisors))} "
                f"(got {self.group_size})"
            )
        if self.algorithm in GROUPED and self.group_size < 2:
            raise ValueError(
                f"algorithm {self.algorithm!r} compares the responses to one prompt: group_size >= 2 "
                f"(got {self.group_size})"
            )
        if self.diagnostics is not None:
            bad = [i for i in self.diagnostics.at if not 1 <= i <= self.iterations]
            if bad or len(set(self.diagnostics.at)) != len(self.diagnostics.at):
                raise ValueError(
                    f"diagnostics.at must list distinct iterations in 1..{self.iterations} (got {self.diagnostics.at})"
                )
        return self
