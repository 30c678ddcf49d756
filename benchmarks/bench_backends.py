"""Tiny vs Hugging Face backend on CPU at the same size: sampling and training tokens/s on one thread.

    python benchmarks/bench_backends.py [--repeats 30]

Sizes are params.yaml's grammar task's (vocabulary, prompt and response length, model d_model / n_layers / n_heads,
PPO batch and minibatch). Backends, all with untied LM heads and an MLP of width 4 * d_model:
    tiny      rlhf.model.TinyLM (pre-LN, learned positions, GELU MLP)
    hf-gpt2   transformers GPT-2 of the same shape (TinyLM's architecture, the same number of weights)
    hf-llama  transformers Llama (RMSNorm, RoPE, SwiGLU: three MLP matrices, so about 30% more weights)
Sampling: ``generate`` of a rollout batch (prompts + max_new_tokens, KV cache). Training: one PPO minibatch update
of policy and value model, forward + backward + Adam, as ``bench_ppo.py`` measures it. Each repeat times every
backend in turn (interleaved, so a busy machine slows all alike); medians over repeats; the cost ratio is
hf time / tiny time within this run. CPU math pinned as in a pipeline stage (pipelines/cpu.py). Results: stdout
and benchmarks/out/backends.json (git-ignored).
"""

from __future__ import annotations

import pipelines  # noqa: F401  (first: pins the CPU math paths before torch loads, as every stage does)

# isort: split
import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from ablations.config import load_params
from rlhf import hf
from rlhf.model import ScalarModel, TinyLM, generate, logprobs_from_logits, response_logits
from rlhf.ppo import response_values
from rlhf.task import BOS, EOS

OUT = Path(__file__).resolve().parent / "out" / "backends.json"


def sizes(params) -> dict:
    """The benchmark's shapes, from params.yaml's grammar task."""
    t, m, p = params.grammar.task, params.grammar.model, params.grammar.ppo
    return dict(
        vocab=t.n_words + 2,
        prompt_len=t.prompt_len,
        new_tokens=t.max_new_tokens,
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        batch=p.batch_size,
        minibatch=p.minibatch_size,
    )


def build(backend: str, s: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    max_len = s["prompt_len"] + s["new_tokens"]
    if backend == "tiny":
        return TinyLM(s["vocab"], max_len, s["d_model"], s["n_layers"], s["n_heads"])
    family = backend.removeprefix("hf-")
    return hf.from_config(family, s["vocab"], max_len, s["d_model"], s["n_layers"], s["n_heads"], 4 * s["d_model"])


class Bench:
    """One backend's policy + value model and the two timed operations (``bench_gpu.py`` reuses it on CUDA)."""

    def __init__(self, backend: str, s: dict, device: torch.device | None = None, bf16: bool = False):
        device = torch.device("cpu") if device is None else device
        self.s = s
        self.policy = build(backend, s).to(device).eval()
        self.value = ScalarModel(copy.deepcopy(self.policy))
        if bf16:
            hf.set_autocast(self.policy, torch.bfloat16), hf.set_autocast(self.value, torch.bfloat16)
        self.opt = torch.optim.Adam(list(self.policy.parameters()) + list(self.value.parameters()), lr=1e-6)
        g = torch.Generator().manual_seed(0)
        self.prompts = torch.randint(2, s["vocab"], (s["batch"], s["prompt_len"]), generator=g).to(device)
        self.prompts[:, 0] = BOS
        self.g = torch.Generator(device).manual_seed(1)
        self.responses = self.sample()[: s["minibatch"]]
        self.n_params = sum(p.numel() for p in self.policy.parameters())

    def sample(self) -> torch.Tensor:
        return generate(self.policy, self.prompts, self.s["new_tokens"], 1.0, self.g, EOS)

    def update(self) -> None:
        mb, resp = self.prompts[: self.s["minibatch"]], self.responses
        loss = logprobs_from_logits(response_logits(self.policy, mb, resp, 1.0), resp).mean()
        loss = loss + response_values(self.value, mb, resp).square().mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--backends", nargs="+", default=["tiny", "hf-gpt2", "hf-llama"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    s = sizes(load_params())
    benches = {b: Bench(b, s) for b in args.backends}
    times = {b: {"sample": [], "train": []} for b in benches}
    for _ in range(3):  # warm-up
        for bench in benches.values():
            bench.sample(), bench.update()
    for _ in range(args.repeats):
        for b, bench in benches.items():
            times[b]["sample"].append(timed(bench.sample))
            times[b]["train"].append(timed(bench.update))
    n_sample = s["batch"] * s["new_tokens"]
    n_train = s["minibatch"] * (s["prompt_len"] + s["new_tokens"])
    med = {b: {k: statistics.median(v) for k, v in t.items()} for b, t in times.items()}
    result = {"sizes": s, "threads": torch.get_num_threads(), "repeats": args.repeats, "backends": {}}
    for b, m in med.items():
        row = {
            "params": benches[b].n_params,
            "sampling_tokens_per_s": n_sample / m["sample"],
            "training_tokens_per_s": n_train / m["train"],
        }
        if "tiny" in med and b != "tiny":
            row["sampling_cost_vs_tiny"] = m["sample"] / med["tiny"]["sample"]
            row["training_cost_vs_tiny"] = m["train"] / med["tiny"]["train"]
        result["backends"][b] = row
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
