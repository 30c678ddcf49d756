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

Estimator = Literal["k1", "k2", "k3", "full", "k1+", "k3+", "abs"]
Placement = Literal["none", "reward", "loss", "both"]
Target = Literal["reference", "old_policy", "old_policy_forward"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
PGAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RatioLevel = Literal["token", "sequence"]
Algorithm = Literal["ppo", "grpo", "rloo", "reinforce_pp"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
PLACEMENTS: tuple[str, ...] = get_args(Placement)
TARGETS: tuple[str, ...] = get_args(Target)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
PG_AGGREGATIONS: tuple[str, ...] = get_args(PGAggregation)
STRAIGHT_THROUGH = ("k1+", "k3+")  # verl names: the value of k1/k3 with the gradient of k2
# is_weight: a differentiable ratio pi/sg(pi_old) for k1 and k3 (the weight's own gradient completes theirs), a
# detached one for the estimators whose own gradient is already delta * s (RPG, Zhang et al. 2025, arXiv 2505.17508)
IS_DIFFERENTIABLE, IS_DETACHED = ("k1", "k3"), ("k2", "k1+", "k3+")
# return_to_go: only after a per-token term whose expected gradient is grad KL_t with the prefix fixed
RTG_ESTIMATORS = ("k2", "k1+", "k3+", "full")
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
        estimator 'k1+'/'k3+'  straight-through: value of k1/k3, gradient of k2 (verl)     placement loss
        is_weight              loss-side k times pi_theta/sg(pi_old) for k1, k3 (DeepSeek-V3.2), times the
                               detached ratio for k2, k1+, k3+ (RPG); placement loss only
        aggregation            token-mean | seq-mean-token-sum | seq-mean-token-mean for the KL term; None =
                               placement-native (reward: per-token sum along the sequence, loss: token-mean)
        both_split             refused: the reward and loss halves of one estimator add up to grad KL only at the
                               same coefficient, so a split is an unbiased penalty of half the strength at 0.5
                               and a biased one elsewhere; 'both' at coef already gives coef * grad KL in total
        return_to_go           loss-side score-function term for the future KL (Tang & Munos 2025): only after
                               k2, k1+, k3+, full or is_weight (their per-token gradient is grad KL_t); loss only
        kl_clamp               clamp each per-token KL value to [-c, c] (verl/OpenRLHF: 10 or 20); None = off
        estimator 'abs'        |delta| (verl ``kl_penalty='abs'``): biased as a value and as a gradient
        target 'old_policy'    KL(pi_theta || pi_old);  'old_policy_forward': KL(pi_old || pi_theta), the
                               direction of PaLM-rlhf-pytorch ``masked_kl_div(old, new)`` (full, loss only)
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
    kl_clamp: FiniteFloat | None = Field(None, gt=0.0, description="clamp per-token KL values to [-c, c]")
    ref_sync_every: int | None = Field(None, gt=0, description="moving reference: iterations between updates")
    ref_sync_alpha: FiniteFloat | None = Field(None, gt=0.0, le=1.0, description="1 = reset, < 1 = EMA")

    @model_validator(mode="after")
    def _consistent(self):
        loss_side = ("loss", "both")
        if self.placement == "none":
            if self.estimator is not None:
                raise ValueError("estimator must be null when placement is 'none' (there is no KL to estimate)")
            on = [f for f in ("is_weight", "return_to_go") if getattr(self, f)]
            on += [
                f for f in ("aggregation", "both_split", "ref_sync_every", "kl_clamp") if getattr(self, f) is not None
            ]
            if on:
                raise ValueError(f"{on[0]} needs a KL: placement one of {_allowed(PLACEMENTS[1:])} (got 'none')")
        elif self.estimator is None:
            raise ValueError(f"placement {self.placement!r} needs an estimator: one of {', '.join(ESTIMATORS)}")
        if self.estimator in STRAIGHT_THROUGH and self.placement not in loss_side:
            raise ValueError(
                f"estimator {self.estimator!r} differs from {self.estimator[:2]!r} only in its gradient, which a "
                f"reward-side KL does not use: placement one of {_allowed(loss_side)} (got {self.placement!r})"
            )
        if self.is_weight and self.placement != "loss":
            raise ValueError(
                f"is_weight weights a loss-side KL: placement 'loss' (with 'both' the reward half already gives "
                f"the score part, so the weighted loss half counts it twice) (got {self.placement!r})"
            )
        if self.is_weight and self.estimator not in IS_DIFFERENTIABLE + IS_DETACHED:
            raise ValueError(
                f"is_weight needs a sampled-token estimator: one of {_allowed(IS_DIFFERENTIABLE + IS_DETACHED)} "
                f"(got {self.estimator!r})"
            )
        if self.return_to_go and self.placement != "loss":
            raise ValueError(
                f"return_to_go is a loss-side term (the reward placement, and the reward half of 'both', has the "
                f"future KL through the returns): placement 'loss' (got {self.placement!r})"
            )
        if self.return_to_go and not (self.estimator in RTG_ESTIMATORS or self.is_weight):
            raise ValueError(
                f"return_to_go adds the future KL to a per-token gradient that must be grad KL_t: estimator one of "
                f"{_allowed(RTG_ESTIMATORS)} or is_weight true (got {self.estimator!r}: its own on-policy gradient "
                f"is {'0' if self.estimator == 'k1' else 'not grad KL_t'})"
            )
        if self.estimator == "full" and self.placement == "reward":
            raise ValueError(
                "estimator 'full' with placement 'reward': a per-position KL does not depend on the token it is "
                "credited to, so it gives only the future-KL part of the gradient; use placement 'both' (exact "
                "sequence-KL gradient, Amini et al. 2025) or 'loss' with return_to_go"
            )
        if self.placement == "both" and self.estimator in STRAIGHT_THROUGH + ("abs",):
            raise ValueError(
                f"estimator {self.estimator!r} with placement 'both': the reward half and the loss half each give "
                f"the per-position gradient, counted twice; placement 'both' takes one of 'k1', 'k2', 'k3', 'full'"
            )
        if self.both_split is not None:
            raise ValueError(
                "both_split is refused: the reward and loss halves add up to grad KL only at the same coefficient "
                "(0.5 is an unbiased penalty of half the strength); use placement 'both' without both_split "
                "(coef * grad KL in total) or halve coef"
            )
        if self.target == "old_policy_forward" and (
            self.placement != "loss" or self.estimator != "full" or self.return_to_go
        ):
            raise ValueError(
                "target 'old_policy_forward' (KL(pi_old || pi_theta), PaLM-rlhf-pytorch) is the exact KL in the "
                f"loss, whose gradient is already the sequence one: placement 'loss', estimator 'full', return_to_go "
                f"false (got {self.placement!r}, {self.estimator!r}, {self.return_to_go})"
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
            raise ValueError(f"ref_sync_every moves the reference: target 'reference' (got {self.target!r})")
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
        sampled per prompt (1 = independent prompts). Critic-free algorithms ignore lam, cliprange_value, vf_coef.

        Policy-loss options (off by default; with all off the loss is today's bit for bit): ``cliprange_high``
        (DAPO, arXiv 2503.14476, eq. 10: clip-higher), ``dual_clip`` (Ye et al. 2020, arXiv 1912.09729, eq. 5),
        ``ratio_level: sequence`` (GSPO, arXiv 2507.18071, eq. 7; with ``pg_aggregation: seq-mean-token-mean``, its
    eq. 5's 1/G per response), ``entropy_coef`` (a fixed entropy bonus,
        Schulman et al. 2017 eq. 9), ``pg_aggregation`` (verl ``loss_agg_mode``; seq-mean-token-mean is DeepSeekMath
        eq. 3's per-response mean), ``dr_grpo`` (Liu et al. 2025, arXiv 2503.20783: no std division, the loss summed
        over tokens and divided by the constant response width)."""

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
    # policy-loss options, each off by default (rlhf.ppo.policy_loss has the formulas)
    cliprange_high: FiniteFloat | None = Field(
        None, gt=0.0, description="clip-higher: ratio clipped to [1 - cliprange, 1 + cliprange_high] (DAPO)"
    )
    dual_clip: FiniteFloat | None = Field(None, gt=1.0, description="dual-clip c: loss <= c * |A| for A < 0 (Ye 2020)")
    ratio_level: RatioLevel = Field("token", description="'sequence': GSPO's length-normalised sequence ratio")
    entropy_coef: FiniteFloat | None = Field(None, gt=0.0, description="fixed entropy bonus: loss -= c * H")
    pg_aggregation: PGAggregation | None = Field(None, description="policy-loss aggregation; None = token-mean")
    dr_grpo: bool = Field(False, description="Dr. GRPO: no std division, pg_aggregation seq-mean-token-sum-norm")

    @property
    def pg_mode(self) -> str:
        """The aggregation of the policy-gradient loss (and the native one of the KL term on either side)."""
        return self.pg_aggregation or ("seq-mean-token-sum-norm" if self.dr_grpo else "token-mean")

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
        if self.dr_grpo and self.algorithm != "grpo":
            raise ValueError(f"dr_grpo changes GRPO's advantages: algorithm 'grpo' (got {self.algorithm!r})")
        if self.dr_grpo and self.pg_aggregation not in (None, "seq-mean-token-sum-norm"):
            raise ValueError(
                f"dr_grpo aggregates the loss as seq-mean-token-sum-norm: pg_aggregation null or "
                f"'seq-mean-token-sum-norm' (got {self.pg_aggregation!r})"
            )
        if self.ratio_level == "sequence" and self.pg_mode != "seq-mean-token-mean":
            raise ValueError(
                "ratio_level 'sequence' (GSPO) is GSPO's objective only with pg_aggregation 'seq-mean-token-mean' "
                f"(each response weighted 1/G, arXiv 2507.18071 eq. 5-7; {self.pg_mode!r} weights it by its length) "
                f"(got pg_aggregation {self.pg_aggregation!r}{', dr_grpo true' if self.dr_grpo else ''})"
            )
        if self.diagnostics is not None:
            bad = [i for i in self.diagnostics.at if not 1 <= i <= self.iterations]
            if bad or len(set(self.diagnostics.at)) != len(self.diagnostics.at):
                raise ValueError(
                    f"diagnostics.at must list distinct iterations in 1..{self.iterations} (got {self.diagnostics.at})"
                )
        return self
