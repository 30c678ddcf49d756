"""A verifiable-reward task (the RLVR setting): fixed-width addition, with subtraction held out for RL.

Language (character tokens): BOS = 0 and EOS = 1 as in ``rlhf.task``, the digits 0-9 are tokens 2-11, then
'+' = 12, '-' = 13, '=' = 14 (vocab_size 15). With n = ``n_digits``, a prompt is

    BOS a_{n-1} .. a_0  op  b_{n-1} .. b_0  '='          (prompt_len = 2n + 3)

with both operands zero-padded to n digits, most significant digit first (as written). The answer r = a + b
(op '+') or r = a - b (op '-', always a >= b) is written with exactly n + 1 digits, zero-padded, least
significant digit first, then EOS (the EOS padding of ``rlhf.task.response_mask`` follows up to
``max_new_tokens``). Reversed answers make every answer digit a function of the operand digits at fixed
positions and of the carry, which the previous answer digit reveals; MSB-first answers need the whole carry
chain before the first token and are much harder for a small transformer (Lee et al. 2023, "Teaching Arithmetic
to Small Transformers", arXiv 2307.03381, sec. 4: the "reverse" format). Example, n = 3:
``BOS 1 2 7 + 0 9 5 =`` -> ``2 2 2 0 EOS`` (127 + 95 = 222, written 0222 reversed).

Verifier (the gold reward; there is no learned reward model in this setting). For a response y with its first
EOS at index e (e = -1 when there is none):

    correct(y)   = 1  if  y_0 .. y_{e-1} is exactly the n + 1 answer digits above and e = n + 1, else 0
    malformed(y) = 1  if  there is no EOS, or e = 0 (empty answer), or some y_i with i < e is not a digit, else 0
    gold(y)      = correct(y) - format_penalty * malformed(y)

Tokens after the first EOS are ignored. A well-formed answer with a wrong value or a wrong number of digits
(e.g. without the leading zero) is wrong but not malformed. The primary metric is accuracy = mean correct.

Demonstrations (the SFT data) are only partly correct. They are computed digit by digit, least significant
first, like written arithmetic, and every carry (addition) or borrow (subtraction) the computation produces
is dropped independently with probability ``carry_drop`` (the classic "forgot to carry" slip); later digits are
computed with the dropped carry (a drop can remove later carries, never add one). Any drop changes the next
digit, so a demonstration for a problem whose correct computation has C carries/borrows (the final carry into
digit n included) is correct with probability exactly (1 - carry_drop)^C, and a wrong one is always well
formed. A policy that imitated the
demonstrations perfectly would be correct with that probability when sampled at temperature 1: the room RL has
to improve is to learn never to drop a carry. A share ``sub_fraction`` of the demonstrations are subtractions.
Over uniform 3-digit operands E[C] = 1.44 for addition and 0.89 for subtraction (a >= b: at most 2 borrows), so
with carry_drop = 0.4 a perfect imitator is right on E[0.6^C] = 53.3% of additions and 67.9% of subtractions,
and 39.4% of an even mix of demonstrations are wrong (enumerated over all 10^6 pairs).

Splits. Every unordered operand pair {a, b} belongs to one of three disjoint pools, by a seeded hash
(``split_seed``) of the pair: 'eval' (share ``eval_fraction``), 'rl' (``rl_fraction``) and 'sft' (the rest).
Pairs are unordered, so a + b and b + a (and a - b) always share a pool: a problem seen in one split never
reappears in another as its commuted twin.
    demonstrations  'sft' pool, addition and subtraction (SFT is taught both)
    train           'rl' pool, addition only (the RL prompts)
    eval            'eval' pool, addition (held-out in-domain accuracy)
    ood             'eval' pool, subtraction (out of domain for RL)
The OOD split is a held-out *operation*, not more digits: the models have learned position embeddings, so
longer operands would be unseen positions and every policy would score about 0 there, measuring nothing.
Subtraction is a skill SFT taught and RL never rewards, which is what the KL to the reference is said to
protect in RLVR (Shah et al. 2025, "A Comedy of Estimators", arXiv 2512.21852, measure in and out of domain):
OOD accuracy during RL measures what the policy keeps (or gains by transfer: "never drop a carry" may carry
over to borrows). No OOD prompt is a training prompt of either stage: its operator is '-' (RL sees only '+')
and its pair is in the 'eval' pool (SFT sees only 'sft' pairs).

Calibration (benchmarks/arithmetic_calibration.py, n_digits 3, carry_drop 0.4, 20000 demonstrations; TinyLM
d_model 64, 2 layers, 4 heads; 3000 SFT steps of batch 64 at lr 3e-3, 72 s of CPU on one thread): SFT samples
are right on 48.8% of held-out additions and 62.5% of subtractions (a perfect imitator: 52.3% and 68.4% on the
same prompts). The documented band, asserted by the slow test, is 35-65% in domain and 40-80% out of domain.
Sixty PPO iterations scored by the verifier raise in-domain accuracy to 0.85-0.95 on every seed tried, while
out-of-domain accuracy falls to 0.55-0.58.

Everything is a pure function of the arguments and an explicit ``torch.Generator``; tensors are long, prompts
(b, prompt_len), responses (b, max_new_tokens), on the device of the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from rlhf.task import BOS, EOS

DIGIT0 = 2  # token of the digit 0; digit d is token DIGIT0 + d
PLUS, MINUS, EQUALS = 12, 13, 14
VOCAB_SIZE = 15
Split = Literal["train", "eval", "ood"]
POOLS = ("eval", "rl", "sft")
MAX_DRAW_ROUNDS = 10_000  # _pairs: a pool with a share >= 0.01 fills in ~50 rounds; an empty one fails
_PRIME = 2_147_483_647  # 2^31 - 1, modulus of the split hash


@dataclass(frozen=True)
class Arithmetic:
    """The task of the module docstring. Every field changes results; none has a default."""

    n_digits: int  # digits per operand, 1..4
    max_new_tokens: int  # at least n_digits + 2 (answer digits and EOS)
    carry_drop: float  # probability that a demonstration drops each carry/borrow
    sub_fraction: float  # share of subtraction problems among the demonstrations
    eval_fraction: float  # share of operand pairs held out for evaluation (in-domain and OOD)
    rl_fraction: float  # share of operand pairs whose additions are the RL prompts
    split_seed: int  # seed of the pool hash
    format_penalty: float  # gold cost of a malformed response (>= 0)

    reward: ClassVar[str] = "verifier"  # PPO scores with ``gold`` itself, not with a learned reward model

    def __post_init__(self):
        if not 1 <= self.n_digits <= 4:  # pool(): c1 * key < 2^63 needs pair keys below 2^32
            raise ValueError(f"n_digits must be 1..4 (got {self.n_digits})")
        if self.max_new_tokens < self.n_digits + 2:
            raise ValueError(
                f"max_new_tokens must be >= n_digits + 2 = {self.n_digits + 2} (got {self.max_new_tokens})"
            )
        for name in ("carry_drop", "sub_fraction", "eval_fraction", "rl_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1] (got {getattr(self, name)})")
        if not (self.eval_fraction > 0 and self.rl_fraction > 0 and self.eval_fraction + self.rl_fraction < 1):
            raise ValueError("eval_fraction and rl_fraction must be > 0 and leave a share for the 'sft' pool")
        if self.format_penalty < 0:
            raise ValueError(f"format_penalty must be >= 0 (got {self.format_penalty})")

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def prompt_len(self) -> int:
        return 2 * self.n_digits + 3

    @property
    def answer_len(self) -> int:
        """Digits of every answer (n_digits + 1), EOS not counted."""
        return self.n_digits + 1

    # --- splits -------------------------------------------------------------------------------------------
    def pool(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Pool index (0 'eval', 1 'rl', 2 'sft') of each unordered pair {a, b}: (m,) long x2 -> (m,) long.

        u = h3 / P with h1 = (c1 key + c2) mod P, h2 = (h1^2 + c3) mod P, h3 = (c4 h2 + c5) mod P, where
        key = min(a, b) * 10^n + max(a, b), P = 2^31 - 1 and c1..c5 are drawn from ``split_seed`` (every
        product stays below 2^62, so int64 never overflows). Pool 'eval' if u < eval_fraction, 'rl' if
        u < eval_fraction + rl_fraction, 'sft' otherwise."""
        g = torch.Generator().manual_seed(self.split_seed)
        c = torch.randint(1, _PRIME, (5,), generator=g, dtype=torch.long).tolist()
        key = torch.minimum(a, b) * 10**self.n_digits + torch.maximum(a, b)
        h = (c[0] * key + c[1]) % _PRIME
        h = (h * h + c[2]) % _PRIME
        u = ((c[3] * h + c[4]) % _PRIME).double() / _PRIME
        return (u >= self.eval_fraction).long() + (u >= self.eval_fraction + self.rl_fraction).long()

    def _pairs(self, pool: str, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n operand pairs drawn uniformly from [0, 10^n)^2 conditioned on lying in ``pool`` (rejection, at most
        MAX_DRAW_ROUNDS rounds of 2n draws: ValueError if the pool is too small to fill them)."""
        want, hi = POOLS.index(pool), 10**self.n_digits
        a_out, b_out, have = [], [], 0
        for _ in range(MAX_DRAW_ROUNDS):
            if have >= n:
                break
            a = torch.randint(0, hi, (2 * n,), generator=generator)
            b = torch.randint(0, hi, (2 * n,), generator=generator)
            keep = self.pool(a, b) == want
            a_out.append(a[keep])
            b_out.append(b[keep])
            have += int(keep.sum())
        if have < n:
            raise ValueError(
                f"the {pool!r} pool of operand pairs gave {have} of {n} pairs in {MAX_DRAW_ROUNDS * 2 * n} draws: "
                "it is (nearly) empty; raise its share (eval_fraction, rl_fraction, or what they leave for sft)"
            )
        return torch.cat(a_out)[:n], torch.cat(b_out)[:n]

    def sample_prompts(self, split: Split, n: int, generator: torch.Generator) -> torch.Tensor:
        """n prompts of a split ('train', 'eval', 'ood'; see the module docstring) -> (n, prompt_len) long.

        Drawn with a CPU ``generator``, returned on the CPU (as are ``demonstrations``); the caller moves them."""
        if split not in ("train", "eval", "ood"):
            raise ValueError(f"split must be 'train', 'eval' or 'ood' (got {split!r})")
        a, b = self._pairs("rl" if split == "train" else "eval", n, generator)
        minus = torch.full((n,), split == "ood", dtype=torch.bool)
        return self.encode(a, b, minus)

    def demonstrations(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n SFT demonstrations from the 'sft' pool with the carry-dropping error model.

        Returns prompts (n, prompt_len) and responses (n, max_new_tokens), EOS after the answer digits."""
        a, b = self._pairs("sft", n, generator)
        minus = torch.rand(n, generator=generator) < self.sub_fraction
        prompts = self.encode(a, b, minus)
        drops = torch.rand(n, self.answer_len, generator=generator) < self.carry_drop  # (n, n + 1)
        return prompts, self._respond(prompts, drops)

    # --- encoding -----------------------------------------------------------------------------------------
    def encode(self, a: torch.Tensor, b: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
        """Prompts for operands a, b (m,) and a (m,) bool 'is subtraction' (operands swapped so a >= b)."""
        a, b = torch.where(minus, torch.maximum(a, b), a), torch.where(minus, torch.minimum(a, b), b)
        m = a.shape[0]
        op = torch.where(minus, MINUS, PLUS)[:, None]
        bos, eq = torch.full((m, 1), BOS, device=a.device), torch.full((m, 1), EQUALS, device=a.device)
        return torch.cat([bos, self._digits_msb(a), op, self._digits_msb(b), eq], dim=1)

    def _digits_msb(self, x: torch.Tensor) -> torch.Tensor:
        powers = 10 ** torch.arange(self.n_digits - 1, -1, -1, device=x.device)
        return DIGIT0 + (x[:, None] // powers) % 10  # (m, n)

    def decode(self, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Digits of a, b LSB first (m, n) each and the (m,) bool 'is subtraction'. Raises on a foreign prompt."""
        n = self.n_digits
        if prompts.shape[1] != self.prompt_len:
            raise ValueError(f"prompts must have {self.prompt_len} tokens (got {prompts.shape[1]})")
        a, op, b = prompts[:, 1 : n + 1], prompts[:, n + 1], prompts[:, n + 2 : 2 * n + 2]
        ok = (prompts[:, 0] == BOS) & (prompts[:, -1] == EQUALS) & ((op == PLUS) | (op == MINUS))
        ok &= _is_digit(a).all(1) & _is_digit(b).all(1)
        if not ok.all():
            raise ValueError(f"not an arithmetic prompt: {prompts[~ok][0].tolist()}")
        return (a - DIGIT0).flip(1), (b - DIGIT0).flip(1), op == MINUS

    def _respond(self, prompts: torch.Tensor, drops: torch.Tensor) -> torch.Tensor:
        """Written arithmetic, LSB first: the carry/borrow out of digit i is dropped where ``drops[:, i]`` is True.

        drops (m, n + 1); column n is never used (nothing carries out of the padding digit).
        Returns (m, max_new_tokens) responses."""
        a, b, minus = self.decode(prompts)
        m = prompts.shape[0]
        sign = torch.where(minus, -1, 1)  # (m,)
        out = torch.full((m, self.max_new_tokens), EOS, dtype=torch.long, device=prompts.device)
        carry = torch.zeros(m, dtype=torch.long, device=prompts.device)
        for i in range(self.answer_len):
            ai = a[:, i] if i < self.n_digits else torch.zeros_like(carry)
            bi = b[:, i] if i < self.n_digits else torch.zeros_like(carry)
            s = ai + sign * (bi + carry)  # addition: a + b + c; subtraction: a - b - borrow
            out[:, i] = DIGIT0 + s % 10  # Python-style modulo: -1 % 10 = 9
            makes = (s >= 10) | (s < 0)
            carry = (makes & ~drops[:, i]).long()
        return out

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """The correct responses (m, max_new_tokens): n + 1 digits LSB first, then EOS."""
        return self._respond(
            prompts, torch.zeros(prompts.shape[0], self.answer_len, dtype=torch.bool, device=prompts.device)
        )

    def n_carries(self, prompts: torch.Tensor) -> torch.Tensor:
        """(m,) number of carries/borrows in the correct computation (C of the module docstring)."""
        a, b, minus = self.decode(prompts)
        sign, carry = torch.where(minus, -1, 1), torch.zeros_like(minus, dtype=torch.long)
        count = torch.zeros_like(carry)
        for i in range(self.n_digits):
            s = a[:, i] + sign * (b[:, i] + carry)
            carry = ((s >= 10) | (s < 0)).long()
            count += carry
        return count

    # --- verifier and metrics -----------------------------------------------------------------------------
    def metrics(self, prompts: torch.Tensor, responses: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-response task metrics, each (b,) float: 'accuracy' (correct), 'format_error' (malformed)."""
        is_eos = responses == EOS  # (b, t)
        has_eos = is_eos.any(1)
        first = torch.where(has_eos, is_eos.float().argmax(1), torch.full_like(has_eos, -1, dtype=torch.long))
        before = torch.arange(responses.shape[1], device=responses.device)[None, :] < first[:, None]  # (b, t)
        digits_only = (_is_digit(responses) | ~before).all(1)
        malformed = ~has_eos | (first == 0) | ~digits_only
        k = self.answer_len
        correct = (first == k) & (responses[:, :k] == self.answers(prompts)[:, :k]).all(1)
        return {"accuracy": correct.float(), "format_error": malformed.float()}

    def gold(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """gold = correct - format_penalty * malformed: prompts (b, p), responses (b, t) -> (b,) float."""
        m = self.metrics(prompts, responses)
        return m["accuracy"] - self.format_penalty * m["format_error"]


def _is_digit(tokens: torch.Tensor) -> torch.Tensor:
    return (tokens >= DIGIT0) & (tokens < DIGIT0 + 10)


def build_arithmetic(seed: int, *, n_demos: int, n_train_prompts: int, n_eval_prompts: int, **fields) -> dict:
    """Arithmetic instance ``seed`` (it also seeds the split of operand pairs; ``fields``: the other fields of
    ``Arithmetic``): demonstrations of both operations, RL prompts (addition), held-out additions and held-out
    subtractions (the OOD set)."""
    task = Arithmetic(split_seed=seed, **fields)
    g = torch.Generator().manual_seed(seed)
    demo_prompts, demo_responses = task.demonstrations(n_demos, g)
    return {
        "task": task,
        "demo_prompts": demo_prompts,
        "demo_responses": demo_responses,
        "train_prompts": task.sample_prompts("train", n_train_prompts, g),
        "eval_prompts": task.sample_prompts("eval", n_eval_prompts, g),
        "ood_prompts": task.sample_prompts("ood", n_eval_prompts, g),
    }
