"""Stage `<task>_data@<instance>`: the task instance, its prompts and SFT demonstrations -> data/<task>/<i>/task.pt.

    python -m pipelines.data grammar 0
    python -m pipelines.data arithmetic 0

data/<task>/<i>/task.pt holds {"task": rlhf.tasks.task_state, "demo_prompts", "demo_responses", "train_prompts",
"eval_prompts"} and, for a task with an out-of-domain set, "ood_prompts" (each task's ``build``, rlhf/tasks.py).
"""

from __future__ import annotations

from pydantic import BaseModel

from pipelines.common import data_path, save_checkpoint, setup, upstream_stage_args
from rlhf.tasks import build_instance


def build(task: str, p: BaseModel, seed: int) -> dict:
    """Instance ``seed`` of ``task`` (its params.yaml ``task`` section ``p``) as tensors and numbers."""
    return build_instance(task, seed, p.model_dump())


def main(argv: list[str] | None = None) -> None:
    _, task, section, instance = upstream_stage_args(argv, "data")
    setup()
    path = data_path(task, instance)
    data = build(task, section.task, instance)
    save_checkpoint(path, data)
    print(f"wrote {path}: {len(data['demo_prompts'])} demonstrations, {len(data['train_prompts'])} RL prompts")


if __name__ == "__main__":
    main()
