"""Stage `<task>_eval0@<instance>`: the iteration-0 evaluation shared by every cell -> models/<task>/<i>/eval0.json

    python -m pipelines.eval0 grammar 100

Every cell of a task instance starts from its SFT policy and measures it (``rlhf.evaluate``) on the instance's
held-out prompts with the same sampling seed and temperature: its iteration-0 row of evals.csv is the same in every
cell. This stage measures it once; each cell reads it (``pipelines.ppo.initial_eval``) instead of measuring again
(issue 28). The file is {"made_with": the ppo values the evaluation reads (``READS``, this stage's params in
dvc.yaml), "eval": the measurement}: a cell whose config has other values there measures iteration 0 itself. Its
floats are written by ``json`` (the shortest repr that reads back to the same float) and its keys in the
measurement's order (the columns of evals.csv), so a cell's outputs are byte for byte those of measuring it itself.
"""

from __future__ import annotations

import json

from ablations.tasks import TASKS
from pipelines.common import eval0_path, eval_sets, load_instance, setup, upstream_stage_args, write_atomic
from rlhf.evaluate import evaluate

READS = ("temperature", "eval_seed")  # the PPOConfig values rlhf.evaluate.evaluate reads (with the instance's data)


def main(argv: list[str] | None = None) -> None:
    _, task, section, instance = upstream_stage_args(argv, "eval0")
    device = setup()
    data, t, sft, reward_model = load_instance(task, instance, section.model, TASKS[task].learned_reward, device)
    made_with = {k: getattr(section.ppo, k) for k in READS}
    # the policy of iteration 0 is the SFT model itself, the reference too (a cell's policy is a copy of it)
    sets, temperature, seed = eval_sets(data, device), made_with["temperature"], made_with["eval_seed"]
    measured = evaluate(sft, sft, reward_model, t, sets, temperature, seed)
    path = eval0_path(task, instance)
    write_atomic(path, json.dumps({"made_with": made_with, "eval": {"iteration": 0, **measured}}, indent=2) + "\n")
    print(f"wrote {path}: " + ", ".join(f"{k} {v:.3f}" for k, v in measured.items() if k in ("gold", "proxy", "kl")))


if __name__ == "__main__":
    main()
