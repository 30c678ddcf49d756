"""What every task shares: the task protocol, the token conventions, and preference pairs labelled by gold.

A task (``rlhf.grammar.Grammar``: RLHF with a learned proxy; ``rlhf.arithmetic.Arithmetic``: RLVR with a verifier)
is registered by name in ``rlhf.tasks``. Tokens: BOS = 0 starts every prompt, EOS = 1 ends a response and pads it
(``response_mask``); a task's own tokens follow. Prompts are (b, prompt_len) long, responses (b, max_new_tokens)
long, on the device of the inputs.

A task whose ``reward`` is "learned" also draws fresh prompts for its reward model's preference pairs
(``LearnedRewardTask``); the pairs are labelled by a Bradley-Terry draw on its gold reward (``preference_pairs``),
so the reward-model stage (pipelines/rm.py) needs nothing else from it.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

BOS, EOS = 0, 1
N_SPECIAL = 2


class Task(Protocol):
    """What training and evaluation need from a task.

    Prompts are (b, prompt_len) long with BOS first; responses (b, max_new_tokens) long, EOS then EOS padding
    (``response_mask``); tokens are ids in [0, vocab_size). ``reward`` says what PPO optimises: "learned" (RLHF: a
    reward model trained on gold-labelled preferences stands in for gold, which it only approximates) or
    "verifier" (RLVR: ``gold`` itself is the score). ``metrics`` are the task's own per-response measurements, each
    a share in [0, 1] (e.g. the share of ungrammatical words, or accuracy and format errors), reported beside
    gold."""

    reward: ClassVar[str]
    prompt_len: int
    max_new_tokens: int

    @property
    def vocab_size(self) -> int: ...

    def gold(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor: ...

    def metrics(self, prompts: torch.Tensor, responses: torch.Tensor) -> dict[str, torch.Tensor]: ...


class LearnedRewardTask(Task, Protocol):
    """A task scored by a learned reward model (``reward`` "learned"): it also draws the prompts of the reward
    model's preference pairs, (n, prompt_len) long on the CPU, from a CPU ``generator``."""

    def preference_prompts(self, n: int, generator: torch.Generator) -> torch.Tensor: ...


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """(b, t) float mask: 1 up to and including the first EOS, 0 after (padding)."""
    is_eos = (responses == EOS).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # number of EOS strictly before t
    return (eos_before == 0).float()


TIE = 1e-6  # gold differences smaller than this are float rounding (the same words summed in another order)


def gold_difference(task: Task, prompts: torch.Tensor, responses_a: torch.Tensor, responses_b: torch.Tensor):
    """gold(a) - gold(b) per prompt, (n,), with differences below ``TIE`` set to exactly 0 (a tie)."""
    diff = task.gold(prompts, responses_a) - task.gold(prompts, responses_b)
    return torch.where(diff.abs() < TIE, torch.zeros_like(diff), diff)


def preference_pairs(
    task: Task,
    prompts: torch.Tensor,
    responses_a: torch.Tensor,
    responses_b: torch.Tensor,
    noise: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bradley-Terry labels from the gold reward (Christiano et al. 2017; Gao et al. 2022, sec. 2).

    P(a preferred) = sigmoid((gold(a) - gold(b)) / noise); noise -> 0 gives noiseless labels.
    Returns (chosen, rejected, noiseless_agrees): chosen/rejected responses (n, t) and a (n,) bool telling
    whether the drawn label agrees with the noiseless gold comparison (ties agree).
    """
    diff = gold_difference(task, prompts, responses_a, responses_b)
    p_a = torch.sigmoid(diff / max(noise, 1e-8))
    a_wins = torch.rand(p_a.shape, generator=generator, device=p_a.device) < p_a
    chosen = torch.where(a_wins[:, None], responses_a, responses_b)
    rejected = torch.where(a_wins[:, None], responses_b, responses_a)
    agrees = (a_wins == (diff > 0)) | (diff == 0)  # a tie agrees with either label
    return chosen, rejected, agrees


def gold_ordered(task: Task, prompts: torch.Tensor, responses_a: torch.Tensor, responses_b: torch.Tensor):
    """Noiseless gold comparison of two responses per prompt, ties dropped: for held-out accuracy.

    prompts (n, p), responses (n, t) -> (prompts, better, worse), each with the m <= n untied rows."""
    diff = gold_difference(task, prompts, responses_a, responses_b)
    keep = diff != 0
    a_wins = (diff > 0)[:, None]
    better = torch.where(a_wins, responses_a, responses_b)[keep]
    worse = torch.where(a_wins, responses_b, responses_a)[keep]
    return prompts[keep], better, worse
