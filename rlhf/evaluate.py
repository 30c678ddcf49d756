"""The one measurement every arm gets, whatever its KL variant: held-out prompts, the same sampling seed.

For responses sampled from the current policy on ``eval_prompts``:
    gold     mean gold reward (task.gold_reward)
    proxy    mean proxy reward-model score
    kl       mean over prompts of sum_t KL(pi(.|y_<t) || pi_ref(.|y_<t)), exact over the vocabulary at each
             response position (kl.full_kl), never the arm's own training estimator
    entropy  mean per-token entropy of the policy on response tokens (nats)
    length   mean response length in tokens (EOS included)
    illegal  mean fraction of response tokens that break the grammar (the proxy's blind spot)
"""

from __future__ import annotations

import torch

from rlhf.kl import entropy, full_kl, masked_mean
from rlhf.model import ScalarModel, TinyLM, generate, response_logits
from rlhf.reward_model import score
from rlhf.task import EOS, Grammar, gold_reward, illegal_fraction, response_mask


@torch.no_grad()
def evaluate(
    policy: TinyLM,
    ref_policy: TinyLM,
    reward_model: ScalarModel,
    grammar: Grammar,
    eval_prompts: torch.Tensor,
    temperature: float,
    seed: int,
) -> dict[str, float]:
    g = torch.Generator(device=eval_prompts.device).manual_seed(seed)
    responses = generate(policy, eval_prompts, grammar.max_new_tokens, temperature, g, EOS)  # (n, t)
    mask = response_mask(responses)  # (n, t)
    logits = response_logits(policy, eval_prompts, responses, temperature)  # (n, t, V)
    ref_logits = response_logits(ref_policy, eval_prompts, responses, temperature)
    return {
        "gold": gold_reward(grammar, eval_prompts, responses).mean().item(),
        "proxy": score(reward_model, eval_prompts, responses).mean().item(),
        "kl": (full_kl(logits, ref_logits) * mask).sum(1).mean().item(),
        "entropy": masked_mean(entropy(logits), mask).item(),
        "length": mask.sum(1).mean().item(),
        "illegal": illegal_fraction(grammar, eval_prompts, responses).mean().item(),
    }
