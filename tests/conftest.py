"""Shared, session-scoped tiny setup for the rlhf unit tests (everything is built once, on one CPU thread).

Fixtures that hold models must never be mutated by a test: deep-copy before training (``run_ppo`` does).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

from rlhf import reward_model as R  # noqa: E402
from rlhf.config import KLConfig, PPOConfig  # noqa: E402
from rlhf.grammar import Grammar, make_grammar, sample_prompts, sample_responses  # noqa: E402
from rlhf.model import ScalarModel, TinyLM, generate  # noqa: E402
from rlhf.ppo import train_ppo  # noqa: E402
from rlhf.sft import response_nll, train_sft  # noqa: E402
from rlhf.task import EOS, gold_ordered, preference_pairs  # noqa: E402


def tiny_lm(grammar: Grammar, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(grammar.vocab_size, grammar.prompt_len + grammar.max_new_tokens, d_model=16, n_layers=1, n_heads=2)


@dataclass
class SFTResult:
    model: TinyLM
    initial_nll: float  # held-out NLL of the untrained model
    heldout_prompts: torch.Tensor
    heldout_responses: torch.Tensor


@dataclass
class RMResult:
    model: ScalarModel  # trained and normalised on ``norm_prompts``/``norm_responses``
    heldout_prompts: torch.Tensor
    better: torch.Tensor  # held-out responses with strictly higher gold than ``worse``
    worse: torch.Tensor


# The tiny task of the unit tests (params.yaml's `task` section holds the pipeline's values).
TINY_TASK = dict(
    seed=0,
    n_words=8,
    n_successors=4,
    p_eos=0.06,
    quality_mean=0.5,
    illegal_penalty=2.0,
    prompt_len=4,
    max_new_tokens=6,
)

ARITHMETIC = dict(  # the arithmetic task of the unit tests (params.yaml's values at its calibration)
    n_digits=3,
    max_new_tokens=5,
    carry_drop=0.4,
    sub_fraction=0.5,
    eval_fraction=0.1,
    rl_fraction=0.3,
    split_seed=0,
    format_penalty=0.0,
)


@pytest.fixture(scope="session")
def grammar() -> Grammar:
    return make_grammar(**TINY_TASK)


@pytest.fixture(scope="session")
def sft(grammar) -> SFTResult:
    g = torch.Generator().manual_seed(0)
    prompts = sample_prompts(grammar, 512, g)
    responses = sample_responses(grammar, prompts, g)
    heldout_prompts = sample_prompts(grammar, 256, g)
    heldout_responses = sample_responses(grammar, heldout_prompts, g)
    model = tiny_lm(grammar)
    with torch.no_grad():
        initial = response_nll(model, heldout_prompts, heldout_responses).item()
    train_sft(model, prompts, responses, steps=60, batch_size=32, lr=1e-2, generator=g, adam_eps=1e-8)
    return SFTResult(model.eval(), initial, heldout_prompts, heldout_responses)


@pytest.fixture(scope="session")
def rm(grammar, sft) -> RMResult:
    """Bradley-Terry proxy on 300 noiseless pairs of SFT samples; 256 held-out pairs labelled by gold."""
    n_train = 300
    g = torch.Generator().manual_seed(1)
    prompts = sample_prompts(grammar, n_train + 256, g)
    a = generate(sft.model, prompts, grammar.max_new_tokens, 1.0, g, EOS)
    b = generate(sft.model, prompts, grammar.max_new_tokens, 1.0, g, EOS)
    chosen, rejected, _ = preference_pairs(grammar, prompts, a, b, 0.0, g)
    torch.manual_seed(1)
    model = R.init_reward_model(sft.model)
    R.train_reward_model(model, prompts[:n_train], chosen[:n_train], rejected[:n_train], 60, 32, 1e-2, g, adam_eps=1e-8)
    model.eval()
    R.normalize(model, prompts[:n_train], a[:n_train])
    return RMResult(model, *gold_ordered(grammar, prompts[n_train:], a[n_train:], b[n_train:]))


@dataclass
class PPOSetup:
    grammar: Grammar
    ref: TinyLM  # the SFT model
    policy: TinyLM  # the SFT model with perturbed weights, so that KL(policy || ref) > 0 from the first rollout
    reward_model: ScalarModel
    train_prompts: torch.Tensor
    eval_prompts: torch.Tensor


@pytest.fixture(scope="session")
def ppo_setup(grammar, sft, rm) -> PPOSetup:
    g = torch.Generator().manual_seed(2)
    policy = copy.deepcopy(sft.model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    train_prompts, eval_prompts = sample_prompts(grammar, 64, g), sample_prompts(grammar, 16, g)
    return PPOSetup(grammar, sft.model, policy, rm.model, train_prompts, eval_prompts)


REPO = Path(__file__).resolve().parents[1]


def merged(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` merged in, section by section (a dict value merges, anything else replaces)."""
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def repo_params(overrides: dict | None = None) -> dict:
    """The repository's params.yaml as a dict, with ``overrides`` merged in (``grid.arms`` is replaced whole)."""
    from ablations.config import read_yaml

    base = read_yaml(REPO / "params.yaml")
    overrides = copy.deepcopy(overrides or {})
    arms = overrides.get("grid", {}).pop("arms", None)
    out = merged(base, overrides)
    if arms is not None:
        out["grid"]["arms"] = arms
    return out


# Test values for the fields a small run does not vary (params.yaml holds the pipeline's values).
PPO_BASE = dict(
    algorithm="ppo",
    group_size=1,
    lr=1e-3,
    adam_eps=1e-5,
    temperature=1.0,
    gamma=1.0,
    lam=0.95,
    cliprange=0.2,
    cliprange_value=0.2,
    vf_coef=0.1,
    whiten_rewards=False,
    missing_eos_score=None,
    eval_seed=12345,
    seed=0,
)
KL_BASE = dict(target="reference", placement="reward", estimator="k1", coef=0.05)


def small_ppo_config(**overrides) -> PPOConfig:
    """iterations=2, batch 8, minibatch 4, 2 epochs, eval every iteration; ``kl`` may be a dict or a KLConfig."""
    kl = overrides.pop("kl", {})
    kl = kl if isinstance(kl, KLConfig) else KLConfig(**{**KL_BASE, **kl})
    base = dict(iterations=2, batch_size=8, minibatch_size=4, epochs=2, eval_every=1, kl=kl, **PPO_BASE)
    return PPOConfig(**{**base, **overrides})


@pytest.fixture(scope="session")
def run_ppo(ppo_setup):
    """run_ppo(policy=None, ref=None, reward_model=None, **config overrides) -> train_ppo output, on deep copies."""

    def run(policy=None, ref=None, reward_model=None, **overrides) -> dict:
        s = ppo_setup
        return train_ppo(
            copy.deepcopy(s.policy if policy is None else policy),
            copy.deepcopy(s.ref if ref is None else ref),
            copy.deepcopy(s.reward_model if reward_model is None else reward_model),
            s.grammar,
            s.train_prompts,
            s.eval_prompts,
            small_ppo_config(**overrides),
        )

    return run


@pytest.fixture
def params_copy(tmp_path, monkeypatch) -> Path:
    """A temporary directory holding a copy of the repository's params.yaml, as the working directory."""
    from tests.helpers import copy_params

    monkeypatch.chdir(tmp_path)
    return copy_params(tmp_path)


@pytest.fixture(autouse=True)
def _isolated_mlflow(tmp_path, monkeypatch):
    """No test writes to the repository's mlflow.db or mlartifacts/."""
    from pipelines import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(tracking, "ROOT", tmp_path)
