"""The reward-model stage is task-generic: a second learned-reward task, registered here in both halves of the task
registry (rlhf.tasks.LIBRARY, ablations.tasks.TASKS), gets its data, SFT and reward model through the same stage
code as grammar (pipelines.upstream.build_upstream, i.e. pipelines.data, pipelines.sft, pipelines.rm). And the
correlations rm.json reports are exactly rounded: the same bits under any BLAS kernel."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch
from pydantic import BaseModel, Field
from scipy import stats

from ablations import tasks as schema
from ablations.section import STRICT, RMParams, TaskSection
from pipelines import rm
from pipelines.upstream import build_upstream
from rlhf import tasks as library
from rlhf.task import BOS, EOS, N_SPECIAL, response_mask
from tests.conftest import REPO, repo_params

WORDS = 6


@dataclass(frozen=True)
class Echo:
    """A stand-in learned-reward task: repeat the prompt's last word. Gold: the share of the response's words that
    are that word, times their number over max_new_tokens (a longer echo is better)."""

    prompt_len: int
    max_new_tokens: int

    reward: ClassVar[str] = "learned"

    @property
    def vocab_size(self) -> int:
        return N_SPECIAL + WORDS

    def preference_prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        words = torch.randint(N_SPECIAL, self.vocab_size, (n, self.prompt_len - 1), generator=generator)
        return torch.cat([torch.full((n, 1), BOS), words], 1)

    def metrics(self, prompts, responses) -> dict[str, torch.Tensor]:
        counted = response_mask(responses) * (responses != EOS).float()
        hits = (responses == prompts[:, -1:]).float() * counted
        return {"echo": hits.sum(1) / counted.sum(1).clamp(min=1.0)}

    def gold(self, prompts, responses) -> torch.Tensor:
        counted = response_mask(responses) * (responses != EOS).float()
        return ((responses == prompts[:, -1:]).float() * counted).sum(1) / self.max_new_tokens


def build_echo(seed: int, *, prompt_len: int, max_new_tokens: int, n_demos: int) -> dict:
    task, g = Echo(prompt_len, max_new_tokens), torch.Generator().manual_seed(seed)
    prompts = task.preference_prompts(n_demos, g)
    length = torch.randint(1, max_new_tokens, (n_demos, 1), generator=g)  # words before EOS
    noise = torch.randint(N_SPECIAL, task.vocab_size, (n_demos, max_new_tokens), generator=g)
    right = torch.rand(n_demos, max_new_tokens, generator=g) < 0.7
    words = torch.where(right, prompts[:, -1:], noise)
    responses = torch.where(torch.arange(max_new_tokens)[None] < length, words, torch.full_like(words, EOS))
    train, held_out = task.preference_prompts(16, g), task.preference_prompts(16, g)
    return {"task": task, "demo_prompts": prompts, "demo_responses": responses, "train_prompts": train,
            "eval_prompts": held_out}  # fmt: skip


class EchoTaskParams(BaseModel):
    model_config = STRICT
    prompt_len: int = Field(ge=2)
    max_new_tokens: int = Field(ge=2)
    n_demos: int = Field(gt=0)


class EchoParams(TaskSection):
    task: EchoTaskParams
    rm: RMParams

    def vocab(self) -> int:
        return N_SPECIAL + WORDS


@pytest.fixture
def echo(monkeypatch):
    """The echo task registered in both halves of the task registry, and a params stand-in with its section (the
    tiny test grammar's model, SFT, RM and PPO values)."""
    monkeypatch.setitem(library.LIBRARY, "echo", library.TaskKind(Echo, build_echo))
    monkeypatch.setitem(schema.TASKS, "echo", schema.TaskSpec(EchoParams, ("gold", "echo", "empty", "truncated")))
    grammar = repo_params()["grammar"]
    section = {**grammar, "task": {"prompt_len": 3, "max_new_tokens": 4, "n_demos": 300}}
    section["model"] = {**section["model"], "d_model": 16, "n_layers": 1, "n_heads": 2}
    section["sft"] = {**section["sft"], "steps": 20, "batch_size": 16, "n_heldout": 50}
    section["rm"] = {**section["rm"], "n_pairs": 64, "n_heldout_pairs": 40, "steps": 10, "batch_size": 16}
    return SimpleNamespace(echo=EchoParams(**section))


def test_a_second_learned_reward_task_goes_through_the_reward_model_stage(echo):
    assert schema.TASKS["echo"].learned_reward and library.LIBRARY["echo"].cls.reward == "learned"
    torch.set_num_threads(1)
    _, task, _, reward_model, metrics = build_upstream(echo, "echo", 0, torch.device("cpu"))
    assert isinstance(task, Echo) and reward_model is not None
    m = metrics["rm"]
    assert set(m) == {"heldout_accuracy", "label_agreement", "pearson_gold", "spearman_gold", "train_echo_fraction",
                      "train_loss_last"}  # fmt: skip
    assert all(math.isfinite(v) for v in m.values()), m
    assert 0 <= m["train_echo_fraction"] <= 1


def test_the_correlations_are_exactly_rounded_and_agree_with_scipy():
    rng = np.random.default_rng(0)
    for n in (20, 257, 1000):
        x = rng.standard_normal(n).astype(np.float32)
        y = (x + rng.standard_normal(n)).astype(np.float32)
        x[:5] = y[:5] = 0.25  # ties
        xs, ys = x.tolist(), y.tolist()
        want = stats.pearsonr(x.astype(np.float64), y.astype(np.float64)).statistic
        assert rm.correlation(xs, ys) == pytest.approx(want, rel=1e-12)
        assert rm.ranks(xs) == stats.rankdata(x).tolist()
        assert rm.correlation(rm.ranks(xs), rm.ranks(ys)) == pytest.approx(stats.spearmanr(x, y).statistic, rel=1e-12)
        assert rm.correlation(xs[::-1], ys[::-1]) == rm.correlation(xs, ys) or n == 20  # order-free up to 1 ulp
    assert math.isnan(rm.correlation([1.0, 1.0], [0.0, 1.0]))


BLAS_KERNELS = ("", "Prescott", "Haswell")  # OpenBLAS's own choice for this CPU, SSE3 only, AVX2


def test_rm_json_is_the_same_under_every_blas_kernel(tmp_path):
    """The reward-model stage of a tiny grammar instance, rebuilt in fresh processes under different OpenBLAS kernels
    (numpy's BLAS picks one from the CPU, or from OPENBLAS_CORETYPE), writes the same rm.json bytes: every number
    comes from torch on the pinned path or is exactly rounded (issue 30: scipy's pearsonr drifted by a float32 step
    between machines)."""
    script = (
        "import json, pipelines, torch  # pipelines first: it pins the CPU math paths before torch loads\n"
        "from pipelines.upstream import build_upstream; from tests.pipelines.test_rm_stage import tiny_grammar\n"
        "torch.set_num_threads(1)\n"
        "m = build_upstream(tiny_grammar(), 'grammar', 0, torch.device('cpu'))[4]['rm']\n"
        "print(json.dumps(m, sort_keys=True))\n"
    )
    outs = {}
    for kernel in BLAS_KERNELS:
        env = {"OPENBLAS_CORETYPE": kernel} if kernel else {}
        out = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
            env={**_env(), **env}, check=True,
        )  # fmt: skip
        outs[kernel or "default"] = out.stdout
    assert len(set(outs.values())) == 1, outs


def tiny_grammar():
    """A params stand-in with a small grammar section (the unit tests' grammar, a few pairs)."""
    from ablations.tasks import GrammarParams

    grammar = repo_params()["grammar"]
    section = {**grammar, "task": {**grammar["task"], "n_words": 8, "n_successors": 3, "max_new_tokens": 6,
                                   "n_demos": 300, "n_train_prompts": 16, "n_eval_prompts": 16}}  # fmt: skip
    section["model"] = {**section["model"], "d_model": 16, "n_layers": 1, "n_heads": 2}
    section["sft"] = {**section["sft"], "steps": 20, "batch_size": 16, "n_heldout": 50}
    section["rm"] = {**section["rm"], "n_pairs": 64, "n_heldout_pairs": 300, "steps": 10, "batch_size": 16}
    return SimpleNamespace(grammar=GrammarParams(**section))


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}
