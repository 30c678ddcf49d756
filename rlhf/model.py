"""A tiny causal transformer in plain PyTorch, and the small interface PPO needs from a model.

PPO touches a language model only through ``model(tokens) -> logits (b, s, V)`` (teacher-forced) and
``generate`` below; value and reward models are a backbone plus a scalar head (``ScalarModel``). A Hugging Face
causal LM fits the same interface through ``rlhf.hf.HFLM`` (``hidden`` with its ``past_key_values``, ``head``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def default_device() -> torch.device:
    """CUDA when present, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, first: int = 0):
        """x (b, s, d) -> (b, s - first, d): every position is a key and value, positions ``first``.. are the
        queries whose outputs are returned (0: all; with a cache, the new positions are the queries)."""
        b, s, d = x.shape
        # split, not view + permute: the same (b, h, s, d/h) views of the same numbers, but the backward joins the
        # three gradients with one cat instead of a stack plus a strided copy of the whole (b, s, 3d) gradient
        heads = lambda t: t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)
        q, k, v = map(heads, self.qkv(self.ln1(x)).split(d, dim=-1))
        if cache is not None:  # incremental decoding: attend to every cached position, no mask needed
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            att = F.scaled_dot_product_attention(q, k, v)  # (b, h, s, d/h)
        elif first:  # query i (position first + i) sees keys 0 .. first + i
            mask = torch.ones(s - first, s, dtype=torch.bool, device=x.device).tril(first)
            q, x = q[:, :, first:], x[:, first:]
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (b, h, s - first, d/h)
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, -1, d))
        return x + self.mlp(self.ln2(x)), (k, v)


class TinyLM(nn.Module):
    """Pre-LN GPT: token + learned position embeddings, ``n_layers`` blocks, tied-free LM head."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def hidden(self, tokens: torch.Tensor, cache: KVCache | None = None, start: int = 0, first: int = 0):
        """tokens (b, s) at positions start..start+s-1 -> hidden (b, s - first, d) of the tokens from index
        ``first`` on, and the updated cache (of every position). ``first`` > 0 (no cache) computes what those
        outputs need and no more: the last block takes queries from ``first`` only (the causal mask means the
        other positions matter only as keys and values)."""
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        new_cache = []
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if cache is None else cache[i], first if i == last else 0)
            new_cache.append(kv)
        return self.ln_f(x), new_cache

    def forward(self, tokens: torch.Tensor, first: int = 0) -> torch.Tensor:
        """tokens (b, s) -> logits (b, s - first, V) at positions first..s-1; logits[:, i] predict
        tokens[:, first + i + 1]."""
        return self.head(self.hidden(tokens, first=first)[0])


class ScalarModel(nn.Module):
    """Backbone + scalar head: a value model (per position) or a reward model (read at the last token).

    ``gain``/``bias`` are buffers that normalise the reward model's scores (lm-human-preferences
    `train_reward.py` normalises the RM so SFT samples score mean 0, std 1)."""

    def __init__(self, backbone: TinyLM):
        super().__init__()
        self.backbone = backbone
        d = backbone.head.in_features  # the hidden size, for any backbone with ``hidden`` + a Linear ``head``
        device = backbone.head.weight.device  # the head is drawn on the CPU (the same numbers on any device), then
        self.backbone.head = nn.Identity()  # the LM head is unused; keep state_dicts small and honest
        self.score = nn.Linear(d, 1).to(device)  # moved to the backbone's
        self.register_buffer("gain", torch.ones((), device=device))
        self.register_buffer("bias", torch.zeros((), device=device))

    def forward(self, tokens: torch.Tensor, first: int = 0) -> torch.Tensor:
        """tokens (b, s) -> scalars (b, s - first) at positions first..s-1 (``TinyLM.hidden``'s ``first``)."""
        h = hidden_from(self.backbone, tokens, first)
        return self.score(h).squeeze(-1) * self.gain + self.bias


def hidden_from(backbone: nn.Module, tokens: torch.Tensor, first: int, **kw) -> torch.Tensor:
    """The backbone's hidden states (b, s - first, d) of tokens (b, s) at positions first..s-1: a ``TinyLM``
    computes only what they need, any other backbone (``rlhf.hf.HFLM``) all positions, then sliced."""
    if isinstance(backbone, TinyLM) and not kw:
        return backbone.hidden(tokens, first=first)[0]
    return backbone.hidden(tokens, **kw)[0][:, first:]


@contextmanager
def full_precision(*models: nn.Module):
    """Inside the block, every submodule with an ``autocast_dtype`` (``rlhf.hf.HFLM`` under bf16 autocast) runs in
    fp32; the setting is restored afterwards. For measurements that must not depend on the training precision
    (the exact KL of ``rlhf.evaluate``). A no-op for ``TinyLM``, which has no autocast option."""
    saved = [(m, m.autocast_dtype) for model in models for m in model.modules() if hasattr(m, "autocast_dtype")]
    for m, _ in saved:
        m.autocast_dtype = None
    try:
        yield
    finally:
        for m, dtype in saved:
            m.autocast_dtype = dtype


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) gathered at tokens: logits (b, t, V), tokens (b, t) -> (b, t)."""
    return torch.gather(F.log_softmax(logits, dim=-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def response_logits(
    model: nn.Module,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    temperature: float,
    prompt_mask: torch.Tensor | None = None,
):
    """Teacher-forced logits of the response tokens, scaled by the sampling temperature.

    prompts (b, p), responses (b, t) -> (b, t, V): logits at positions p-1 .. p+t-2 of prompts + responses. The
    last response token predicts nothing and is not fed; a ``TinyLM`` computes only these positions
    (``TinyLM.hidden``'s ``first``). Dividing by the temperature in training as in sampling is detail 'scale the
    logits by sampling temperature' of Huang et al. 2024 (arXiv 2403.17031).
    ``prompt_mask`` (b, p): 0 on left padding of the prompts; only models that take an ``attention_mask``
    (``rlhf.hf.HFLM``) accept it."""
    tokens = torch.cat([prompts, responses[:, :-1]], dim=1)  # (b, p + t - 1)
    p = prompts.shape[1]
    if isinstance(model, TinyLM) and prompt_mask is None:
        return model(tokens, first=p - 1) / temperature
    kw = {}
    if prompt_mask is not None:
        kw["attention_mask"] = torch.cat([prompt_mask, prompt_mask.new_ones(tokens.shape[0], tokens.shape[1] - p)], 1)
    return model(tokens, **kw)[:, p - 1 :] / temperature


@torch.no_grad()
def generate(
    model: TinyLM,
    prompts: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos: int,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched ancestral sampling with a KV cache. prompts (b, p) -> responses (b, max_new_tokens).

    After a sequence emits ``eos`` every later token is ``eos`` (padding; see ``task.response_mask``).
    ``prompt_mask`` (b, p): 0 on left padding of the prompts, passed on as the ``attention_mask`` of models that
    take one (``rlhf.hf.HFLM``); None for today's fixed-length prompts."""
    b = prompts.shape[0]
    kw = {} if prompt_mask is None else {"attention_mask": prompt_mask}
    h, cache = model.hidden(prompts, **kw)
    logits = model.head(h[:, -1])
    out = torch.empty(b, max_new_tokens, dtype=torch.long, device=prompts.device)
    done = torch.zeros(b, dtype=torch.bool, device=prompts.device)
    for t in range(max_new_tokens):
        probs = F.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
        out[:, t] = nxt
        done |= nxt == eos
        if t + 1 < max_new_tokens:
            if prompt_mask is not None:
                kw["attention_mask"] = torch.cat([kw["attention_mask"], prompt_mask.new_ones(b, 1)], 1)
            h, cache = model.hidden(nxt[:, None], cache, start=prompts.shape[1] + t, **kw)
            logits = model.head(h[:, -1])
    return out


def adam(params, lr: float, eps: float) -> torch.optim.Adam:
    """The optimizer of every training loop (SFT, reward model, PPO): Adam (Kingma & Ba 2015, Algorithm 1),
    no weight decay; for each parameter theta (any shape), with gradient g, at step t = 1, 2, ...:

        m <- b1 m + (1 - b1) g,    v <- b2 v + (1 - b2) g^2,    b1, b2 = 0.9, 0.999
        theta <- theta - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    ``fused=True``: PyTorch's fused kernel (aten::_fused_adam_) applies this update to all parameters in one call
    instead of ~10 aten calls per tensor; the same update, deterministic, last float bits not the per-tensor loop's.
    """
    return torch.optim.Adam(params, lr=lr, eps=eps, fused=True)
