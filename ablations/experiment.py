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
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from rlhf.config import Estimator, KLConfig, PPOConfig

PARAMS_FILE = Path("params.yaml")
STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)
RESERVED_ARMS = ("none", "baseline")  # the no-KL baseline's names
MAX_SEED = 2**31 - 1  # every seed (grid, eval_seed, diagnostics): seed * 1_000_003 + i stays below 2**63
MAX_NAME = 64  # an arm name is part of a stage name and of a directory name (runs/<task>/<kind>/<key>)
MAX_WORK = 1e12  # parameters x batch x sequence of any training step: above it a step needs > ~6e12 FLOPs and
# its activations tens of GB (the default grid is ~1e8; GPT-2 small at batch 64 x 128 tokens ~1e12)
# The TOST margin of a metric must be below its plausible range, or everything is "equivalent": accuracies and
# shares are in [0, 1], so at most 0.5 (half the range); grammar gold and proxy are word qualities ~ N(0, 1) per
# word, so at most 2.0 (two SDs; PPO's largest gain over SFT on this task is 0.574). Only these metrics exist.
METRICS = {  # the metrics of each task's evaluation that a protocol may compare (rlhf/evaluate.py)
    "grammar": ("gold", "proxy", "illegal", "empty", "truncated"),
    "arithmetic": ("gold", "ood_gold", "empty", "truncated"),
}

Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class ParamsError(ValueError):
    """A params.yaml problem, worded for the person editing the file (one line)."""


class GrammarTaskParams(BaseModel):
    """The synthetic language and its gold reward (rlhf/task.py has the formula); its seed is the task instance."""

    model_config = STRICT
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

    def grammar_kwargs(self, seed: int) -> dict:
        """The arguments of ``rlhf.task.make_grammar`` for instance ``seed`` (every one, none left to a default)."""
        return {"seed": seed, **self.model_dump(exclude={"n_demos", "n_train_prompts", "n_eval_prompts"})}


class HFParams(BaseModel):
    """The Hugging Face backend (rlhf/hf.py): a transformers causal LM built from a config (``family``, with the
    sizes of the ``model`` section) or loaded from ``pretrained`` (a local save_pretrained directory, or a hub id on
    a machine that can reach a hub; nothing downloads in this repository's pipeline or tests)."""

    model_config = STRICT
    family: Literal["llama", "gpt2"] | None = Field(description="architecture of a from-config model")
    intermediate_size: int | None = Field(gt=0, le=1_000_000, description="MLP width of a from-config model")
    pretrained: str | None = Field(min_length=1, description="directory (or hub id) of a pretrained model")
    tokens: list[str] | None = Field(description="pretrained: the tokenizer's token for BOS, EOS, then each word")
    bf16: bool = Field(description="bf16 autocast for the policy/reference/reward/value forward (fp32 weights)")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.pretrained is None) == (self.family is None):
            raise ValueError("set exactly one of 'family' (a model built from a config) and 'pretrained'")
        if self.family is not None and self.intermediate_size is None:
            raise ValueError("a from-config model needs 'intermediate_size'")
        if self.pretrained is None and self.tokens is not None:
            raise ValueError("'tokens' maps the task's tokens into a pretrained model's vocabulary; set 'pretrained'")
        return self

    @field_validator("pretrained")
    @classmethod
    def _model_dir(cls, v):
        """A path (absolute, ./ or ../, or an existing directory) must be a saved model: a directory with a
        config.json. Anything else is a hub id (``org/name``), for a machine that can reach a hub."""
        if v is None:
            return v
        path = Path(v).expanduser()
        if (v.startswith(("/", "./", "../", "~")) or path.exists()) and not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            raise ValueError(f"{v!r} {what}: give a save_pretrained directory (with config.json) or a hub id")
        return v


class ModelParams(BaseModel):
    """Policy, reference, reward and value models: the tiny transformer (rlhf/model.py) or a Hugging Face model."""

    model_config = STRICT
    backend: Literal["tiny", "hf"]
    d_model: int = Field(gt=0, le=65_536)
    n_layers: int = Field(gt=0, le=1_000)
    n_heads: int = Field(gt=0, le=1_024)
    hf: HFParams | None = None  # required by, and only by, backend hf

    @model_validator(mode="after")
    def _heads(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if (self.backend == "hf") != (self.hf is not None):
            raise ValueError("backend 'hf' needs the 'hf' block, and only backend 'hf' takes one")
        return self


class SFTParams(BaseModel):
    model_config = STRICT
    steps: int = Field(gt=0, le=10_000_000)
    batch_size: int = Field(gt=0, le=1_000_000)
    lr: FiniteFloat = Field(gt=0.0, le=1.0)
    adam_eps: FiniteFloat = Field(gt=0.0, le=1.0, description="Adam's epsilon")
    n_heldout: int = Field(gt=0, description="the last demonstrations, held out for NLL")


class RMParams(BaseModel):
    model_config = STRICT
    n_pairs: int = Field(gt=0, le=10_000_000)
    n_heldout_pairs: int = Field(ge=20, le=1_000_000, description="enough for an accuracy and a correlation")
    label_noise: FiniteFloat = Field(ge=0.0, description="Bradley-Terry temperature on gold differences")
    steps: int = Field(gt=0, le=10_000_000)
    batch_size: int = Field(gt=0, le=1_000_000)
    lr: FiniteFloat = Field(gt=0.0, le=1.0)
    adam_eps: FiniteFloat = Field(gt=0.0, le=1.0, description="Adam's epsilon")


# Bounds of ppo values beyond PPOConfig's own: what a torch generator takes (seeds), and floats that stay finite
# through the loss (1/temperature scales logits; vf_coef and missing_eos_score enter the loss and the returns).
PPO_BOUNDS = {
    "eval_seed": (0, MAX_SEED),
    "temperature": (0.01, 100),
    "vf_coef": (0, 100),
    "missing_eos_score": (-100, 100),
    "cliprange": (0, 100),
    "cliprange_value": (0, 1_000_000),
}


class PPODefaults(PPOConfig):
    """The ``ppo`` section: every PPOConfig field except ``kl`` and ``seed``, which come from the grid cell."""

    kl: object = None  # refused below: the grid supplies it
    seed: object = None

    @model_validator(mode="after")
    def _no_cell_keys(self):
        bad = {"kl", "seed"} & self.model_fields_set
        if bad:
            raise ValueError(f"{', '.join(sorted(bad))} belong in 'grid' (arms, coefs, seeds), not in 'ppo'")
        if self.eval_every > self.iterations:
            raise ValueError(f"eval_every ({self.eval_every}) must be <= iterations ({self.iterations})")
        return self

    @field_validator(*PPO_BOUNDS)
    @classmethod
    def _bounded(cls, v, info):
        """The values the training loop turns into overflows or a generator refuses (PPO_BOUNDS)."""
        lo, hi = PPO_BOUNDS[info.field_name]
        if v is not None and not lo <= v <= hi:
            raise ValueError(f"must be in [{lo}, {hi}] (got {v!r})")
        return v

    @field_validator("diagnostics")
    @classmethod
    def _diagnostics_seed(cls, d):
        if d is not None and d.seed > MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}] (got {d.seed})")
        return d


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


class MatchedParams(BaseModel):
    """The matched-KL cells: every arm steered by the adaptive controller to each task's kl_targets."""

    model_config = STRICT
    init_coef: FiniteFloat = Field(gt=0.0, le=1_000.0, description="the controller's initial coefficient")
    horizon: int = Field(gt=0, le=100_000_000, description="controller horizon (episodes)")


ROLES = ("coef", "control", "tuned", "target")  # what the calibration stage fixes for a design cell (grid.design)


class Grid(BaseModel):
    """The arms (the same for every task), the PPO seeds within each task instance, the matched-KL controller, the
    calibration cells and the evaluation design.

    Calibration cells (each task's calibration instances): the no-KL baseline and every ``calibration_arms`` arm at
    every ``<task>.calibration.coefs``. Evaluation cells (each task's ``instances``): the no-KL baseline, every
    ``design`` entry ``<arm>-<role>`` (the arm at the value the calibration stage fixed for the role: ``coef`` the
    reference arm's best coefficient, ``control`` the coefficient of the margin-sized positive control, ``tuned``
    the arm's own best coefficient, ``target`` steered to the calibrated KL target), and, for exploration, every arm
    at the task's ``coefs`` and ``kl_targets``. All x seeds."""

    model_config = STRICT
    arms: dict[str, Arm]
    seeds: list[Seed]
    matched: MatchedParams
    calibration_arms: list[str] = Field(description="arms run at every calibration coefficient")
    design: list[str] = Field(description="evaluation cells per instance and seed: '<arm>-<role>'")

    @model_validator(mode="after")
    def _design(self):
        for a in self.calibration_arms:
            if a not in self.arms:
                raise ValueError(f"grid.calibration_arms: {a!r} is not an arm; allowed: {', '.join(self.arms)}")
        _distinct("calibration arm", self.calibration_arms)
        _distinct("design cell", self.design)
        for entry in self.design:
            arm, _, role = entry.rpartition("-")
            if arm not in self.arms or role not in ROLES:
                raise ValueError(
                    f"grid.design: {entry!r} must be '<arm>-<role>' with an arm of grid.arms ({', '.join(self.arms)}) "
                    f"and a role of {', '.join(ROLES)}"
                )
            if role == "tuned" and arm not in self.calibration_arms:
                raise ValueError(f"grid.design: {entry!r} is tuned on calibration, so {arm} must be a calibration arm")
        return self

    def design_cells(self) -> list[tuple[str, str]]:
        """(arm, role) of every design entry, in order."""
        return [tuple(e.rpartition("-")[::2]) for e in self.design]

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


def _distinct(name: str, values: list) -> list:
    dup = sorted({v for v in values if values.count(v) > 1})
    if dup:
        raise ValueError(f"duplicate {name} {dup[0]} in {values}")
    return values


# A coefficient or KL target as written: an int stays an int (`3`), a float a float (`3.0`), because DVC names a
# matrix stage by the value as parsed (`…-3-0` and `…-3.0-0`); ablations.grid.stage_name then makes DVC's name for
# either. The two spellings of one value are one value (refused as a duplicate).
Strength = Annotated[int | FiniteFloat, Field(union_mode="smart")]


class TargetRule(BaseModel):
    """The matched-KL target: ``fraction`` x the no-KL runs' exact KL ``at`` their gold peak or at the end (median
    over the calibration instances)."""

    model_config = STRICT
    at: Literal["peak", "final"]
    fraction: FiniteFloat = Field(gt=0.0, le=10.0)


class CalibrationParams(BaseModel):
    """What the calibration stage (ablations/calibration.py) fixes on the calibration instances, before any
    evaluation cell runs: the margins (``margin_fraction`` x the no-KL gain in gold, the no-KL runs' ``gain`` -- peak
    or final gold -- minus SFT gold), the KL target, each arm's best coefficient among ``coefs``, and the coefficient
    of the margin-sized positive control."""

    model_config = STRICT
    instances: list[Seed] = Field(description="task seeds of the calibration instances (disjoint from instances)")
    coefs: list[Strength] = Field(description="coefficients every calibration arm runs at (at least 3)")
    margin_fraction: FiniteFloat = Field(gt=0.0, le=1.0, description="margin = this x the no-KL gold gain")
    gain: Literal["peak", "final"] = Field(description="the no-KL gain: peak gold or final gold, minus SFT gold")
    target: TargetRule

    @field_validator("instances")
    @classmethod
    def _instances(cls, v):
        return _distinct("calibration instance", v)

    @field_validator("coefs")
    @classmethod
    def _coefs(cls, coefs):
        if len(coefs) < 3:
            raise ValueError(f"must list at least 3 coefficients to choose from (got {coefs})")
        if any(not 0 < c <= 1_000 for c in coefs):
            raise ValueError(f"every coefficient must be in (0, 1000] (got {coefs})")
        return _distinct("coefficient", coefs)


class TaskSection(BaseModel):
    """What every task section has: its instances (each a task seed with its own data and SFT model), models, SFT,
    PPO values and the strengths of its KL arms (fixed coefficients, and KL targets for the matched cells).
    Coefficients and targets are per task because each task's KL lives on its own scale."""

    model_config = STRICT
    instances: list[Seed]
    model: ModelParams
    sft: SFTParams
    ppo: PPODefaults
    calibration: CalibrationParams
    coefs: list[Strength] = Field(description="exploratory fixed cells: every arm at each of these coefficients")
    kl_targets: list[Strength] = Field(description="exploratory matched-KL cells: nats per response")

    @field_validator("instances")
    @classmethod
    def _instances(cls, v):
        return _distinct("instance", v)

    @field_validator("coefs")
    @classmethod
    def _coefs(cls, coefs):
        bad = [c for c in coefs if not 0 < c <= 1_000]
        if bad:
            raise ValueError(
                f"every coefficient must be in (0, 1000] (got {bad[0]}); the no-KL baseline runs by itself"
            )
        return _distinct("coefficient", coefs)

    @field_validator("kl_targets")
    @classmethod
    def _targets(cls, v):
        if any(not 0 < x <= 1_000 for x in v):
            raise ValueError(f"every KL target must be in (0, 1000] nats (got {v})")
        return _distinct("KL target", v)

    @property
    def learned_reward(self) -> bool:
        """Whether the task scores with a learned reward model (an ``rm`` section and stage), not a verifier: the one
        test of it (the stages, the grid's upstream chains and the cell all ask here)."""
        return getattr(self, "rm", None) is not None

    @model_validator(mode="after")
    def _sizes(self):
        if bool(self.instances) != bool(self.calibration.instances):
            raise ValueError(
                "instances and calibration.instances must both be empty (the task does not run) or both non-empty "
                f"(got {len(self.instances)} and {len(self.calibration.instances)})"
            )
        both = sorted(set(self.instances) & set(self.calibration.instances))
        if both:
            raise ValueError(
                f"calibration.instances and instances must be disjoint: nothing is judged on an instance it was "
                f"tuned on (both have {both})"
            )
        if self.sft.n_heldout >= self.task.n_demos:
            raise ValueError(
                f"sft.n_heldout ({self.sft.n_heldout}) must be smaller than task.n_demos ({self.task.n_demos}): "
                "SFT trains on the rest"
            )
        work = self.work()
        if work > MAX_WORK:
            raise ValueError(
                f"model x batch x sequence = {work:.2g} (about {self.n_params():.2g} parameters x batch "
                f"{self.max_batch()} x {self.seq_len()} tokens) is above the limit {MAX_WORK:.0e}: make model "
                "(d_model, n_layers), sft/rm/ppo batch_size or the sequence smaller"
            )
        return self

    def seq_len(self) -> int:
        return self.task.prompt_len + self.task.max_new_tokens

    def vocab(self) -> int:
        return 16  # arithmetic: 10 digits, +, -, =, BOS, EOS, PAD (an estimate is enough)

    def max_batch(self) -> int:
        rm = getattr(self, "rm", None)
        return max(self.sft.batch_size, self.ppo.batch_size, 2 * rm.batch_size if rm else 0)

    def n_params(self) -> float:
        """Parameters of one model, estimated from the model section (a pretrained model: not counted, 0)."""
        m, d = self.model, self.model.d_model
        if m.backend == "hf" and m.hf.pretrained is not None:
            return 0.0
        mlp = 3 * d * m.hf.intermediate_size if m.backend == "hf" else 8 * d * d
        return m.n_layers * (4 * d * d + mlp) + (self.vocab() + self.seq_len()) * d

    def work(self) -> float:
        return self.n_params() * self.max_batch() * self.seq_len()

    def ppo_config(self, kl: KLConfig, seed: int, **overrides) -> PPOConfig:
        """The PPOConfig of one cell: this task's ppo values (``overrides``: an arm's algorithm/group_size)."""
        return PPOConfig(**{**self.ppo.model_dump(exclude={"kl", "seed"}), **overrides}, kl=kl, seed=seed)


class GrammarParams(TaskSection):
    """Task 1, RLHF (rlhf/task.py): PPO optimises a proxy reward model trained on gold-labelled preferences, in
    place of the exact gold reward it approximates. Each instance has its own grammar, prompts, demonstrations, SFT
    model and reward model."""

    task: GrammarTaskParams
    rm: RMParams

    def vocab(self) -> int:
        return self.task.n_words + 2

    @model_validator(mode="after")
    def _tokens(self):
        hf = self.model.hf
        if hf is not None and hf.tokens is not None and len(hf.tokens) != self.task.n_words + 2:
            raise ValueError(
                f"model.hf.tokens must list BOS, EOS and the {self.task.n_words} words ({self.task.n_words + 2} "
                f"tokens; got {len(hf.tokens)})"
            )
        return self


MIN_POOL_SHARE, MIN_POOL_PAIRS = 0.01, 10  # rlhf/arithmetic.py draws each pool by rejection: it must be there


class ArithmeticTaskParams(BaseModel):
    """Fixed-width addition with subtraction held out (rlhf/arithmetic.py has the verifier and the splits); the
    instance seeds the split of operand pairs and every draw."""

    model_config = STRICT
    n_digits: int = Field(ge=1, le=4)
    max_new_tokens: int = Field(ge=3, le=1_000, description="at least n_digits + 2: the answer digits and EOS")
    carry_drop: FiniteFloat = Field(ge=0.0, le=1.0, description="chance a demonstration drops each carry/borrow")
    sub_fraction: FiniteFloat = Field(ge=0.0, le=1.0, description="share of subtractions among demonstrations")
    eval_fraction: FiniteFloat = Field(gt=0.0, lt=1.0, description="share of operand pairs held out for evaluation")
    rl_fraction: FiniteFloat = Field(gt=0.0, lt=1.0, description="share of operand pairs whose sums are RL prompts")
    format_penalty: FiniteFloat = Field(ge=0.0, le=100.0, description="gold cost of a malformed response")
    n_demos: int = Field(gt=0, le=10_000_000)
    n_train_prompts: int = Field(gt=0, le=10_000_000)
    n_eval_prompts: int = Field(gt=0, le=1_000_000, description="each for the in-domain and the OOD set")

    @model_validator(mode="after")
    def _fits(self):
        if self.max_new_tokens < self.n_digits + 2:
            raise ValueError(
                f"max_new_tokens must be >= n_digits + 2 = {self.n_digits + 2} (got {self.max_new_tokens})"
            )
        if self.eval_fraction + self.rl_fraction >= 1:
            raise ValueError("eval_fraction + rl_fraction must leave a share of operand pairs for the SFT pool")
        pairs = 10 ** (2 * self.n_digits)
        shares = {"eval_fraction": self.eval_fraction, "rl_fraction": self.rl_fraction}
        shares["1 - eval_fraction - rl_fraction"] = 1 - self.eval_fraction - self.rl_fraction
        for name, share in shares.items():
            if share < MIN_POOL_SHARE or share * pairs < MIN_POOL_PAIRS:
                raise ValueError(
                    f"{name} = {share:g} leaves too few of the {pairs} operand pairs (about {share * pairs:.3g}); "
                    f"each pool needs a share >= {MIN_POOL_SHARE} and >= {MIN_POOL_PAIRS} pairs"
                )
        return self

    @property
    def prompt_len(self) -> int:
        return 2 * self.n_digits + 3  # rlhf/arithmetic.py ArithmeticTask.prompt_len


class ArithmeticParams(TaskSection):
    """Task 2, RLVR (rlhf/arithmetic.py): PPO optimises the exact verifier itself, no reward model. Gold is
    in-domain accuracy (addition), ood_gold accuracy on the operation RL never sees (subtraction)."""

    task: ArithmeticTaskParams


class MLflowParams(BaseModel):
    model_config = STRICT
    experiment: str = Field(min_length=1, max_length=200, pattern=r"^\S(.*\S)?$")


class Experiment(BaseModel):
    """params.yaml as far as the cells are concerned: ``analysis`` is read as a mapping here and judged by
    ablations.config.Params (ablations/protocol_params.py)."""

    model_config = STRICT
    grammar: GrammarParams
    arithmetic: ArithmeticParams
    grid: Grid
    analysis: dict
    mlflow: MLflowParams

    @model_validator(mode="after")
    def _cross(self):
        if not self.tasks():
            raise ValueError(f"no task runs: give at least one of {', '.join(TASKS)} instances")
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

    def tasks(self) -> dict[str, TaskSection]:
        """The task sections that run, by task name (a task with no instances does not run)."""
        return {name: section for name in TASKS if (section := getattr(self, name)).instances}


TASKS = ("grammar", "arithmetic")  # the task sections of params.yaml, in report order (rlhf/tasks.py names them)


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
        _plain_yaml(YAML(typ="safe", pure=True).compose(text), path)
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
    except ValidationError as e:
        errors = e.errors()
        more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
        raise ParamsError(f"{path}: {_message(errors[0], model)}{more}") from None


def load_experiment(path: Path | str = PARAMS_FILE) -> Experiment:
    """params.yaml's what-to-run sections, validated (a cell stage's check; the runner checks the whole file with
    ablations.config.load_params before any compute)."""
    return validate(path, Experiment)
