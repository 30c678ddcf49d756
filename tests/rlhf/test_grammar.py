import inspect

import pytest
import torch

from rlhf.grammar import (
    Grammar,
    gold_reward,
    illegal_fraction,
    make_grammar,
    sample_prompts,
    sample_responses,
    word_frequencies,
)
from rlhf.task import BOS, EOS, TIE, gold_difference, preference_pairs, response_mask

from ..conftest import TINY_TASK

A, B = 2, 3  # the two words of the hand-built grammar


@pytest.fixture(scope="module")
def hand_grammar() -> Grammar:
    """BOS, EOS, words a and b. Legal: a->b, b->a, b->EOS. Illegal: a->a, b->b (no word follows itself) and a->EOS
    (EOS is never scored). Qualities 1.5 and 0.5: quality_mean 1 plus z = +0.5 and -0.5."""
    transition = torch.tensor(
        [
            [0.0, 0.0, 0.5, 0.5],  # BOS -> a | b
            [0.0, 1.0, 0.0, 0.0],  # EOS -> EOS
            [0.0, 0.0, 0.0, 1.0],  # a -> b
            [0.0, 0.2, 0.8, 0.0],  # b -> EOS | a
        ]
    )
    return Grammar(
        transition=transition,
        legal=transition > 0,
        quality=torch.tensor([0.0, 0.0, 1.5, 0.5]),
        illegal_penalty=2.0,
        prompt_len=2,
        max_new_tokens=4,
    )


def test_response_mask_covers_up_to_and_including_first_eos():
    responses = torch.tensor(
        [
            [A, EOS, B, B],  # EOS in the middle, then garbage
            [EOS, A, A, A],  # EOS first
            [A, B, A, B],  # no EOS
            [A, B, EOS, EOS],  # EOS then padding
        ]
    )
    expected = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float)
    assert torch.equal(response_mask(responses), expected)


def test_gold_reward_hand_computed(hand_grammar):
    prompts = torch.tensor([[BOS, A]] * 5 + [[BOS, B]] * 2)
    responses = torch.tensor(
        [
            [B, A, B, EOS],  # grammatical: a->b (+0.5), b->a (+1.5), a->b (+0.5); a->EOS unscored -> 2.5 / 4
            [B, EOS, EOS, EOS],  # the same cut to one word: a->b (+0.5)                         -> 0.5 / 4
            [EOS, A, A, A],  # empty response, the rest not counted                                 -> 0
            [B, B, A, EOS],  # a->b (+0.5), b->b illegal (-2), b->a (+1.5)                           -> 0 / 4
            [A, A, A, A],  # a repeated word, no EOS: a->a illegal four times                      -> -8 / 4
            [A, EOS, B, B],  # b->a (+1.5), EOS, then padding not counted                          -> 1.5 / 4
            [A, B, A, B],  # all legal, no EOS (truncated): +1.5 + 0.5 + 1.5 + 0.5                  -> 4 / 4
        ]
    )
    gold = gold_reward(hand_grammar, prompts, responses)
    assert gold.tolist() == pytest.approx([0.625, 0.125, 0.0, 0.0, -2.0, 0.375, 1.0])
    assert illegal_fraction(hand_grammar, prompts, responses).tolist() == pytest.approx([0, 0, 0, 1 / 3, 1, 0, 0])
    # content beats truncation, truncation beats silence, silence beats a repeated word
    assert gold[0] > gold[1] > gold[2] > gold[4]


def test_gold_difference_treats_float_rounding_as_a_tie(hand_grammar):
    prompts = torch.tensor([[BOS, A], [BOS, A], [BOS, A]])
    a = torch.tensor([[B, A, B, EOS], [B, A, B, EOS], [B, EOS, EOS, EOS]])
    b = torch.tensor([[B, A, B, EOS], [B, A, EOS, EOS], [B, A, EOS, EOS]])
    assert gold_difference(hand_grammar, prompts, a, b).tolist() == pytest.approx([0.0, 0.125, -0.375])
    # one word of quality q against silence: gold difference q / 4, a tie below TIE, not above it
    word, empty = torch.tensor([[B, EOS, EOS, EOS]]), torch.tensor([[EOS, EOS, EOS, EOS]])
    for q, tied in ((2 * TIE, True), (8 * TIE, False)):
        g = Grammar(**{**hand_grammar.__dict__, "quality": torch.tensor([0.0, 0.0, 1.5, q])})
        assert (gold_difference(g, prompts[:1], word, empty)[0] == 0) == tied


def test_make_grammar_is_a_valid_markov_chain_without_self_loops():
    grammar = make_grammar(**{**TINY_TASK, "n_successors": 3})
    assert grammar.vocab_size == 10
    torch.testing.assert_close(grammar.transition.sum(1), torch.ones(10))
    assert torch.equal(grammar.legal, grammar.transition > 0)
    assert (grammar.legal[2:, 2:].sum(1) == 3).all()  # n_successors legal word successors per word
    assert not grammar.legal[2:, 2:].diagonal().any()  # no word may follow itself
    assert grammar.legal[2:, EOS].all()  # every word may end the sentence
    assert grammar.quality[:2].tolist() == [0.0, 0.0]
    assert torch.equal(make_grammar(**TINY_TASK).transition, make_grammar(**TINY_TASK).transition)


def test_word_frequencies_are_the_stationary_distribution_of_the_word_chain():
    grammar = make_grammar(**{**TINY_TASK, "seed": 3})
    pi = word_frequencies(grammar.transition)
    chain = grammar.transition[2:, 2:].double()
    chain = chain / chain.sum(1, keepdim=True)
    assert pi.sum().item() == pytest.approx(1.0) and (pi >= 0).all()
    torch.testing.assert_close(pi @ chain, pi)
    # ... and the word frequencies of long sampled sentences (words after the first few steps)
    g = torch.Generator().manual_seed(0)
    long = make_grammar(**{**TINY_TASK, "seed": 3, "p_eos": 0.01, "max_new_tokens": 40})
    responses = sample_responses(long, sample_prompts(long, 2000, g), g)[:, 10:]
    words = responses[responses >= 2] - 2
    empirical = torch.bincount(words, minlength=len(pi)).double() / len(words)
    assert 0.5 * (empirical - word_frequencies(long.transition)).abs().sum() < 0.03  # total variation


def test_make_grammar_quality_is_quality_mean_plus_standardised_normal():
    base = make_grammar(**{**TINY_TASK, "quality_mean": 0.0})
    shifted = make_grammar(**{**TINY_TASK, "quality_mean": 0.75})
    assert torch.equal(base.transition, shifted.transition)  # the mean moves quality only
    torch.testing.assert_close(shifted.quality[2:], base.quality[2:] + 0.75)
    for seed in range(5):  # every grammar: mean quality_mean and SD 1 under the language's word frequencies
        grammar = make_grammar(**{**TINY_TASK, "seed": seed})
        pi, q = word_frequencies(grammar.transition), grammar.quality[2:].double()
        assert (pi * q).sum().item() == pytest.approx(TINY_TASK["quality_mean"], abs=1e-6)
        assert (pi * (q - TINY_TASK["quality_mean"]).square()).sum().item() == pytest.approx(1.0, abs=1e-6)
    z = torch.cat([make_grammar(**{**TINY_TASK, "seed": s, "quality_mean": 0.0}).quality[2:] for s in range(100)])
    assert z.std().item() == pytest.approx(1.0, abs=0.15)  # roughly standard normal over words too


def test_make_grammar_has_no_defaults_and_refuses_self_loop_budget():
    assert all(p.default is inspect.Parameter.empty for p in inspect.signature(make_grammar).parameters.values())
    with pytest.raises(ValueError, match="n_successors"):
        make_grammar(**{**TINY_TASK, "n_successors": TINY_TASK["n_words"]})


def test_demonstrations_are_grammatical_complete_sentences_with_content():
    grammar = make_grammar(**{**TINY_TASK, "seed": 1, "p_eos": 0.2})
    g = torch.Generator().manual_seed(0)
    prompts = sample_prompts(grammar, 2000, g)
    responses = sample_responses(grammar, prompts, g)
    assert (prompts[:, 0] == BOS).all() and (prompts[:, 1:] != EOS).all()
    tokens = torch.cat([prompts, responses], dim=1)
    assert grammar.legal[tokens[:, :-1], tokens[:, 1:]].all()
    assert (illegal_fraction(grammar, prompts, responses) == 0).all()
    assert (responses[:, 0] != EOS).all()  # at least one word
    assert (responses[:, -1] == EOS).all()  # always ends within max_new_tokens
    lengths = response_mask(responses).sum(1)
    assert lengths.min() == 2 and lengths.max() == grammar.max_new_tokens  # both ends of the range occur
    # lengths follow the chain: P(one word, then EOS) = p_eos
    assert abs((lengths == 2).float().mean().item() - 0.2) < 0.03


def _pairs(grammar, n, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = sample_prompts(grammar, n, g)
    return prompts, sample_responses(grammar, prompts, g), sample_responses(grammar, prompts, g), g


def test_noiseless_preference_pairs_follow_gold():
    grammar = make_grammar(**TINY_TASK)
    prompts, a, b, g = _pairs(grammar, 2000, 0)
    chosen, rejected, agrees = preference_pairs(grammar, prompts, a, b, 0.0, g)
    gc, gr = gold_reward(grammar, prompts, chosen), gold_reward(grammar, prompts, rejected)
    assert (gc >= gr - TIE).all()
    not_tied = gold_difference(grammar, prompts, a, b) != 0
    assert not_tied.float().mean() > 0.5
    assert agrees[not_tied].all()
    # chosen/rejected are a and b, swapped per row
    assert (
        torch.eq(chosen, a).all(1) & torch.eq(rejected, b).all(1)
        | torch.eq(chosen, b).all(1) & torch.eq(rejected, a).all(1)
    ).all()


def test_noisy_preference_pairs_sometimes_disagree():
    grammar = make_grammar(**TINY_TASK)
    prompts, a, b, g = _pairs(grammar, 2000, 0)
    _, _, agrees = preference_pairs(grammar, prompts, a, b, 1.0, g)
    assert 0.3 < agrees.float().mean() < 0.95


def test_noiseless_preference_pairs_report_full_agreement_including_ties():
    grammar = make_grammar(**TINY_TASK)
    prompts, a, b, g = _pairs(grammar, 2000, 0)
    b[:100] = a[:100]  # identical responses: a tie, either label is as good as the noiseless comparison
    _, _, agrees = preference_pairs(grammar, prompts, a, b, 0.0, g)
    assert agrees.all()
