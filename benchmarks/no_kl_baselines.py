"""Pre-registration runs: the no-KL baseline of every task instance, run before any KL arm, from which the protocol's
margins and KL targets in params.yaml were fixed (see the comments there).

    python benchmarks/no_kl_baselines.py grammar 0 1 2 3 4 5
    python benchmarks/no_kl_baselines.py arithmetic 0 1 2

Per instance it builds data, SFT (and the reward model) as the pipeline does (pipelines/upstream.py), runs one no-KL
PPO cell (seed 0, the task's ppo values) and prints SFT gold, the peak of held-out gold with its iteration and exact
KL, and the final gold and KL. Writes benchmarks/out/no_kl_baselines_<task>.json (git-ignored); the summary that
fixed the protocol is benchmarks/no_kl_baselines.json.
"""

from __future__ import annotations

import pipelines  # noqa: F401  (first: pins the CPU math paths before torch loads, as every stage does)

# isort: split
import copy
import json
import sys
import time
from pathlib import Path

from ablations.config import load_params
from pipelines.common import eval_sets, setup
from pipelines.upstream import build_upstream
from rlhf.config import no_kl
from rlhf.ppo import train_ppo

OUT = Path(__file__).resolve().parent / "out"


def main(task_name: str, instances: list[int]) -> None:
    dev = setup()
    params = load_params()
    section = getattr(params, task_name)
    out = {}
    for i in instances:
        t0 = time.process_time()
        data, task, sft, rm, metrics = build_upstream(params, task_name, i, dev)
        t1 = time.process_time()
        cfg = section.ppo_config(no_kl(), 0)
        res = train_ppo(copy.deepcopy(sft), sft, rm, task, data["train_prompts"], eval_sets(data, dev), cfg)
        t2 = time.process_time()
        ev = res["evals"]
        peak = max(ev, key=lambda e: e["gold"])
        row = {
            "sft_gold": ev[0]["gold"],
            "peak_gold": peak["gold"],
            "peak_iteration": peak["iteration"],
            "peak_kl": peak["kl"],
            "final_gold": ev[-1]["gold"],
            "final_kl": ev[-1]["kl"],
        }
        out[i] = {**row, "evals": ev, "metrics": metrics, "upstream_cpu_s": t1 - t0, "ppo_cpu_s": t2 - t1}
        print(task_name, i, json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
        OUT.mkdir(exist_ok=True)
        (OUT / f"no_kl_baselines_{task_name}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2:]])
