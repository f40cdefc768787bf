"""The reference Gemma 4 text decoder (transformers' Gemma4TextModel, model_type gemma4_text), with the call every
reference model has (export/models/reference.py):

    logits, present = model(input_ids, attention_mask, position_ids, past_key_values)

What Gemma 4 adds to Gemma 3 (export/models/llama.py's Gemma3Config), in one place:
- two kinds of layer with their own shapes: sliding-window layers (`head_dim`, `n_kv_head`, default rotary at
  `rope_local_theta`) and full layers (`global_head_dim`, and `global_kv_head` KV heads where the config has
  them), whose "proportional" rotary rotates the first partial_rotary_factor * global_head_dim / 2 pairs of
  a head (the pairs (i, i + global_head_dim / 2), as the whole head's rotate-half layout pairs them) and leaves
  the rest as they are;
- per-head RMSNorms on Q and K (a plain weight, no 1 + w) and a weightless one on V; attention scores are not
  scaled (the norms set their size);
- `attention_k_eq_v`: a full layer's values are its key projection (before the key norm), no v_proj;
- KV sharing: the last `num_kv_shared_layers` layers compute no keys or values; each attends over those of
  the last earlier layer of its own type (`kv_source`), so only the other layers keep a cache. `past` and
  `present` hold the cache-keeping layers' pairs only, in layer order;
- per-layer input embeddings: a second table (vocab_size_per_layer_input, n_layer * D) gathered per token and
  scaled by sqrt(D), added to a projection of the token embedding (times n_embd ** -0.5, RMS-normed over D),
  times 2 ** -0.5; layer i takes its D values, gates them by act(h W_gate) and adds norm(... W_proj) to the
  residual after the MLP;
- each layer's output (the whole residual stream) times its `layer_scalar`;
- the double-wide MLP: a shared layer's MLP twice `n_inner` wide (use_double_wide_mlp);
- the final logits soft-capped, cap * tanh(logits / cap).

Parameter names are transformers' (`model.layers.{i}.self_attn.q_proj`, `model.embed_tokens_per_layer`, ...), so
a Gemma4ForCausalLM state dict loads without renaming (export/families/gemma4.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import RMSNorm, apply_rotary
from .reference import Past, ReferenceModel, attention_bias, forward_inputs

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class Gemma4Config:
    vocab_size: int = 262144
    n_positions: int = 131072  # context length (max_position_embeddings)
    n_embd: int = 1536  # hidden_size
    n_layer: int = 35
    n_head: int = 8  # query heads, both kinds of layer
    n_kv_head: int = 1  # a sliding layer's KV heads
    head_dim: int = 256  # a sliding layer's head size
    global_head_dim: int = 512  # a full layer's head size
    global_kv_head: int | None = None  # a full layer's KV heads (num_global_key_value_heads); None: n_kv_head
    n_inner: int = 6144  # intermediate_size
    double_wide_mlp: bool = False  # a KV-shared layer's MLP is 2 * n_inner wide
    rms_norm_eps: float = 1e-6
    layer_types: list[str] = field(default_factory=list)  # per layer, one of LAYER_TYPES
    sliding_window: int = 512  # a sliding layer's query sees the last this many positions, its own included
    rope_theta: float = 1_000_000.0  # the full layers' rotary base
    partial_rotary_factor: float = 1.0  # the share of a full layer's head_dim / 2 pairs that rotate
    rope_factor: float = 1.0  # the full layers' frequencies divided by this (proportional rope's `factor`)
    rope_local_theta: float = 10_000.0  # the sliding layers' base (their whole heads rotate)
    attention_k_eq_v: bool = False  # full layers take V from the key projection
    num_kv_shared_layers: int = 0  # the last this many layers read an earlier layer's keys and values
    per_layer_dim: int = 0  # hidden_size_per_layer_input (D); 0: no per-layer input embeddings
    per_layer_vocab: int = 0  # vocab_size_per_layer_input
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = "gemma4_text"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.n_layer or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must be {self.n_layer} of {LAYER_TYPES}, got {self.layer_types!r:.80}")
        for layer in range(self.n_layer):
            if self.n_head % self.kv_heads(layer):
                raise ValueError(f"n_head ({self.n_head}) must be a multiple of layer {layer}'s KV heads")
        if self.head_dim % 2 or self.global_head_dim % 2:
            raise ValueError(f"head sizes must be even, got {self.head_dim} and {self.global_head_dim}")
        if not 0 <= self.num_kv_shared_layers < self.n_layer:
            raise ValueError(f"num_kv_shared_layers must be 0 .. {self.n_layer - 1}, got {self.num_kv_shared_layers}")
        first = self.n_layer - self.num_kv_shared_layers
        if self.num_kv_shared_layers and set(self.layer_types[first:]) - set(self.layer_types[:first]):
            raise ValueError("a KV-shared layer has no earlier layer of its type to read keys and values from")
        if self.per_layer_dim and self.per_layer_vocab < self.vocab_size:
            raise ValueError(
                f"vocab_size_per_layer_input {self.per_layer_vocab} is below vocab_size {self.vocab_size}: a token "
                "past it has no per-layer embedding"
            )

    def full(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def head_size(self, layer: int) -> int:
        return self.global_head_dim if self.full(layer) else self.head_dim

    def kv_heads(self, layer: int) -> int:
        return self.global_kv_head or self.n_kv_head if self.full(layer) else self.n_kv_head

    @property
    def kv_source(self) -> list[int]:
        """Per layer, the layer whose keys and values it attends over: itself, or for the last
        num_kv_shared_layers the last earlier cache-keeping layer of the same type (transformers'
        kv_sharing_modes)."""
        first = self.n_layer - self.num_kv_shared_layers
        last = {
            kind: max(i for i in range(first) if self.layer_types[i] == kind) for kind in set(self.layer_types[:first])
        }
        return [i if i < first else last[self.layer_types[i]] for i in range(self.n_layer)]

    def inner(self, layer: int) -> int:
        shared = self.kv_source[layer] != layer
        return self.n_inner * (2 if self.double_wide_mlp and shared else 1)

    def to_dict(self) -> dict:
        return asdict(self)


def rope_inv_freq(config: Gemma4Config, *, full: bool) -> torch.Tensor:
    """A layer type's frequencies, (its head size / 2,): the full layers' proportional ones (the first
    int(partial * head / 2) of theta ** (-2i / head), the rest 0, all divided by rope_factor), the sliding
    layers' default ones."""
    if not full:
        dim = config.head_dim
        return 1.0 / (config.rope_local_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    dim = config.global_head_dim
    angles = int(config.partial_rotary_factor * dim // 2)
    rotated = 1.0 / (config.rope_theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
    return torch.cat([rotated, torch.zeros(dim // 2 - angles)]) / config.rope_factor


def value_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (transformers' v_norm, with_scale=False)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Attention(nn.Module):
    def __init__(self, config: Gemma4Config, layer: int):
        super().__init__()
        c = config
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.kv_heads(layer), c.head_size(layer)
        self.shared = c.kv_source[layer] != layer  # reads kv_source's keys and values: no K/V of its own
        self.k_eq_v = c.attention_k_eq_v and c.full(layer)
        self.eps = c.rms_norm_eps
        self.q_proj = nn.Linear(c.n_embd, c.n_head * self.head_dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        if not self.shared:
            self.k_proj = nn.Linear(c.n_embd, self.n_kv_head * self.head_dim, bias=False)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(c.n_embd, self.n_kv_head * self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.o_proj = nn.Linear(c.n_head * self.head_dim, c.n_embd, bias=False)

    def forward(self, x, bias, cos, sin, past, shared):
        """shared: the (key, value) of kv_source (B, nkv, past + T, hs), for a shared layer; else its own past."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)  # (B, nh, T, hs)
        q = apply_rotary(q, cos, sin)
        if self.shared:
            k, v = shared
        else:
            k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)
            v = k if self.k_eq_v else self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)
            k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)  # (B, nkv, T, hs): the cache holds rotated keys
            v = value_norm(v, self.eps).transpose(1, 2)
            if past is not None:
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # (B, nkv, past + T, hs)
        group = self.n_head // self.n_kv_head
        scores = q @ k.repeat_interleave(group, dim=1).transpose(-2, -1)  # (B, nh, T, past + T): unscaled
        y = F.softmax(scores + bias, dim=-1) @ v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, config: Gemma4Config, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, inner, bias=False)
        self.up_proj = nn.Linear(config.n_embd, inner, bias=False)
        self.down_proj = nn.Linear(inner, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: Gemma4Config, layer: int):
        super().__init__()
        c, eps = config, config.rms_norm_eps
        self.sliding = not c.full(layer)
        self.input_layernorm = RMSNorm(c.n_embd, eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.n_embd, eps)
        self.pre_feedforward_layernorm = RMSNorm(c.n_embd, eps)
        self.mlp = MLP(c, c.inner(layer))
        self.post_feedforward_layernorm = RMSNorm(c.n_embd, eps)
        if c.per_layer_dim:
            self.per_layer_input_gate = nn.Linear(c.n_embd, c.per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(c.per_layer_dim, c.n_embd, bias=False)
            self.post_per_layer_input_norm = RMSNorm(c.n_embd, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, per_layer, bias, cos, sin, past, shared):
        """per_layer: (B, T, D), this layer's per-layer input (None without them)."""
        attn_out, present = self.self_attn(self.input_layernorm(x), bias, cos, sin, past, shared)
        x = x + self.post_attention_layernorm(attn_out)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if per_layer is not None:
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer  # (B, T, D)
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar, present


class Gemma4(ReferenceModel):
    def __init__(self, config: Gemma4Config):
        super().__init__()
        c = self.config = config
        modules = dict(
            embed_tokens=nn.Embedding(c.vocab_size, c.n_embd),
            layers=nn.ModuleList([Block(c, i) for i in range(c.n_layer)]),
            norm=RMSNorm(c.n_embd, c.rms_norm_eps),
        )
        if c.per_layer_dim:
            modules["embed_tokens_per_layer"] = nn.Embedding(c.per_layer_vocab, c.n_layer * c.per_layer_dim)
            modules["per_layer_model_projection"] = nn.Linear(c.n_embd, c.n_layer * c.per_layer_dim, bias=False)
            modules["per_layer_projection_norm"] = RMSNorm(c.per_layer_dim, c.rms_norm_eps)
        self.model = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(c, full=True), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(c, full=False), persistent=False)

    def state_layout(self) -> dict:
        """What the manifest says of the cache: which layer reads which layer's, and each layer's shape."""
        c = self.config
        return {
            "kv_source": c.kv_source,
            "layer_head_dim": [c.head_size(i) for i in range(c.n_layer)],
            "layer_n_kv_head": [c.kv_heads(i) for i in range(c.n_layer)],
        }

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(B, T, n_layer, D): the per-layer table's rows (times sqrt(D)) and the token embedding x projected."""
        c, m = self.config, self.model
        B, T = input_ids.shape
        rows = m.embed_tokens_per_layer(input_ids) * torch.tensor(c.per_layer_dim**0.5, dtype=x.dtype)
        projected = m.per_layer_model_projection(x) * torch.tensor(c.n_embd**-0.5, dtype=x.dtype)
        projected = m.per_layer_projection_norm(projected.view(B, T, c.n_layer, c.per_layer_dim))
        return (projected + rows.view(B, T, c.n_layer, c.per_layer_dim)) * torch.tensor(2.0**-0.5, dtype=x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Past | None = None,
        *,
        last_token_logits: bool = False,
    ) -> tuple[torch.Tensor, Past]:
        """input_ids (B, T); attention_mask (B, past + T); position_ids (B, T); past_key_values: a (key, value)
        pair per layer that keeps a cache (kv_source[i] == i), (B, its KV heads, past, its head size). Returns
        logits (B, T, vocab) and the present pairs of the same layers."""
        c = self.config
        past_length, attention_mask, position_ids = forward_inputs(
            input_ids, attention_mask, position_ids, past_key_values
        )
        T = input_ids.shape[1]
        biases = {
            False: attention_bias(attention_mask, past_length, T),
            True: attention_bias(attention_mask, past_length, T, c.sliding_window, position_ids),
        }

        def cos_sin(inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            angles = position_ids.unsqueeze(-1).float() * inv_freq  # (B, T, hs/2)
            angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (B, 1, T, hs)
            return angles.cos(), angles.sin()

        rotary = {False: cos_sin(self.inv_freq), True: cos_sin(self.inv_freq_local)}
        x = self.model.embed_tokens(input_ids) * torch.tensor(c.n_embd**0.5, dtype=torch.float32)  # (B, T, C)
        per_layer = self.per_layer_inputs(input_ids, x) if c.per_layer_dim else None
        past = iter(past_key_values or [])
        present: Past = []
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its keys and values, for shared layers
        for i, (block, source) in enumerate(zip(self.model.layers, c.kv_source, strict=True)):
            own = source == i
            layer_past = next(past) if own and past_key_values is not None else None
            x, pair = block(
                x,
                None if per_layer is None else per_layer[:, :, i],
                biases[block.sliding],
                *rotary[block.sliding],
                layer_past,
                None if own else kept[source],
            )
            if own:
                kept[i] = pair
                present.append(pair)
        x = self.model.norm(x)
        if last_token_logits:
            x = x[:, -1:, :]
        logits = self.lm_head(x)
        cap = c.final_logit_softcapping
        return (logits if cap is None else torch.tanh(logits / cap) * cap), present
