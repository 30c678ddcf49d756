"""Stage `<task>_data@<instance>`: the task instance, its prompts and SFT demonstrations -> data/<task>/<i>/task.pt.

    python -m pipelines.data grammar 0
    python -m pipelines.data arithmetic 0

data/<task>/<i>/task.pt holds {"task": rlhf.tasks.task_state, "demo_prompts", "demo_responses", "train_prompts",
"eval_prompts"} and, for a task with an out-of-domain set, "ood_prompts".
"""

from __future__ import annotations

import torch

from ablations.experiment import ArithmeticTaskParams, GrammarTaskParams
from pipelines.common import data_path, save_checkpoint, setup, upstream_stage_args
from rlhf.arithmetic import Arithmetic
from rlhf.task import make_grammar, sample_prompts, sample_responses
from rlhf.tasks import task_state


def build_grammar(p: GrammarTaskParams, seed: int) -> dict:
    """Grammar instance ``seed``: the language, demonstrations drawn from it, RL and held-out prompts."""
    grammar = make_grammar(**p.grammar_kwargs(seed))
    g = torch.Generator().manual_seed(seed)
    demo_prompts = sample_prompts(grammar, p.n_demos, g)
    return {
        "task": task_state("grammar", grammar),
        "demo_prompts": demo_prompts,
        "demo_responses": sample_responses(grammar, demo_prompts, g),
        "train_prompts": sample_prompts(grammar, p.n_train_prompts, g),
        "eval_prompts": sample_prompts(grammar, p.n_eval_prompts, g),
    }


def build_arithmetic(p: ArithmeticTaskParams, seed: int) -> dict:
    """Arithmetic instance ``seed`` (it also seeds the split of operand pairs): demonstrations of both operations,
    RL prompts (addition), held-out additions and held-out subtractions (the OOD set)."""
    task = Arithmetic(split_seed=seed, **p.model_dump(exclude={"n_demos", "n_train_prompts", "n_eval_prompts"}))
    g = torch.Generator().manual_seed(seed)
    demo_prompts, demo_responses = task.demonstrations(p.n_demos, g)
    return {
        "task": task_state("arithmetic", task),
        "demo_prompts": demo_prompts,
        "demo_responses": demo_responses,
        "train_prompts": task.sample_prompts("train", p.n_train_prompts, g),
        "eval_prompts": task.sample_prompts("eval", p.n_eval_prompts, g),
        "ood_prompts": task.sample_prompts("ood", p.n_eval_prompts, g),
    }


BUILDERS = {"grammar": build_grammar, "arithmetic": build_arithmetic}


def build(task: str, p, seed: int) -> dict:
    """Instance ``seed`` of ``task`` (its params.yaml ``task`` section ``p``) as tensors and numbers."""
    return BUILDERS[task](p, seed)


def main(argv: list[str] | None = None) -> None:
    _, task, section, instance = upstream_stage_args(argv, "data")
    setup()
    path = data_path(task, instance)
    data = build(task, section.task, instance)
    save_checkpoint(path, data)
    print(f"wrote {path}: {len(data['demo_prompts'])} demonstrations, {len(data['train_prompts'])} RL prompts")


if __name__ == "__main__":
    main()
