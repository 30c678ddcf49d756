"""The library on a CUDA device, the way a GPU stage runs it (skipped without one): SFT, reward model and PPO on the
grammar task, PPO with gradient diagnostics on the verifier task (whose value model is initialised from the SFT
backbone), with prompts on the device and each task's own tables on the CPU, as the stages keep them. The first
GPU runs failed at exactly these places. Run to run bit-identity on CUDA: tests/test_determinism.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlhf import reward_model as R
from rlhf.arithmetic import Arithmetic
from rlhf.config import DiagnosticsConfig
from rlhf.grammar import sample_prompts, sample_responses
from rlhf.model import TinyLM, generate
from rlhf.ppo import train_ppo
from rlhf.sft import train_sft
from rlhf.task import EOS, preference_pairs
from tests.conftest import ARITHMETIC as FIELDS

from ..conftest import small_ppo_config, tiny_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = torch.device("cuda")


def finite_summary(out: dict) -> bool:
    return all(math.isfinite(v) for v in out["summary"].values() if isinstance(v, float))


def test_sft_reward_model_and_ppo_on_the_grammar_task(grammar):
    cpu = torch.Generator().manual_seed(0)
    prompts = sample_prompts(grammar, 64, cpu)
    responses = sample_responses(grammar, prompts, cpu).to(DEV)
    prompts, g = prompts.to(DEV), torch.Generator(DEV).manual_seed(0)
    lm = tiny_lm(grammar).to(DEV)
    train_sft(lm, prompts, responses, steps=3, batch_size=16, lr=1e-2, generator=g, adam_eps=1e-8)
    a, b = (generate(lm, prompts, grammar.max_new_tokens, 1.0, g, EOS) for _ in range(2))
    chosen, rejected, _ = preference_pairs(grammar, prompts, a, b, 0.1, g)
    rm = R.init_reward_model(lm)
    R.train_reward_model(rm, prompts, chosen, rejected, 3, 16, 1e-2, g, adam_eps=1e-8)
    R.normalize(rm.eval(), prompts, a)
    out = train_ppo(copy.deepcopy(lm), lm, rm, grammar, prompts, prompts[:16], small_ppo_config())
    assert finite_summary(out) and out["summary"]["final_kl"] >= 0.0


def test_ppo_with_diagnostics_on_the_verifier_task():
    task = Arithmetic(**FIELDS)
    cpu = torch.Generator().manual_seed(0)
    train = task.sample_prompts("train", 64, cpu).to(DEV)
    evals = {"": task.sample_prompts("eval", 16, cpu).to(DEV), "ood": task.sample_prompts("ood", 16, cpu).to(DEV)}
    torch.manual_seed(0)
    lm = TinyLM(task.vocab_size, task.prompt_len + task.max_new_tokens, d_model=16, n_layers=1, n_heads=2).to(DEV)
    diagnostics = DiagnosticsConfig(at=[1], n_true=16, n_minibatches=2, seed=0)
    cfg = small_ppo_config(kl=dict(placement="loss", estimator="k3"), diagnostics=diagnostics)
    out = train_ppo(copy.deepcopy(lm), lm, None, task, train, evals, cfg)
    assert finite_summary(out) and out["diagnostics"]
