"""Calibration of the arithmetic (RLVR) task: SFT accuracy in and out of domain, then short PPO runs with the verifier.

    python benchmarks/arithmetic_calibration.py [--seeds 0 1 2] [--runs none reward_k1@0.3 loss_k3@0.3] [--smoke]

1. Builds ``rlhf.arithmetic.Arithmetic`` with the suggested values below (the lead moves them to params.yaml),
   draws the demonstrations and the train / eval / ood prompts from one generator (``DATA['seed']``).
2. SFT (``rlhf.sft.train_sft``) at the suggested model size; reports wall time and the accuracy of samples at
   the PPO temperature on the held-out in-domain ('eval') and out-of-domain ('ood') prompts.
3. PPO (``rlhf.ppo.train_ppo`` with params.yaml's ``arithmetic.ppo`` section and ``PPO_OVERRIDES``) for each
   arm@coef and seed, scored by the verifier (a verifier task: no reward model; ``train_ppo`` initialises the
   value model from the SFT backbone with a fresh scalar head). Every evaluation reports accuracy, format errors
   and the exact KL(pi || pi_ref) summed over the response, on the in-domain and the OOD ('ood_*') prompts.
``--smoke``: a few seconds' run at toy sizes (tests/test_benchmarks.py), written to --out.
"""

from __future__ import annotations

import pipelines  # noqa: F401  (first: pins the CPU math paths before torch loads, as every stage does)

# isort: split
import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch

from ablations.config import load_params
from pipelines.common import setup
from rlhf.arithmetic import Arithmetic
from rlhf.config import KLConfig, PPOConfig, no_kl
from rlhf.kl import entropy, full_kl, masked_mean
from rlhf.model import TinyLM, generate, response_logits
from rlhf.ppo import train_ppo
from rlhf.sft import train_sft
from rlhf.task import EOS, response_mask

# The suggested params.yaml values (see the report / module docstring of rlhf/arithmetic.py).
TASK = dict(
    n_digits=3,
    max_new_tokens=5,
    carry_drop=0.4,
    sub_fraction=0.5,
    eval_fraction=0.1,
    rl_fraction=0.3,
    split_seed=0,
    format_penalty=0.0,
)
DATA = dict(seed=0, n_demos=20000, n_train_prompts=2048, n_eval_prompts=512)
MODEL = dict(d_model=64, n_layers=2, n_heads=4)
SFT = dict(steps=3000, batch_size=64, lr=3e-3, adam_eps=1e-8, seed=0)
# --smoke: toy sizes, so that a test can run the whole script in seconds
SMOKE = dict(
    data=dict(n_demos=200, n_train_prompts=16, n_eval_prompts=16), model=dict(d_model=16, n_layers=1, n_heads=2)
)
SMOKE_SFT, SMOKE_PPO = dict(steps=2, batch_size=16), dict(iterations=1, batch_size=8, minibatch_size=4, epochs=1)
# params.yaml's ppo lr (1e-3) makes accuracy and KL oscillate on this task (and one reward_k1 seed collapsed to
# 10 nats); 3e-4 rises smoothly on every seed. Everything else is params.yaml's ppo section.
PPO_OVERRIDES = dict(lr=3e-4)
ARMS = {
    "none": lambda coef: no_kl(),
    "reward_k1": lambda coef: KLConfig(target="reference", placement="reward", estimator="k1", coef=coef),
    "loss_k3": lambda coef: KLConfig(target="reference", placement="loss", estimator="k3", coef=coef),
}


def build(task: Arithmetic, seed: int, n_demos: int, n_train: int, n_eval: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    demo_prompts, demo_responses = task.demonstrations(n_demos, g)
    return {
        "demo_prompts": demo_prompts,
        "demo_responses": demo_responses,
        "train_prompts": task.sample_prompts("train", n_train, g),
        "eval_prompts": task.sample_prompts("eval", n_eval, g),
        "ood_prompts": task.sample_prompts("ood", n_eval, g),
    }


@torch.no_grad()
def measure(task: Arithmetic, policy, ref_policy, prompts, temperature: float, seed: int) -> dict[str, float]:
    """Accuracy, format errors, exact KL to the reference (summed over the response), entropy, length."""
    g = torch.Generator(device=prompts.device).manual_seed(seed)
    responses = generate(policy, prompts, task.max_new_tokens, temperature, g, EOS)  # (n, t)
    mask = response_mask(responses)
    logits = response_logits(policy, prompts, responses, temperature)  # (n, t, V)
    ref_logits = response_logits(ref_policy, prompts, responses, temperature)
    m = task.metrics(prompts, responses)
    return {
        "gold": task.gold(prompts, responses).mean().item(),
        "accuracy": m["accuracy"].mean().item(),
        "format_error": m["format_error"].mean().item(),
        "kl": (full_kl(logits, ref_logits) * mask).sum(1).mean().item(),
        "entropy": masked_mean(entropy(logits), mask).item(),
        "length": mask.sum(1).mean().item(),
    }


def run_sft(task: Arithmetic, data: dict, device, model_size: dict, sft: dict) -> tuple[TinyLM, dict, list[float]]:
    """SFT at the suggested size; returns the model, {"wall": s, "cpu": s} and the per-step losses (CPU time of
    this process is what one thread costs when the machine is shared; wall time includes waiting for a core)."""
    torch.manual_seed(sft["seed"])
    model = TinyLM(task.vocab_size, task.prompt_len + task.max_new_tokens, **model_size).to(device)
    g = torch.Generator(device=device).manual_seed(sft["seed"])
    start, cpu = time.perf_counter(), time.process_time()
    losses = train_sft(
        model,
        data["demo_prompts"].to(device),
        data["demo_responses"].to(device),
        sft["steps"],
        sft["batch_size"],
        sft["lr"],
        g,
        adam_eps=sft["adam_eps"],
    )
    seconds = {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    return model.eval(), seconds, losses


def sizes(smoke: bool) -> tuple[dict, dict, dict, dict]:
    """(data, model, SFT, PPO overrides): the suggested values, or the toy ones of ``--smoke``."""
    if not smoke:
        return DATA, MODEL, SFT, PPO_OVERRIDES
    return {**DATA, **SMOKE["data"]}, SMOKE["model"], {**SFT, **SMOKE_SFT}, {**PPO_OVERRIDES, **SMOKE_PPO}


def ppo_run(task, sft, data: dict, cfg: PPOConfig, device) -> dict:
    """One PPO run on the verifier (no reward model), measured on the in-domain and the OOD prompts."""
    sets = {"": data["eval_prompts"].to(device), "ood": data["ood_prompts"].to(device)}
    start, cpu = time.perf_counter(), time.process_time()
    out = train_ppo(copy.deepcopy(sft), sft, None, task, data["train_prompts"].to(device), sets, cfg)
    return {"seconds": {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}, "evals": out["evals"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", nargs="+", default=["none", "reward_k1@0.3", "loss_k3@0.3"], help="arm@coef")
    ap.add_argument("--out", default="benchmarks/arithmetic_calibration.json")
    ap.add_argument("--smoke", action="store_true", help="toy sizes, one PPO iteration (a test that it runs)")
    args = ap.parse_args()
    device = setup()
    ppo_defaults = load_params().arithmetic.ppo
    data_size, model_size, sft_params, overrides = sizes(args.smoke)
    task = Arithmetic(**TASK)
    n = data_size["n_demos"], data_size["n_train_prompts"], data_size["n_eval_prompts"]
    data = build(task, data_size["seed"], *n)
    sft, sft_seconds, losses = run_sft(task, data, device, model_size, sft_params)
    temperature, eval_seed = ppo_defaults.temperature, ppo_defaults.eval_seed
    ev, ood = data["eval_prompts"].to(device), data["ood_prompts"].to(device)
    ceiling = {
        split: ((1 - task.carry_drop) ** task.n_carries(p).double()).mean().item()
        for split, p in (("eval", data["eval_prompts"]), ("ood", data["ood_prompts"]))
    }
    result = {
        "task": TASK,
        "data": data_size,
        "model": model_size,
        "sft": sft_params,
        "ppo_overrides": overrides,
        "sft_seconds": sft_seconds,
        "sft_threads": torch.get_num_threads(),
        "load_average_after_sft": list(os.getloadavg()),
        "sft_final_loss": sum(losses[-100:]) / len(losses[-100:]),
        "sft_eval": measure(task, sft, sft, ev, temperature, eval_seed),
        "sft_ood": measure(task, sft, sft, ood, temperature, eval_seed),
        "demo_imitation_accuracy": ceiling,  # E[(1 - carry_drop)^C]: a perfect imitator of the demonstrations
        "ppo": {},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "ppo"}, indent=1), flush=True)
    base = {**ppo_defaults.model_dump(exclude={"kl", "seed"}), **overrides}
    for name in args.runs:
        arm, _, coef = name.partition("@")
        for seed in args.seeds:
            cfg = PPOConfig(**base, kl=ARMS[arm](float(coef or 0)), seed=seed)
            run = result["ppo"].setdefault(name, {})[str(seed)] = ppo_run(task, sft, data, cfg, device)
            first, last = run["evals"][0], run["evals"][-1]
            print(
                f"{name} seed {seed}: accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f}, "
                f"ood {first['ood_accuracy']:.3f} -> {last['ood_accuracy']:.3f}, kl {last['kl']:.2f} "
                f"(ood {last['ood_kl']:.2f}), format errors {last['format_error']:.3f}",
                flush=True,
            )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
