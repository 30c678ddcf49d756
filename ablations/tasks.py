"""The tasks, registered in one place: each task's params.yaml section (its schema), the metrics a protocol may
compare, and whether it has a learned reward model. Torch-free (the params check imports it); the task itself (its
class and how an instance is built) is registered under the same name in rlhf/tasks.py.

Adding a task: its module in rlhf (the task class and its ``build``) and one line in rlhf/tasks.py; its section
schema and one ``TASKS`` line here; its section (and its ``analysis.tasks`` protocol) in params.yaml; then
``python -m pipelines.dvcyaml`` writes its stages into dvc.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field, FiniteFloat, model_validator

from ablations.section import STRICT, RMParams, TaskSection, learned_reward


@dataclass(frozen=True)
class TaskSpec:
    """One task as the experiment sees it: its params.yaml section (a TaskSection with the task's ``task`` values,
    and an ``rm`` section if it scores with a learned reward model) and the metrics of its evaluation
    (rlhf/evaluate.py) that a protocol may compare."""

    section: type[TaskSection]
    metrics: tuple[str, ...]

    @property
    def learned_reward(self) -> bool:
        """A learned reward model (an ``rm`` section and stage) rather than a verifier."""
        return learned_reward(self.section)


class GrammarTaskParams(BaseModel):
    """The synthetic language and its gold reward (rlhf/grammar.py has the formula); its seed is the task instance."""

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


class GrammarParams(TaskSection):
    """Task 1, RLHF (rlhf/grammar.py): PPO optimises a proxy reward model trained on gold-labelled preferences, in
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

    def vocab(self) -> int:
        return 16  # 10 digits, +, -, =, BOS, EOS, PAD (an estimate is enough)

    @model_validator(mode="after")
    def _tokens(self):
        hf = self.model.hf
        if hf is not None and hf.tokens is not None and len(hf.tokens) != 15:
            raise ValueError(
                "model.hf.tokens must list BOS, EOS, the digits 0-9, '+', '-' and '=' "
                f"(15 tokens; got {len(hf.tokens)})"
            )
        return self


# The TOST margin of a metric must be below its plausible range, or everything is "equivalent": accuracies and
# shares are in [0, 1], so at most 0.5 (half the range); grammar gold and proxy are word qualities ~ N(0, 1) per
# word, so at most 2.0 (two SDs; PPO's largest gain over SFT on this task is 0.574). Only these metrics exist.
TASKS = {  # the task sections of params.yaml by name, in report order (rlhf/tasks.py registers the same names)
    "grammar": TaskSpec(GrammarParams, ("gold", "proxy", "illegal", "empty", "truncated")),
    "arithmetic": TaskSpec(ArithmeticParams, ("gold", "ood_gold", "empty", "truncated")),
}
