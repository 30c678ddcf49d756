"""Supervised fine-tuning: next-token cross-entropy on (prompt, demonstration) pairs.

The loss covers the response tokens up to and including EOS (``task.response_mask``); the prompt is context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.model import TinyLM, adam, response_logits
from rlhf.task import response_mask


def response_nll(model: TinyLM, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood per response token (nats). prompts (b, p), responses (b, t) -> scalar."""
    logits = response_logits(model, prompts, responses, temperature=1.0)  # (b, t, V)
    nll = F.cross_entropy(logits.transpose(1, 2), responses, reduction="none")  # (b, t)
    mask = response_mask(responses)
    return (nll * mask).sum() / mask.sum()


def train_sft(
    model: TinyLM,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    steps: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    progress=None,
    *,
    adam_eps: float,
) -> list[float]:
    """Adam (``rlhf.model.adam``: ``lr``, ``adam_eps``) on ``response_nll`` over random minibatches. Returns the
    training loss of every step."""
    opt = adam(model.parameters(), lr=lr, eps=adam_eps)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, prompts.shape[0], (batch_size,), generator=generator, device=prompts.device)
        loss = response_nll(model, prompts[idx], responses[idx])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT loss is non-finite at step {len(losses)}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(1)
    return losses
