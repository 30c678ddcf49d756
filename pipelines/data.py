"""Stage `<task>_data@<instance>`: the synthetic language, prompts and SFT demonstrations -> data/<task>/<i>/task.pt.

python -m pipelines.data grammar 0
"""

from __future__ import annotations

import dataclasses

import torch

from ablations.config import GrammarTaskParams
from pipelines.common import data_path, save_checkpoint, setup, upstream_stage_args
from rlhf.task import make_grammar, sample_prompts, sample_responses


def build(p: GrammarTaskParams, seed: int) -> dict:
    """The task instance ``seed`` as a dict of tensors and numbers (what data/<task>/<seed>/task.pt holds)."""
    grammar = make_grammar(**p.grammar_kwargs(seed))
    g = torch.Generator().manual_seed(seed)
    demo_prompts = sample_prompts(grammar, p.n_demos, g)
    return {
        "grammar": dataclasses.asdict(grammar),
        "demo_prompts": demo_prompts,
        "demo_responses": sample_responses(grammar, demo_prompts, g),
        "train_prompts": sample_prompts(grammar, p.n_train_prompts, g),
        "eval_prompts": sample_prompts(grammar, p.n_eval_prompts, g),
    }


def main(argv: list[str] | None = None) -> None:
    _, task, section, instance = upstream_stage_args(argv, "data")
    setup()
    path = data_path(task, instance)
    save_checkpoint(path, build(section.task, instance))
    print(f"wrote {path}: {section.task.n_words} words, {section.task.n_demos} demonstrations")


if __name__ == "__main__":
    main()
