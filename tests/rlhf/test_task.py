import pytest
import torch

from rlhf.task import (
    BOS,
    EOS,
    Grammar,
    gold_reward,
    illegal_fraction,
    make_grammar,
    preference_pairs,
    response_mask,
    sample_prompts,
    sample_responses,
)

A, B = 2, 3  # the two words of the hand-built grammar


@pytest.fixture(scope="module")
def hand_grammar() -> Grammar:
    """BOS, EOS, words a and b. Legal: a->b, b->a, b->EOS. Illegal: a->a, b->b and a->EOS (EOS is never scored)."""
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
        quality=torch.tensor([0.0, 0.0, 0.5, -1.0]),
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
    prompts = torch.tensor([[BOS, A], [BOS, A], [BOS, A], [BOS, A], [BOS, B]])
    responses = torch.tensor(
        [
            [B, B, A, EOS],  # a->b ok (-1), b->b illegal (-2), b->a ok (+0.5); a->EOS -> -2.5 / 4
            [A, B, EOS, EOS],  # a->a illegal (-2), a->b ok (-1)                      -> -3 / 4
            [B, A, B, A],  # all legal, no EOS: -1 + 0.5 - 1 + 0.5                    -> -1 / 4
            [EOS, A, A, A],  # empty response (a->EOS unscored), rest not counted   -> 0
            [A, EOS, B, B],  # b->a ok (+0.5)                                         -> 0.5 / 4
        ]
    )
    gold = gold_reward(hand_grammar, prompts, responses)
    assert gold.tolist() == pytest.approx([-0.625, -0.75, -0.25, 0.0, 0.125])
    assert illegal_fraction(hand_grammar, prompts, responses).tolist() == pytest.approx([1 / 3, 1 / 2, 0, 0, 0])


def test_make_grammar_is_a_valid_markov_chain():
    grammar = make_grammar(0, n_words=8, n_successors=3, max_new_tokens=6)
    assert grammar.vocab_size == 10
    torch.testing.assert_close(grammar.transition.sum(1), torch.ones(10))
    assert torch.equal(grammar.legal, grammar.transition > 0)
    assert (grammar.legal[2:, 2:].sum(1) == 3).all()  # n_successors legal word successors per word
    assert grammar.quality[:2].tolist() == [0.0, 0.0]
    assert torch.equal(make_grammar(0, n_words=8).transition, make_grammar(0, n_words=8).transition)


def test_sampled_prompts_and_responses_use_only_legal_bigrams():
    grammar = make_grammar(1, n_words=8, max_new_tokens=6)
    g = torch.Generator().manual_seed(0)
    prompts = sample_prompts(grammar, 500, g)
    responses = sample_responses(grammar, prompts, g)
    assert (prompts[:, 0] == BOS).all() and (prompts[:, 1:] != EOS).all()
    tokens = torch.cat([prompts, responses], dim=1)
    assert grammar.legal[tokens[:, :-1], tokens[:, 1:]].all()
    assert (illegal_fraction(grammar, prompts, responses) == 0).all()
    assert (responses == EOS).any()  # EOS padding is exercised (EOS -> EOS is legal)


def _pairs(grammar, n, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = sample_prompts(grammar, n, g)
    return prompts, sample_responses(grammar, prompts, g), sample_responses(grammar, prompts, g), g


def test_noiseless_preference_pairs_follow_gold():
    grammar = make_grammar(0, n_words=8, max_new_tokens=6)
    prompts, a, b, g = _pairs(grammar, 2000, 0)
    chosen, rejected, agrees = preference_pairs(grammar, prompts, a, b, 0.0, g)
    gc, gr = gold_reward(grammar, prompts, chosen), gold_reward(grammar, prompts, rejected)
    assert (gc >= gr).all()
    not_tied = gold_reward(grammar, prompts, a) != gold_reward(grammar, prompts, b)
    assert agrees[not_tied].all()
    # chosen/rejected are a and b, swapped per row
    assert (
        torch.eq(chosen, a).all(1) & torch.eq(rejected, b).all(1)
        | torch.eq(chosen, b).all(1) & torch.eq(rejected, a).all(1)
    ).all()


def test_noisy_preference_pairs_sometimes_disagree():
    grammar = make_grammar(0, n_words=8, max_new_tokens=6)
    prompts, a, b, g = _pairs(grammar, 2000, 0)
    _, _, agrees = preference_pairs(grammar, prompts, a, b, 1.0, g)
    assert 0.3 < agrees.float().mean() < 0.95


def test_noiseless_preference_pairs_report_full_agreement_including_ties():
    grammar = make_grammar(0, n_words=8, max_new_tokens=6)
    prompts, a, b, g = _pairs(grammar, 2000, 0)
    b[:100] = a[:100]  # identical responses: a tie, either label is as good as the noiseless comparison
    _, _, agrees = preference_pairs(grammar, prompts, a, b, 0.0, g)
    assert agrees.all()
