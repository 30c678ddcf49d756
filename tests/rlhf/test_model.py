import pytest
import torch
import torch.nn.functional as F

from rlhf.model import ScalarModel, TinyLM, generate, logprobs_from_logits, response_logits

V, EOS, P, T = 10, 1, 4, 6


def random_lm(seed=0, eos_bias=0.0) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM(V, P + T, d_model=16, n_layers=2, n_heads=2).eval()
    with torch.no_grad():
        model.head.bias[EOS] += eos_bias
    return model


def random_prompts(n, seed=0):
    return torch.randint(2, V, (n, P), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def slow_generate(model, prompts, max_new_tokens, temperature, generator, eos):
    """Reference sampler: a full forward over the whole prefix at every step, no cache."""
    tokens = prompts
    done = torch.zeros(prompts.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        probs = F.softmax(model(tokens)[:, -1] / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt[done] = eos
        done = done | (nxt == eos)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return tokens[:, prompts.shape[1] :]


@pytest.mark.parametrize("temperature, eos_bias", [(1.0, 0.0), (0.7, 1.5)])
def test_generate_with_cache_matches_slow_sampler(temperature, eos_bias):
    model, prompts = random_lm(eos_bias=eos_bias), random_prompts(64)
    fast = generate(model, prompts, T, temperature, torch.Generator().manual_seed(5), EOS)
    slow = slow_generate(model, prompts, T, temperature, torch.Generator().manual_seed(5), EOS)
    assert fast.shape == (64, T)
    assert torch.equal(fast, slow)


def test_cached_logits_match_full_forward_at_every_prefix():
    model = random_lm()
    tokens = torch.randint(0, V, (3, P + T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        h, cache = model.hidden(tokens[:, :P])
        cached = [model.head(h)]
        for i in range(P, P + T):
            h, cache = model.hidden(tokens[:, i : i + 1], cache, start=i)
            cached.append(model.head(h))
    torch.testing.assert_close(torch.cat(cached, dim=1), full, atol=1e-5, rtol=0)


def test_generate_emits_only_eos_after_eos():
    model = random_lm(eos_bias=1.5)  # EOS is likely, and the untrained model happily continues after it
    out = generate(model, random_prompts(256), T, 1.0, torch.Generator().manual_seed(2), EOS)
    is_eos = out == EOS
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((256,), T))
    assert (first < T - 1).sum() > 20  # plenty of sequences end early, so the check below bites
    after = torch.arange(T)[None, :] > first[:, None]
    assert (out[after] == EOS).all()


def test_generate_is_reproducible_with_generator_state():
    model, prompts = random_lm(), random_prompts(16)
    a = generate(model, prompts, T, 1.0, torch.Generator().manual_seed(3), EOS)
    b = generate(model, prompts, T, 1.0, torch.Generator().manual_seed(3), EOS)
    c = generate(model, prompts, T, 1.0, torch.Generator().manual_seed(4), EOS)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_forward_is_causal():
    model = random_lm()
    tokens = random_prompts(2, seed=1)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :-1], model(changed)[:, :-1])
        assert not torch.allclose(model(tokens)[:, -1], model(changed)[:, -1])


def test_response_logits_align_with_response_tokens_and_scale_by_temperature():
    model = random_lm()
    prompts, responses = random_prompts(3), torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = response_logits(model, prompts, responses, temperature=0.5)
        full = model(torch.cat([prompts, responses], dim=1))
    assert logits.shape == (3, T, V)
    # logits[:, i] is the prediction for responses[:, i], made at position P - 1 + i
    torch.testing.assert_close(logits, full[:, P - 1 : P - 1 + T] / 0.5)
    lp = logprobs_from_logits(logits, responses)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(2, responses[..., None]).squeeze(-1))
    assert (lp <= 0).all()


def test_scalar_model_outputs_one_value_per_position():
    backbone = random_lm()
    model = ScalarModel(backbone)
    out = model(random_prompts(3))
    assert out.shape == (3, P)
    with torch.no_grad():
        model.gain.fill_(2.0)
        model.bias.fill_(1.0)
    torch.testing.assert_close(model(random_prompts(3)), 2.0 * out + 1.0)


def test_scalar_model_lives_on_its_backbones_device():
    """A backbone on another device (``meta`` here; CUDA in a GPU stage, where a head left on the CPU failed at the
    first forward) gets the score head and the buffers there too, and on the CPU the head draws the numbers it
    always drew."""
    model = ScalarModel(random_lm().to("meta"))
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    on_cpu = ScalarModel(random_lm(seed=7)).score.weight
    random_lm(seed=7)  # the same draws up to the head
    assert torch.equal(on_cpu, torch.nn.Linear(on_cpu.shape[1], 1).weight)


@pytest.mark.parametrize("first", [0, 1, P - 1, P + T - 1])
def test_forward_from_first_computes_the_full_forwards_later_positions(first):
    """``first`` only skips work: the outputs at positions first.. are those of the full forward (the last
    block takes fewer queries, so the float sums may round differently: equal to float tolerance)."""
    model = random_lm()
    tokens = torch.randint(0, V, (5, P + T), generator=torch.Generator().manual_seed(4))
    value = ScalarModel(random_lm(seed=1))
    with torch.no_grad():
        full, part = model(tokens), model(tokens, first=first)
        assert part.shape == (5, P + T - first, V)
        torch.testing.assert_close(part, full[:, first:], atol=1e-5, rtol=0)
        torch.testing.assert_close(value(tokens, first=first), value(tokens)[:, first:], atol=1e-5, rtol=0)
        if first == 0:
            assert torch.equal(part, full)


def test_response_values_read_the_state_before_each_response_token():
    from rlhf.ppo import response_values

    value = ScalarModel(random_lm(seed=2))
    prompts, responses = random_prompts(3), torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = response_values(value, prompts, responses)
        full = value(torch.cat([prompts, responses], dim=1))
    assert got.shape == (3, T)
    torch.testing.assert_close(got, full[:, P - 1 : P - 1 + T], atol=1e-5, rtol=0)
