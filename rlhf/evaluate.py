"""The one measurement every arm gets, whatever its KL variant: held-out prompts, the same sampling seed.

For responses sampled from the current policy on each evaluation set (``response_stats`` for any responses):
    gold       mean gold reward (``task.gold``: the exact gold reward, or the verifier)
    proxy      mean proxy reward-model score (learned-reward tasks only; the raw score, without PPO's missing-EOS
               replacement)
    kl         mean over prompts of sum_t KL(pi(.|y_<t) || pi_ref(.|y_<t)), exact over the vocabulary at each
               response position (kl.full_kl), never the arm's own training estimator; fp32 whatever the
               training precision
    entropy    mean per-token entropy of the policy on response tokens (nats)
    length     mean response length in tokens (EOS included; an empty response has length 1)
    empty      share of empty responses (EOS first)
    truncated  share of responses without EOS within max_new_tokens
    <metric>   the mean of each of the task's own metrics (grammar: illegal, the share of words that break the
               grammar, the proxy's blind spot; arithmetic: accuracy, format_error)
The in-domain set's keys are plain; another set's (e.g. arithmetic's held-out operation, "ood") are prefixed
with its name and "_".

``degenerate_responses`` builds the policies the gold reward must rank below the SFT policy (silence, a repeated
word, random words, truncated SFT text), for the task's sanity checks.
"""

from __future__ import annotations

import torch

from rlhf.grammar import Grammar
from rlhf.kl import entropy, full_kl, masked_mean
from rlhf.model import ScalarModel, TinyLM, full_precision, generate, response_logits
from rlhf.reward_model import score
from rlhf.task import EOS, N_SPECIAL, Task, response_mask


@torch.inference_mode()  # a measurement: no autograd bookkeeping (the reward model's parameters require grad)
def response_stats(
    reward_model: ScalarModel | None, task: Task, prompts: torch.Tensor, responses: torch.Tensor
) -> dict[str, float]:
    """gold, proxy (with a reward model), length, empty, truncated and the task's metrics (module docstring) of
    prompts (n, p), responses (n, t)."""
    out = {"gold": task.gold(prompts, responses).mean().item()}
    if reward_model is not None:
        out["proxy"] = score(reward_model, prompts, responses).mean().item()
    out |= {
        "length": response_mask(responses).sum(1).mean().item(),
        "empty": (responses[:, 0] == EOS).float().mean().item(),
        "truncated": (responses != EOS).all(1).float().mean().item(),
    }
    return out | {k: v.mean().item() for k, v in task.metrics(prompts, responses).items()}


@torch.inference_mode()
def measure(policy, ref_policy, reward_model, task: Task, prompts: torch.Tensor, temperature: float, seed: int):
    """The module docstring's measurement on one set of prompts (n, p), sampled with generator seed ``seed``."""
    g = torch.Generator(device=prompts.device).manual_seed(seed)
    responses = generate(policy, prompts, task.max_new_tokens, temperature, g, EOS)  # (n, t)
    mask = response_mask(responses)  # (n, t)
    with full_precision(policy, ref_policy):
        logits = response_logits(policy, prompts, responses, temperature)  # (n, t, V)
        ref_logits = response_logits(ref_policy, prompts, responses, temperature)
    stats = response_stats(reward_model, task, prompts, responses)
    first = {k: stats.pop(k) for k in ("gold", "proxy") if k in stats}
    return {
        **first,
        "kl": (full_kl(logits, ref_logits) * mask).sum(1).mean().item(),
        "entropy": masked_mean(entropy(logits), mask).item(),
        **stats,
    }


def evaluate(
    policy: TinyLM,
    ref_policy: TinyLM,
    reward_model: ScalarModel | None,
    task: Task,
    eval_sets: dict[str, torch.Tensor],
    temperature: float,
    seed: int,
) -> dict[str, float]:
    """``measure`` on every evaluation set: {"": in-domain prompts, "ood": ..., ...}; keys of a named set are
    prefixed with its name and "_". Every set is sampled with the same ``seed``."""
    out = {}
    for name, prompts in eval_sets.items():
        stats = measure(policy, ref_policy, reward_model, task, prompts, temperature, seed)
        out |= {(f"{name}_{k}" if name else k): v for k, v in stats.items()}
    return out


def keep_words(responses: torch.Tensor, k: int) -> torch.Tensor:
    """Each response cut after its first ``k`` tokens and ended there with EOS (shorter ones unchanged). (n, t)."""
    out = responses.clone()
    if k < out.shape[1]:
        out[:, k:] = EOS
    return out


def degenerate_responses(
    grammar: Grammar, sft_responses: torch.Tensor, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Responses of degenerate policies for the prompts of ``sft_responses`` (n, t), each (n, t):

    empty              EOS first (saying nothing)
    repeat_w<i>        word i repeated max_new_tokens - 1 times, then EOS (never grammatical after the first word)
    random_words       max_new_tokens - 1 uniformly random words, then EOS
    random_sft_length  each word of the SFT response replaced by a uniformly random word (same lengths)
    sft_first_<k>      the SFT response cut to its first k tokens (k = 1, 2), then EOS
    """
    n, t = sft_responses.shape
    n_words = grammar.vocab_size - N_SPECIAL
    full = torch.full((n, t), EOS, dtype=torch.long, device=sft_responses.device)
    words = torch.randint(N_SPECIAL, grammar.vocab_size, (n, t), generator=generator).to(sft_responses.device)
    out = {"empty": full.clone()}
    for i in range(N_SPECIAL, N_SPECIAL + n_words):
        out[f"repeat_w{i}"] = keep_words(torch.full_like(full, i), t - 1)
    out["random_words"] = keep_words(words, t - 1)
    out["random_sft_length"] = torch.where(sft_responses == EOS, sft_responses, words)
    for k in (1, 2):
        out[f"sft_first_{k}"] = keep_words(sft_responses, k)
    return out
