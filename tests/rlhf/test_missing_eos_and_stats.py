"""The missing-EOS score (Huang et al. 2024) and the response statistics every evaluation reports."""

import pytest
import torch

from rlhf import ppo as P
from rlhf.evaluate import degenerate_responses, evaluate, keep_words, response_stats
from rlhf.grammar import gold_reward
from rlhf.reward_model import missing_eos, score
from rlhf.task import BOS, EOS

W = 2  # a word


def test_missing_eos_replaces_only_scores_of_responses_without_eos():
    scores = torch.tensor([0.3, -0.2, 1.7, 2.5])
    responses = torch.tensor(
        [
            [W, W, EOS, EOS],  # ends
            [EOS, EOS, EOS, EOS],  # empty: ends
            [W, W, W, EOS],  # ends at the last position
            [W, W, W, W],  # ran out of tokens
        ]
    )
    assert missing_eos(scores, responses, -1.0).tolist() == pytest.approx([0.3, -0.2, 1.7, -1.0])
    assert missing_eos(scores, responses, None) is scores  # off: untouched
    assert missing_eos(scores, responses, 5.0).tolist() == pytest.approx([0.3, -0.2, 1.7, 5.0])  # replaced, not capped


def test_train_ppo_step3_scores_use_the_missing_eos_score(run_ppo, ppo_setup, monkeypatch):
    """Every response without EOS gets exactly the fixed score at step 3; the others keep the proxy's score."""
    seen = []
    original = P.rewards_and_advantages

    def spy(traj, kl_reward, kl_coef, cfg):
        seen.append((traj.scores.clone(), traj.mask.clone()))
        return original(traj, kl_reward, kl_coef, cfg)

    monkeypatch.setattr(P, "rewards_and_advantages", spy)
    run_ppo(missing_eos_score=-7.0, iterations=2, kl={"coef": 0.0})
    truncated = torch.cat([(m.sum(1) == m.shape[1]) for _, m in seen])
    scores = torch.cat([s for s, _ in seen])
    # responses that end at the last position also have a full mask; only those truly without EOS get -7
    assert (scores == -7.0).any(), "the tiny policy never ran out of tokens: the test would be vacuous"
    assert ((scores == -7.0) <= truncated).all()
    assert (scores[~truncated] != -7.0).all()


def test_response_stats_hand_computed(ppo_setup):
    grammar, rm = ppo_setup.grammar, ppo_setup.reward_model
    prompts = ppo_setup.eval_prompts[:4]
    responses = torch.full((4, grammar.max_new_tokens), EOS)
    responses[1, :2] = torch.tensor([W, W + 1])
    responses[2:, :] = W  # two responses of one repeated word, without EOS
    out = response_stats(rm, grammar, prompts, responses)
    lengths = torch.tensor([1.0, 3.0, grammar.max_new_tokens, grammar.max_new_tokens])
    assert out["length"] == pytest.approx(lengths.mean().item())
    assert out["empty"] == 0.25
    assert out["truncated"] == 0.5
    assert out["gold"] == pytest.approx(gold_reward(grammar, prompts, responses).mean().item())
    with torch.no_grad():
        assert out["proxy"] == pytest.approx(score(rm, prompts, responses).mean().item())
    t = grammar.max_new_tokens  # the repeated word is illegal from its second occurrence on
    assert out["illegal"] >= 0.5 * (t - 1) / t


def test_evaluate_reports_length_empty_truncated(ppo_setup):
    s = ppo_setup
    out = evaluate(s.policy, s.ref, s.reward_model, s.grammar, {"": s.eval_prompts}, 1.0, 0)
    assert {"gold", "proxy", "kl", "entropy", "length", "empty", "truncated", "illegal"} == set(out)
    assert 1.0 <= out["length"] <= s.grammar.max_new_tokens
    assert 0.0 <= out["empty"] <= 1.0 and 0.0 <= out["truncated"] <= 1.0


def test_history_and_evals_carry_length_and_empty(run_ppo):
    run_none = run_ppo(kl=dict(placement="none", estimator=None, coef=0.0))
    assert all({"length", "empty", "truncated", "illegal"} <= set(e) for e in run_none["evals"])
    assert {"final_length", "final_empty", "final_truncated"} <= set(run_none["summary"])
    assert all("length" in row for row in run_none["history"])


def test_keep_words_cuts_and_ends_with_eos():
    responses = torch.tensor([[W, W + 1, W, EOS], [W, EOS, EOS, EOS], [EOS, EOS, EOS, EOS]])
    assert keep_words(responses, 1).tolist() == [[W, EOS, EOS, EOS], [W, EOS, EOS, EOS], [EOS] * 4]
    assert keep_words(responses, 2).tolist() == [[W, W + 1, EOS, EOS], [W, EOS, EOS, EOS], [EOS] * 4]
    assert torch.equal(keep_words(responses, 4), responses)


def test_degenerate_responses_are_what_they_say(grammar):
    g = torch.Generator().manual_seed(0)
    t = grammar.max_new_tokens
    sft = torch.tensor([[W, W + 1, EOS] + [EOS] * (t - 3), [W + 2] * (t - 1) + [EOS]])
    out = degenerate_responses(grammar, sft, g)
    assert (out["empty"] == EOS).all()
    for i in range(2, grammar.vocab_size):
        assert out[f"repeat_w{i}"][:, : t - 1].eq(i).all() and (out[f"repeat_w{i}"][:, -1] == EOS).all()
    assert (out["random_words"][:, : t - 1] >= 2).all() and (out["random_words"][:, -1] == EOS).all()
    same_eos = (out["random_sft_length"] == EOS) == (sft == EOS)
    assert same_eos.all()
    assert out["sft_first_1"].tolist() == keep_words(sft, 1).tolist()
    assert out["sft_first_2"].tolist() == keep_words(sft, 2).tolist()
    assert BOS not in out["random_words"]
