"""Stage `data`: the synthetic language, prompts and SFT demonstrations -> data/task.pt."""

from __future__ import annotations

import dataclasses

import torch

from ablations.config import TaskParams, load_params
from pipelines.common import DATA, save_checkpoint, setup
from rlhf.task import make_grammar, sample_prompts, sample_responses


def build(p: TaskParams) -> dict:
    """The task as a dict of tensors and numbers (what data/task.pt holds)."""
    grammar = make_grammar(**p.grammar_kwargs())
    g = torch.Generator().manual_seed(p.seed)
    demo_prompts = sample_prompts(grammar, p.n_demos, g)
    return {
        "grammar": dataclasses.asdict(grammar),
        "demo_prompts": demo_prompts,
        "demo_responses": sample_responses(grammar, demo_prompts, g),
        "train_prompts": sample_prompts(grammar, p.n_train_prompts, g),
        "eval_prompts": sample_prompts(grammar, p.n_eval_prompts, g),
    }


def main() -> None:
    p = load_params().task
    setup()
    save_checkpoint(DATA, build(p))
    print(f"wrote {DATA}: {p.n_words} words, {p.n_demos} demonstrations")


if __name__ == "__main__":
    main()
