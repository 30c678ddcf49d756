"""The Hugging Face backend (rlhf/hf.py): the TinyLM interface, generation, vocabulary map, precision, save/load."""

import copy
import io
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config, LlamaConfig

from rlhf import hf
from rlhf import reward_model as R
from rlhf.config import KLConfig, no_kl
from rlhf.grammar import sample_prompts, sample_responses
from rlhf.model import ScalarModel, TinyLM, full_precision, generate, logprobs_from_logits, response_logits
from rlhf.ppo import train_ppo
from rlhf.sft import response_nll, train_sft
from rlhf.task import EOS, response_mask

from ..conftest import small_ppo_config

V, P, T = 10, 4, 6  # task vocabulary, prompt length, response length (the conftest grammar's)


def tiny_hf(family="llama", seed=0, vocab=V) -> hf.HFLM:
    torch.manual_seed(seed)
    return hf.from_config(family, vocab, 16, d_model=16, n_layers=2, n_heads=2, intermediate_size=32).eval()


def random_prompts(n, seed=0):
    prompts = torch.randint(2, V, (n, P), generator=torch.Generator().manual_seed(seed))
    prompts[:, 0] = 0  # BOS
    return prompts


def left_pad(prompts, lengths):
    """Keeps the last ``lengths[i]`` tokens of row i, left-padded (pad value EOS, never attended) -> tokens, mask."""
    mask = (torch.arange(prompts.shape[1])[None] >= prompts.shape[1] - torch.tensor(lengths)[:, None]).long()
    return torch.where(mask.bool(), prompts, torch.full_like(prompts, EOS)), mask


def sampled_logits(model, prompts, temperature, seed, prompt_mask=None):
    """generate(), plus the logits of every step as the sampler saw them (a hook on the LM head)."""
    seen = []
    handle = model.head.register_forward_hook(lambda mod, args, out: seen.append(out))  # (b, V) per step
    try:
        gen = torch.Generator().manual_seed(seed)
        responses = generate(model, prompts, T, temperature, gen, EOS, prompt_mask=prompt_mask)
    finally:
        handle.remove()
    return responses, torch.stack(seen, dim=1) / temperature  # (b, t), (b, t, V)


# --- generation and teacher-forced log-probs ------------------------------------------------------------------------


@pytest.mark.parametrize("family", hf.FAMILIES)
@pytest.mark.parametrize("temperature", [0.7, 1.6])
@pytest.mark.parametrize("padded", [False, True])
def test_teacher_forced_logprobs_equal_logprobs_of_sampled_tokens(family, temperature, padded):
    model = tiny_hf(family)
    prompts, prompt_mask = random_prompts(64), None
    if padded:
        prompts, prompt_mask = left_pad(prompts, [P, P - 1, P - 2, 1] * 16)
    responses, logits = sampled_logits(model, prompts, temperature, seed=3, prompt_mask=prompt_mask)
    mask = response_mask(responses)  # sampled positions: up to and including the first EOS
    with torch.no_grad():
        forced = logprobs_from_logits(response_logits(model, prompts, responses, temperature, prompt_mask), responses)
    sampled = logprobs_from_logits(logits, responses)
    assert 0 < ((responses == EOS).sum(1) > 0).sum() < 64  # some rows end early, some never emit EOS
    torch.testing.assert_close(forced * mask, sampled * mask, atol=1e-5, rtol=0)
    # EOS padding semantics of task.response_mask: after the first EOS, only EOS
    assert ((responses == EOS) | (mask == 1)).all()


@pytest.mark.parametrize("family", hf.FAMILIES)  # gpt2's learned positions catch a position shift; rope cannot
def test_left_padded_batch_gives_the_logprobs_of_each_unpadded_sequence(family):
    model = tiny_hf(family)
    prompts, responses = random_prompts(4), torch.randint(1, V, (4, T), generator=torch.Generator().manual_seed(1))
    lengths = [P, 3, 2, 1]
    padded, mask = left_pad(prompts, lengths)
    with torch.no_grad():
        batch = response_logits(model, padded, responses, 0.8, prompt_mask=mask)
        for i, n in enumerate(lengths):
            alone = response_logits(model, prompts[i : i + 1, P - n :], responses[i : i + 1], 0.8)
            torch.testing.assert_close(batch[i : i + 1], alone, atol=1e-5, rtol=0)
        # and the padding is what makes the difference: without the mask the padded rows change
        unmasked = response_logits(model, padded, responses, 0.8)
    assert torch.equal(unmasked[0], batch[0]) and not torch.allclose(unmasked[3], batch[3], atol=1e-3)


def test_generation_with_extra_left_padding_samples_the_same_tokens():
    model = tiny_hf("gpt2")
    prompts = random_prompts(32)
    wide = torch.cat([torch.full((32, 3), EOS), prompts], dim=1)
    mask = torch.cat([torch.zeros(32, 3, dtype=torch.long), torch.ones(32, P, dtype=torch.long)], dim=1)
    plain = generate(model, prompts, T, 1.0, torch.Generator().manual_seed(9), EOS)
    padded = generate(model, wide, T, 1.0, torch.Generator().manual_seed(9), EOS, prompt_mask=mask)
    assert torch.equal(plain, padded)


# --- vocabulary: from config (identity) and a pretrained model with a larger vocabulary -----------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_restricted_vocab_logits_are_the_full_models_logits_at_the_task_ids(tmp_path, tied):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
        pad_token_id=5,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)  # a "pretrained" model on disk
    token_ids = [33, 7, 2, 39, 11, 20, 0, 14, 25, 30]  # task id i -> model id token_ids[i]
    model = hf.from_pretrained(tmp_path, token_ids)
    full = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    tokens = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = full(torch.tensor(token_ids)[tokens]).logits[..., token_ids]  # (3, 8, V)
        got = model(tokens)
    assert got.shape == (3, 8, V)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert (model.head.weight is model.body.get_input_embeddings().weight) == tied
    assert model.config.task_token_ids == token_ids and model.config.vocab_size == V
    assert model.config.pad_token_id is None and model.body.get_input_embeddings().padding_idx is None
    # a pipeline checkpoint of the restricted model rebuilds without the pretrained directory
    buf = io.BytesIO()
    torch.save({"arch": hf.arch(model), "state_dict": model.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    again = hf.from_arch(ckpt["arch"])
    again.load_state_dict(ckpt["state_dict"])
    with torch.no_grad():
        assert torch.equal(again(tokens), got)
    assert again.config.task_token_ids == token_ids


# --- a real model's restriction keeps the exact KL exact (issue 31) ---------------------------------------------------


def exact_kl_over_task_tokens(full_policy, full_ref, token_ids, prompts, responses) -> torch.Tensor:
    """Mean over prompts of sum_t m_t sum_i p_i log(p_i / q_i), i over the task's tokens: p and q the *full*
    models' next-token distributions at ``token_ids`` renormalised (softmax over those logits), in float64, one
    explicit term per task token. Task token sequences are mapped to model ids first."""
    ids, n = torch.tensor(token_ids), prompts.shape[1]
    seq = ids[torch.cat([prompts, responses], 1)]  # (b, p + t) model ids
    with torch.no_grad():
        lp = full_policy(seq).logits[:, n - 1 : -1, token_ids].double().log_softmax(-1)  # (b, t, 15)
        lq = full_ref(seq).logits[:, n - 1 : -1, token_ids].double().log_softmax(-1)
    kl = torch.zeros(lp.shape[:2], dtype=torch.float64)
    for i in range(len(token_ids)):
        kl += lp[..., i].exp() * (lp[..., i] - lq[..., i])
    return (kl * response_mask(responses)).sum(1).mean()


def assert_restricted_kl_is_the_exact_task_sum(full_ref, token_ids, task, prompts, seed=0, move=0.5) -> float:
    """The policy is ``full_ref`` with the first block's MLP output weights moved (noise of ``move`` x their mean
    absolute value); both are restricted to the task's
    tokens as a pretrained model is (``restrict_vocab``, then ``HFLM``); the evaluation's exact KL of the restricted
    pair (``rlhf.evaluate.measure``, the number every report shows) equals ``exact_kl_over_task_tokens`` of the full
    pair on the same sampled responses. Returns that KL."""
    from rlhf.evaluate import measure

    full_policy = copy.deepcopy(full_ref).eval()
    with torch.no_grad():
        w = full_policy.get_decoder().layers[0].mlp.down_proj.weight
        w.add_(move * w.abs().mean() * torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)))
    policy = hf.HFLM(hf.restrict_vocab(copy.deepcopy(full_policy), token_ids)).eval()
    ref = hf.HFLM(hf.restrict_vocab(copy.deepcopy(full_ref), token_ids)).eval()
    assert policy.config.vocab_size == len(token_ids) == task.vocab_size
    kl = measure(policy, ref, None, task, prompts, 1.0, seed)["kl"]
    g = torch.Generator().manual_seed(seed)  # measure's own draws, again
    with torch.no_grad():
        responses = generate(policy, prompts, task.max_new_tokens, 1.0, g, EOS)
    assert responses.min() >= 0 and responses.max() < task.vocab_size  # only the task's tokens are ever sampled
    expected = exact_kl_over_task_tokens(full_policy, full_ref.eval(), token_ids, prompts, responses).item()
    assert kl > 1e-4, kl  # a real difference between the two models, not 0 = 0
    assert kl == pytest.approx(expected, rel=1e-5, abs=1e-7)
    return kl


@pytest.mark.parametrize("tied", [True, False])
def test_restricted_models_exact_kl_is_the_sum_over_the_15_arithmetic_tokens(tied):
    from rlhf.arithmetic import build_arithmetic

    from ..conftest import ARITHMETIC

    fields = {k: v for k, v in ARITHMETIC.items() if k != "split_seed"}  # the instance seed is the split seed
    data = build_arithmetic(0, **fields, n_demos=4, n_train_prompts=4, n_eval_prompts=24)
    torch.manual_seed(0)
    config = hf.causal_lm_config("llama", 60, 16, 16, 2, 2, 32)  # a "pretrained" vocabulary larger than the task's
    config.num_key_value_heads, config.tie_word_embeddings = 1, tied  # grouped-query attention, as SmolLM2
    config.initializer_range = 0.5  # weights large enough for distributions far from uniform
    full = AutoModelForCausalLM.from_config(config)
    token_ids = [0, 2, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 27, 29, 45]  # SmolLM2's ids of the 15 tokens
    assert_restricted_kl_is_the_exact_task_sum(full, token_ids, data["task"], data["eval_prompts"])


# --- GGUF conversion: the directory's bytes depend on the weights only ---------------------------------------------


def test_save_pretrained_stable_writes_the_same_bytes_twice_with_sorted_json(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "a", "b"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), bos_token="<s>")
    lm = AutoModelForCausalLM.from_config(hf.causal_lm_config("llama", 5, 16, 16, 1, 2, 32))
    for d in ("a", "b"):
        hf.save_pretrained_stable(lm, tok, tmp_path / d)
    files = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    config = (tmp_path / "a" / "config.json").read_text()
    assert config == json.dumps(json.loads(config), indent=2, sort_keys=True) + "\n"
    again = hf.from_pretrained(tmp_path / "a", None)
    tokens = random_prompts(3) % 5
    with torch.no_grad():
        assert torch.equal(again(tokens), lm.eval()(tokens).logits)


def test_from_gguf_drops_the_quantisation_from_the_config_it_saves(monkeypatch):
    """A GGUF-loaded config carries ``quantization_config``; a directory saved with it would be read as still
    quantised. from_gguf copies the weights into a fresh model of the config without it (and without the source
    path), keeping tied embeddings tied."""
    config = hf.causal_lm_config("llama", 5, 16, 16, 1, 2, 32)
    config.tie_word_embeddings = True
    loaded = AutoModelForCausalLM.from_config(config)
    loaded.config.quantization_config = {"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False}
    loaded.config._name_or_path = "/somewhere/on/the/converting/machine"
    calls = {}

    def fake_from_pretrained(directory, gguf_file, **kw):
        calls["model"] = (directory, gguf_file, kw.get("local_files_only"))
        return loaded

    monkeypatch.setattr(hf.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(hf.AutoTokenizer, "from_pretrained", lambda directory, gguf_file, **kw: "tokenizer")
    lm, tok = hf.from_gguf("/pkg", "m.gguf")
    assert calls["model"] == ("/pkg", "m.gguf", True) and tok == "tokenizer"
    assert lm is not loaded and not hasattr(lm.config, "quantization_config") and lm.config._name_or_path == ""
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    for k, v in loaded.state_dict().items():
        assert torch.equal(lm.state_dict()[k], v), k


def test_restrict_vocab_rejects_repeated_or_out_of_range_ids():
    lm = AutoModelForCausalLM.from_config(hf.causal_lm_config("llama", 20, 16, 16, 1, 2, 32))
    for bad in ([0, 1, 1], [0, 1, 20]):
        with pytest.raises(ValueError, match="distinct model ids"):
            hf.restrict_vocab(lm, bad)


def test_token_ids_from_a_local_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat"])}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), bos_token="<s>", eos_token="</s>"
    )
    tok.save_pretrained(tmp_path)
    assert hf.token_ids_from_tokenizer(tmp_path, ["<s>", "</s>", "mat", "the"]) == [1, 2, 7, 3]
    with pytest.raises(ValueError, match="dog"):
        hf.token_ids_from_tokenizer(tmp_path, ["<s>", "</s>", "dog"])


# --- save / load ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_save_pretrained_directory_loads_back_identically(tmp_path, family):
    model = tiny_hf(family)
    with torch.no_grad():
        for p in model.parameters():  # not the initial weights: loading must really read the file
            p.add_(0.01 * torch.randn_like(p))
    hf.save_pretrained(model, tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    loaded = hf.from_pretrained(tmp_path, None)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()  # a real HF directory
    tokens = random_prompts(5)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
        assert torch.equal(plain(tokens).logits, model(tokens))
    assert loaded.state_dict().keys() == model.state_dict().keys()


def test_pipeline_checkpoint_of_lm_and_scalar_model_loads_with_weights_only():
    model = tiny_hf()
    rm = ScalarModel(copy.deepcopy(model))
    with torch.no_grad():
        rm.gain.fill_(1.7)
    for obj, rebuild in ((model, lambda a: hf.from_arch(a)), (rm, lambda a: ScalarModel(hf.from_arch(a)))):
        buf = io.BytesIO()
        torch.save({"arch": hf.arch(model), "state_dict": obj.state_dict()}, buf)
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        loaded = rebuild(ckpt["arch"])
        loaded.load_state_dict(ckpt["state_dict"])
        tokens = random_prompts(3)
        with torch.no_grad():
            assert torch.equal(loaded.eval()(tokens), obj(tokens))


def test_scalar_model_on_hf_backbone_drops_the_lm_head():
    rm = ScalarModel(tiny_hf())
    assert rm(random_prompts(3)).shape == (3, P)
    assert not any(k.startswith("backbone.head") for k in rm.state_dict())
    with pytest.raises(ValueError, match="no LM head"):
        hf.save_pretrained(rm.backbone, "unused")


# --- dropout, unsupported architectures, precision ------------------------------------------------------------------


def test_dropout_of_a_pretrained_config_is_switched_off(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=1, n_head=2)  # dropout 0.1 by default
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = hf.from_pretrained(tmp_path, None).train()
    tokens = random_prompts(8)
    with torch.no_grad():
        assert torch.equal(model(tokens), model(tokens))
    assert model.config.resid_pdrop == 0.0 and model.config.attn_pdrop == 0.0


def test_architecture_whose_logits_are_not_the_head_of_the_hidden_state_is_refused():
    config = Gemma2Config(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=0.5,  # logits = 0.5 * tanh(head(h) / 0.5)
    )
    with pytest.raises(ValueError, match="not supported"):
        hf.HFLM(AutoModelForCausalLM.from_config(config))


def test_bf16_autocast_keeps_fp32_weights_and_fp32_logits():
    model = tiny_hf()
    tokens = random_prompts(8)
    with torch.no_grad():
        exact = model(tokens)
    hf.set_autocast(model, torch.bfloat16)
    logits = model(tokens)
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, exact)  # the backbone did run in bf16 ...
    torch.testing.assert_close(logits, exact, atol=0.1, rtol=0.05)  # ... to bf16 precision
    logits.logsumexp(-1).mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    # the same weights in the same precision give the same logits: KL(policy || reference) is exactly 0 at init
    ref = hf.set_autocast(copy.deepcopy(model), torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ref(tokens), model(tokens))
    with torch.no_grad(), full_precision(model, ref):  # the exact-KL measurement: fp32 whatever the training does
        assert torch.equal(model(tokens), exact) and torch.equal(ref(tokens), exact)
    assert model.autocast_dtype == ref.autocast_dtype == torch.bfloat16
    hf.set_autocast(model, None)
    with torch.no_grad():
        assert torch.equal(model(tokens), exact)
    with pytest.raises(TypeError, match="HFLM"):
        hf.set_autocast(TinyLM(V, 16), torch.bfloat16)


# --- the whole loop: SFT, reward model, PPO with every model on the hf backend --------------------------------------


@pytest.fixture(scope="module")
def hf_setup(grammar):
    """SFT and a Bradley-Terry reward model on a tiny Llama, as the conftest does for TinyLM (fewer steps)."""
    g = torch.Generator().manual_seed(0)
    prompts = sample_prompts(grammar, 256, g)
    responses = sample_responses(grammar, prompts, g)
    torch.manual_seed(0)
    sft = hf.from_config("llama", grammar.vocab_size, P + T, d_model=16, n_layers=1, n_heads=2, intermediate_size=32)
    before = response_nll(sft, prompts, responses).item()
    train_sft(sft, prompts, responses, steps=30, batch_size=32, lr=1e-2, generator=g, adam_eps=1e-8)
    after = response_nll(sft, prompts, responses).item()
    a = generate(sft, prompts, T, 1.0, g, EOS)
    b = generate(sft, prompts, T, 1.0, g, EOS)
    from rlhf.task import preference_pairs

    chosen, rejected, _ = preference_pairs(grammar, prompts, a, b, 0.0, g)
    rm = R.init_reward_model(sft)
    R.train_reward_model(rm, prompts, chosen, rejected, steps=20, batch_size=32, lr=1e-2, generator=g, adam_eps=1e-8)
    R.normalize(rm.eval(), prompts, a)
    policy = copy.deepcopy(sft.eval())
    with torch.no_grad():
        for p in policy.parameters():  # KL(policy || ref) > 0 from the first rollout
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return dict(sft=sft, rm=rm, policy=policy, prompts=prompts, nll=(before, after))


def run_hf_ppo(hf_setup, grammar, bf16=False, **overrides):
    s = hf_setup
    policy, ref, rm = (copy.deepcopy(s[k]) for k in ("policy", "sft", "rm"))
    if bf16:
        for m in (policy, ref, rm):  # the value model is train_ppo's copy of the reward model: bf16 as well
            hf.set_autocast(m, torch.bfloat16)
    out = train_ppo(
        policy,
        ref,
        rm,
        grammar,
        s["prompts"][:64],
        s["prompts"][64:80],
        small_ppo_config(**overrides),
    )
    return out, policy


@pytest.mark.parametrize("bf16", [False, True])
def test_ppo_runs_end_to_end_with_every_model_on_the_hf_backend(hf_setup, grammar, bf16):
    before, after = hf_setup["nll"]
    assert after < before - 0.3  # SFT through train_sft learned something on the hf backend
    kl = dict(placement="both", estimator="k3", coef=0.1)
    out, policy = run_hf_ppo(hf_setup, grammar, bf16, iterations=3, kl=kl)
    assert [row["iteration"] for row in out["history"]] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(list(row.values()))).all() for row in out["history"] + out["evals"])
    assert out["evals"][0]["kl"] > 0 and out["history"][0]["kl_loss"] > 0
    start = hf_setup["policy"].state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in policy.state_dict().items())


def test_zero_kl_coef_is_bit_identical_to_no_kl_on_the_hf_backend(hf_setup, grammar):
    none, policy_none = run_hf_ppo(hf_setup, grammar, kl=no_kl())
    zero, policy_zero = run_hf_ppo(
        hf_setup, grammar, kl=KLConfig(target="reference", placement="both", estimator="k1", coef=0.0)
    )
    assert zero["history"][0]["kl_reward"] != 0.0  # the KL that the zero multiplies is not itself zero
    drop = lambda rows: [{k: v for k, v in r.items() if k not in ("kl_reward", "kl_loss")} for r in rows]
    assert drop(zero["history"]) == drop(none["history"])
    assert zero["evals"] == none["evals"]
    assert all(torch.equal(v, policy_none.state_dict()[k]) for k, v in policy_zero.state_dict().items())
