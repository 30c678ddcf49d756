import copy
import math

import torch

from rlhf import reward_model as R
from rlhf.grammar import sample_prompts
from rlhf.model import generate
from rlhf.sft import response_nll
from rlhf.task import EOS


def test_sft_lowers_heldout_nll(sft, grammar):
    with torch.no_grad():
        nll = response_nll(sft.model, sft.heldout_prompts, sft.heldout_responses).item()
    assert nll < math.log(grammar.vocab_size) < sft.initial_nll
    assert nll < sft.initial_nll - 1.0


def test_response_nll_ignores_padding_after_eos(sft):
    prompts, responses = sft.heldout_prompts[:32], sft.heldout_responses[:32].clone()
    assert (responses == EOS).any()
    eos_seen = torch.cumsum((responses == EOS).long(), 1)
    padding = (eos_seen - (responses == EOS).long()) > 0
    assert padding.any()
    changed = responses.clone()
    changed[padding] = 2  # a word instead of EOS padding: masked out, must not change the loss
    with torch.no_grad():
        assert response_nll(sft.model, prompts, responses) == response_nll(sft.model, prompts, changed)


def test_reward_model_beats_chance_on_heldout_gold_pairs(rm):
    assert len(rm.better) > 100
    assert R.pairwise_accuracy(rm.model, rm.heldout_prompts, rm.better, rm.worse) > 0.6


def test_last_index_is_first_eos_or_final_position():
    responses = torch.tensor([[5, EOS, EOS, EOS], [EOS, 3, 3, 3], [4, 4, 4, 4]])
    assert R.last_index(responses).tolist() == [1, 0, 3]


def test_score_reads_the_last_response_token(rm):
    prompts = torch.tensor([[0, 2, 3, 4]])
    responses = torch.tensor([[5, EOS, 6, 7]])
    with torch.no_grad():
        per_pos = rm.model(torch.cat([prompts, responses], dim=1))
        assert R.score(rm.model, prompts, responses).item() == per_pos[0, 4 + 1].item()


def test_normalize_gives_mean0_std1_on_normalisation_set(rm, sft, grammar):
    model = copy.deepcopy(rm.model)
    g = torch.Generator().manual_seed(11)
    prompts = sample_prompts(grammar, 200, g)
    responses = generate(sft.model, prompts, grammar.max_new_tokens, 1.0, g, EOS)
    with torch.no_grad():
        model.gain.fill_(3.0)  # start far from normalised so the check is not vacuous
        model.bias.fill_(2.0)
        R.normalize(model, prompts, responses)
        s = R.score(model, prompts, responses)
    assert abs(s.mean().item()) < 1e-5
    assert abs(s.std().item() - 1.0) < 1e-5
