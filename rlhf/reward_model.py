"""Proxy reward model: Bradley-Terry loss on preference pairs (Christiano et al. 2017; Ouyang et al. 2022 eq. 1).

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))

r(x, y) is the scalar head read at the last response token (the EOS, or the final token when EOS never came),
Huang et al. 2024 (arXiv 2403.17031) detail 'extract reward from the EOS token'.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from rlhf.model import ScalarModel, TinyLM, adam
from rlhf.task import EOS, response_mask


def last_index(responses: torch.Tensor) -> torch.Tensor:
    """(b,) index of the last response token (first EOS or the final position)."""
    return response_mask(responses).sum(1).long() - 1


def score(reward_model: ScalarModel, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Proxy reward of each response: prompts (b, p), responses (b, t) -> (b,)."""
    per_pos = reward_model(torch.cat([prompts, responses], dim=1))  # (b, p + t)
    idx = prompts.shape[1] + last_index(responses)
    return per_pos.gather(1, idx[:, None]).squeeze(1)


def missing_eos(scores: torch.Tensor, responses: torch.Tensor, fixed_score: float | None) -> torch.Tensor:
    """Scores with those of responses that never emit EOS replaced by ``fixed_score``: scores (b,), responses
    (b, t) -> (b,). ``fixed_score`` None returns ``scores`` unchanged.

        score'(x, y) = fixed_score  if EOS not in y_1..y_T (the response ran out of tokens),  score(x, y) otherwise

    Huang et al. 2024 (arXiv 2403.17031), 'EOS trick to ensure scores from the RM is valid': a truncated response
    gets a fixed low score (-1 in their TL;DR runs, ``penalty_reward_value``), in
    vwxyzjn/summarize_from_feedback_details ``ppo.py``: ``scores = torch.where(contain_eos_token, scores,
    torch.full_like(scores, args.penalty_reward_value))``."""
    if fixed_score is None:
        return scores
    has_eos = (responses == EOS).any(1)  # (b,)
    return torch.where(has_eos, scores, torch.full_like(scores, fixed_score))


def init_reward_model(sft_model: TinyLM) -> ScalarModel:
    """Reward model initialised from the SFT backbone (Ouyang et al. 2022, sec. 3.5)."""
    return ScalarModel(copy.deepcopy(sft_model))


def bt_loss(reward_model: ScalarModel, prompts, chosen, rejected) -> torch.Tensor:
    return -F.logsigmoid(score(reward_model, prompts, chosen) - score(reward_model, prompts, rejected)).mean()


def train_reward_model(
    reward_model: ScalarModel,
    prompts: torch.Tensor,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    steps: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    progress=None,
    *,
    adam_eps: float,
) -> list[float]:
    """Adam (``rlhf.model.adam``: ``lr``, ``adam_eps``) on the Bradley-Terry loss over random minibatches. Returns
    the loss of every step."""
    opt = adam(reward_model.parameters(), lr=lr, eps=adam_eps)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, prompts.shape[0], (batch_size,), generator=generator, device=prompts.device)
        loss = bt_loss(reward_model, prompts[idx], chosen[idx], rejected[idx])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"reward-model loss is non-finite at step {len(losses)}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(1)
    return losses


@torch.no_grad()
def normalize(reward_model: ScalarModel, prompts: torch.Tensor, responses: torch.Tensor) -> None:
    """Set gain/bias so that ``responses`` (SFT samples) score mean 0, std 1 (lm-human-preferences)."""
    reward_model.gain.fill_(1.0)
    reward_model.bias.fill_(0.0)
    s = score(reward_model, prompts, responses)
    reward_model.gain.fill_(1.0 / s.std().item())
    reward_model.bias.fill_(-s.mean().item() / s.std().item())


@torch.no_grad()
def pairwise_accuracy(reward_model: ScalarModel, prompts, better, worse) -> float:
    """Fraction of pairs where the proxy ranks ``better`` above ``worse``."""
    return (score(reward_model, prompts, better) > score(reward_model, prompts, worse)).float().mean().item()
