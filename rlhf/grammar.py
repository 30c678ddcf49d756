"""A synthetic preference task with an exactly computable gold reward that judges content.

The reference language is a random sparse bigram chain (a Markov grammar) over ``n_words`` word tokens plus
two special tokens, BOS and EOS. Each word has ``n_successors`` legal successors among the other words (no word
may follow itself), with Dirichlet(1) weights, and may end the sentence with probability ``p_eos``. Prompts are
BOS followed by ``prompt_len - 1`` words of the chain. SFT demonstrations continue the chain as complete
sentences: at least one word, and EOS within ``max_new_tokens`` (a sentence still going after
``max_new_tokens - 1`` words ends there).

Gold reward (Gao et al. 2022 use a fixed gold model; ours is a closed form). Every word w has a quality
quality[w] = quality_mean + z_w, with z_1..z_n drawn once with the grammar from N(0, 1) and standardised under the
language's long-run word frequencies pi (the stationary distribution of the word chain): sum_w pi_w z_w = 0 and
sum_w pi_w z_w^2 = 1, so in every grammar seed the words the language actually uses have mean quality exactly
quality_mean. Grammatical text is worth more the more of it there is, and good words more than bad ones.

For a response y_1..y_L (L counts the tokens up to and including EOS, or ``max_new_tokens`` if EOS never comes),
with y_0 the last prompt token and T = ``max_new_tokens``:

    gold(y) = (1 / T) * sum_{t=1..L, y_t != EOS} g_t,
    g_t = quality[y_t]        if y_{t-1} -> y_t is a legal bigram of the grammar,
    g_t = -illegal_penalty    otherwise.

Saying nothing scores 0; with ``quality_mean`` > 0 an SFT-like response scores about
(number of words) * quality_mean / T > 0, so silence, truncation, a repeated word (never legal) and random words
(legal with chance n_successors / n_words) all score below the SFT policy. EOS itself is never scored: whether a
response ends is the business of the PPO option ``missing_eos_score`` (Huang et al. 2024), not of gold.

Where over-optimisation comes from: preference pairs are sampled from the SFT policy, which almost never
produces an illegal bigram, so the proxy reward model learns "more words, and better words, are better" and
never sees the price of ungrammatical text. A policy that maximises the proxy drifts to the best words whether
or not the grammar allows them in that order; gold first rises (more and better legal words) and then falls
(illegal bigrams) while responses stay long. Nothing in the proxy is hard-coded to be wrong: the blind spot is a
property of the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rlhf.task import BOS, EOS, N_SPECIAL, response_mask

POWER_STEPS = 2000  # power iterations for the word frequencies (the lazy chain has converged to float64 long before)


@dataclass(frozen=True)
class Grammar:
    """The reference language and its gold reward. All tensors live on the CPU.

    transition: (V, V) next-token probabilities, every row sums to 1 (EOS is absorbing).
    legal:      (V, V) bool, which bigrams the grammar allows (transition > 0).
    quality:    (V,) per-token quality used by the gold reward: quality_mean + z per word (z standardised under the
                language's word frequencies), 0 for BOS/EOS.
    """

    transition: torch.Tensor
    legal: torch.Tensor
    quality: torch.Tensor
    illegal_penalty: float
    prompt_len: int
    max_new_tokens: int

    reward: ClassVar[str] = "learned"  # PPO optimises a proxy reward model trained on gold preferences

    @property
    def vocab_size(self) -> int:
        return self.transition.shape[0]

    def gold(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``gold_reward``: prompts (b, p), responses (b, t) -> (b,)."""
        return gold_reward(self, prompts, responses)

    def metrics(self, prompts: torch.Tensor, responses: torch.Tensor) -> dict[str, torch.Tensor]:
        """{'illegal': share of ungrammatical words per response}, each (b,) (the proxy's blind spot)."""
        return {"illegal": illegal_fraction(self, prompts, responses)}

    def preference_prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``sample_prompts``: fresh prompts for the reward model's pairs (``rlhf.task.LearnedRewardTask``)."""
        return sample_prompts(self, n, generator)


def make_grammar(
    seed: int,
    *,
    n_words: int,
    n_successors: int,
    p_eos: float,
    quality_mean: float,
    illegal_penalty: float,
    prompt_len: int,
    max_new_tokens: int,
) -> Grammar:
    """Draws the random grammar and the gold quality of each word from ``seed`` (every value explicit).

    Each word gets ``n_successors`` legal successors among the *other* words (no word may follow itself) with
    Dirichlet(1) weights, and quality ``quality_mean + z`` with z ~ N(0, 1) standardised under the language's word
    frequencies (``word_frequencies``): mean exactly ``quality_mean`` and SD exactly 1 over the words it uses."""
    if not 1 <= n_successors < n_words:
        raise ValueError(f"n_successors ({n_successors}) must be in [1, n_words - 1] = [1, {n_words - 1}]")
    g = torch.Generator().manual_seed(seed)
    vocab = n_words + N_SPECIAL
    transition = torch.zeros(vocab, vocab, dtype=torch.float64)
    for w in range(n_words):
        others = torch.cat([torch.arange(w), torch.arange(w + 1, n_words)])  # no self-loop
        succ = others[torch.randperm(n_words - 1, generator=g)[:n_successors]] + N_SPECIAL
        # Dirichlet(1, ..., 1) weights as normalised Exp(1) draws, taken from our own generator.
        expo = -torch.log(torch.rand(n_successors, generator=g, dtype=torch.float64))
        transition[w + N_SPECIAL, succ] = (1.0 - p_eos) * expo / expo.sum()
        transition[w + N_SPECIAL, EOS] = p_eos
    transition[BOS, N_SPECIAL:] = 1.0 / n_words  # sentences start at any word
    transition[EOS, EOS] = 1.0  # absorbing: after EOS comes only EOS padding
    quality = torch.zeros(vocab, dtype=torch.float64)
    z = torch.randn(n_words, generator=g, dtype=torch.float64)
    freq = word_frequencies(transition)  # (n_words,)
    z = z - (freq * z).sum()
    quality[N_SPECIAL:] = quality_mean + z / (freq * z.square()).sum().sqrt()  # mean quality_mean, SD 1 under freq
    return Grammar(
        transition=transition.float(),
        legal=transition > 0,
        quality=quality.float(),
        illegal_penalty=illegal_penalty,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
    )


def word_frequencies(transition: torch.Tensor) -> torch.Tensor:
    """Long-run word frequencies of the language: (V, V) transition -> (n_words,) probabilities.

    The stationary distribution pi = pi P of the word chain P (transition between words, renormalised without EOS,
    which every word reaches with the same probability), reached from the uniform start of a sentence by power
    iteration on the lazy chain (I + P) / 2 (same stationary distribution, aperiodic)."""
    words = transition[N_SPECIAL:, N_SPECIAL:].double()
    chain = words / words.sum(1, keepdim=True)  # (n, n)
    lazy = 0.5 * (torch.eye(len(chain), dtype=chain.dtype) + chain)
    pi = torch.full((len(chain),), 1.0 / len(chain), dtype=chain.dtype)
    for _ in range(POWER_STEPS):
        pi = pi @ lazy
    return pi / pi.sum()


def sample_prompts(grammar: Grammar, n: int, generator: torch.Generator) -> torch.Tensor:
    """n prompts of BOS + (prompt_len - 1) words drawn from the chain. Returns (n, prompt_len) long.

    Prompt words never contain EOS: the chain is conditioned on not ending inside the prompt."""
    words = grammar.transition.clone()
    words[:, EOS] = 0.0
    tokens = torch.full((n, grammar.prompt_len), BOS, dtype=torch.long)
    for i in range(1, grammar.prompt_len):
        tokens[:, i] = torch.multinomial(words[tokens[:, i - 1]], 1, generator=generator).squeeze(1)
    return tokens


def sample_responses(grammar: Grammar, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Demonstrations: complete sentences that continue each prompt with the grammar. Returns (n, max_new_tokens).

    A demonstration has at least one word (EOS cannot come first: every prompt asks for content) and always ends
    with EOS within ``max_new_tokens``: a sentence still going after ``max_new_tokens - 1`` words ends there (EOS
    is legal after every word). After EOS, EOS pads."""
    n, t_max = prompts.shape[0], grammar.max_new_tokens
    out = torch.full((n, t_max), EOS, dtype=torch.long)
    prev, done = prompts[:, -1], torch.zeros(n, dtype=torch.bool)
    for t in range(t_max - 1):
        probs = grammar.transition[prev]
        if t == 0:
            probs = probs.clone()
            probs[:, EOS] = 0.0
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)
        out[:, t] = nxt
        done = done | (nxt == EOS)
        prev = nxt
    return out  # the last position stays EOS


def gold_reward(grammar: Grammar, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """The gold reward of the module docstring. prompts (b, p), responses (b, t) -> (b,) float."""
    prev = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1)  # (b, t)
    legal = grammar.legal.to(prev.device)[prev, responses]  # (b, t); the grammar's tables stay on the CPU
    quality = grammar.quality.to(prev.device)[responses]  # (b, t)
    per_token = torch.where(legal, quality, torch.tensor(-grammar.illegal_penalty))
    counted = response_mask(responses) * (responses != EOS).float()
    return (per_token * counted).sum(1) / grammar.max_new_tokens


def illegal_fraction(grammar: Grammar, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """(b,) fraction of counted response tokens that form an illegal bigram with their predecessor."""
    prev = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1)
    counted = response_mask(responses) * (responses != EOS).float()
    illegal = (~grammar.legal.to(prev.device)[prev, responses]).float() * counted
    return illegal.sum(1) / counted.sum(1).clamp(min=1.0)


def build_grammar(seed: int, *, n_demos: int, n_train_prompts: int, n_eval_prompts: int, **language) -> dict:
    """Grammar instance ``seed`` (``language``: the other arguments of ``make_grammar``): the language,
    demonstrations drawn from it, RL and held-out prompts."""
    grammar = make_grammar(seed, **language)
    g = torch.Generator().manual_seed(seed)
    demo_prompts = sample_prompts(grammar, n_demos, g)
    return {
        "task": grammar,
        "demo_prompts": demo_prompts,
        "demo_responses": sample_responses(grammar, demo_prompts, g),
        "train_prompts": sample_prompts(grammar, n_train_prompts, g),
        "eval_prompts": sample_prompts(grammar, n_eval_prompts, g),
    }
