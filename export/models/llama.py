"""The reference Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3, Gemma 3 text).

The same interface as gpt2.py's GPT, so export and parity checks treat both families alike:

    logits, present = model(input_ids, attention_mask, position_ids, past_key_values)

What differs from GPT-2, in one place:
- RMSNorm (scale only: no mean subtraction, no bias) instead of LayerNorm;
- rotary position embeddings applied to queries and keys (Su et al. 2021) instead of learned positions
  added to the input; HF's "rotate half" layout (dims i and i + head_dim/2 form a pair), optionally
  rescaled for long contexts (`linear` position interpolation, Chen et al. 2023; Meta's `llama3` rule);
- grouped-query attention (Ainslie et al. 2023): n_kv_head <= n_head key/value heads, each shared by
  n_head / n_kv_head query heads; the cache holds n_kv_head heads, (B, n_kv_head, past + T, head_dim);
- a SiLU-gated feed-forward, down(silu(gate(x)) * up(x)) (Shazeer 2020), with no biases;
- no biases in the projections, except Q/K/V biases in Qwen2;
- Qwen3 and Gemma 3: an RMSNorm over each query and key head (width head_dim, its own weight) before the rotary.

Gemma 3 (Gemma3Config's fields; off in LlamaConfig, so the others never see them): token embeddings times
sqrt(n_embd); RMSNorm scaling by (1 + weight); a norm after attention and after the MLP as well as before each (its
post_attention_layernorm is that post-attention norm, and pre_feedforward_layernorm the MLP's input norm);
a GELU-tanh gate; attention scaled by query_pre_attn_scalar ** -0.5; and sliding-window layers
(`layer_types`), whose queries see only the last `sliding_window` positions (their own included), with
their own rotary base and no rope scaling.

Parameter names are Hugging Face's (`model.layers.{i}.self_attn.q_proj`, ...), all `nn.Linear` in
(out, in) layout, so a Hugging Face state dict loads with no renaming or transposing
(export/families/llama.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..limits import check_table_memory
from .reference import Past, ReferenceModel, attention_bias, forward_inputs

LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # LongRoPE (Phi-3): per-frequency divisors for contexts up to and past the original one, and the factor cos
    # and sin are multiplied by
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"),
}


@dataclass
class LlamaConfig:
    vocab_size: int = 49152  # tokens in the vocabulary
    n_positions: int = 8192  # context length (max_position_embeddings, capped at Mistral's sliding window)
    n_embd: int = 576  # model width d (hidden_size)
    n_layer: int = 30  # transformer blocks
    n_head: int = 9  # query heads
    n_kv_head: int = 3  # key/value heads (grouped-query attention); n_head must be a multiple
    head_dim: int | None = None  # per-head width; None means n_embd // n_head
    n_inner: int = 1536  # gated feed-forward width (intermediate_size)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base: frequency i is rope_theta ** (-2i / head_dim)
    rope_scaling: dict | None = None  # None, {"rope_type": "linear", "factor"} or {"rope_type": "llama3", ...}
    # a GGUF file's rope_freqs.weight: frequency i divided by factor i after rope_scaling (llama.cpp's
    # freq_factors; its Llama 3 files hold their rope scaling this way); None: no factors
    rope_freq_factors: list[float] | None = None
    attention_bias: bool = False  # biases on Q/K/V (Qwen2); o_proj never has one
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary (Qwen3)
    tie_word_embeddings: bool = True  # LM head shares the token-embedding matrix
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)  # generation stops at any of these
    model_type: str = "llama"  # the manifest's architecture.type (export/families/ sets it)
    # Parts that Gemma3Config (below) turns on: here class constants, off, so the other families' configs hold
    # only the fields above; there fields. The model reads them the same way from either.
    hidden_act: ClassVar[str] = "silu"  # the gate's activation: "silu" or "gelu_pytorch_tanh"
    norm_offset: ClassVar[float] = 0.0  # RMSNorm scales by (norm_offset + weight)
    embedding_scale: ClassVar[bool] = False  # token embeddings times sqrt(n_embd), rounded to fp32
    sandwich_norms: ClassVar[bool] = False  # a norm after attention and after the MLP too
    query_pre_attn_scalar: ClassVar[float | None] = None  # attention scores times this ** -0.5; None: head_dim
    layer_types: ClassVar[list[str] | None] = None  # per layer, one of LAYER_TYPES; None: all full attention
    sliding_window: ClassVar[int | None] = None  # a sliding layer's query sees the last this many positions
    rope_local_theta: ClassVar[float] = 10000.0  # the sliding layers' rotary base (no scaling)
    # Parts other families' configs (export/families/) turn on the same way
    rotary_layers: ClassVar[list[bool] | None] = None  # per layer, whether it rotates Q and K (SmolLM3's NoPE)
    partial_rotary_factor: ClassVar[float] = 1.0  # the first int(head_dim * this) values of a head rotate (Phi-3)
    embedding_multiplier: ClassVar[float | None] = None  # token embeddings times this (Granite)
    residual_multiplier: ClassVar[float | None] = None  # attention and MLP outputs times this before the Add
    attention_multiplier: ClassVar[float | None] = None  # attention scores times this (Granite's scale)
    logits_scaling: ClassVar[float | None] = None  # logits divided by this (Granite)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.n_embd // self.n_head  # the documented default, not an override
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_pytorch_tanh', got {self.hidden_act!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layer or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types must be {self.n_layer} of {LAYER_TYPES}, got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError(f"sliding layers need a positive sliding_window, got {self.sliding_window!r}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2 != 0 or self.rotary_dim % 2 != 0:
            raise ValueError(f"head_dim and its rotary part must be even, got {self.head_dim}, {self.rotary_dim}")
        if self.rotary_layers is not None and len(self.rotary_layers) != self.n_layer:
            raise ValueError(f"rotary_layers must name {self.n_layer} layers, got {self.rotary_layers!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.rotary_dim // 2:
            raise ValueError(f"rope_freq_factors must be {self.rotary_dim // 2} factors (rotary_dim / 2)")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in ROPE_SCALING_KEYS:
                raise ValueError(
                    f"unsupported rope_scaling type {rope_type!r}; supported: {sorted(ROPE_SCALING_KEYS)} or none"
                )
            missing = [k for k in ROPE_SCALING_KEYS[rope_type] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")

    @property
    def rotary_dim(self) -> int:
        """How many of a head's values rotate (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Gemma3Config(LlamaConfig):
    """Gemma 3's text model: a Llama with per-head norms and the parts below (LlamaConfig's comments say what
    each does)."""

    qk_norm: bool = True
    model_type: str = "gemma3_text"
    hidden_act: str = "gelu_pytorch_tanh"
    norm_offset: float = 1.0
    embedding_scale: bool = True
    sandwich_norms: bool = True
    query_pre_attn_scalar: float | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_theta: float = 10000.0


# Named presets (the Hugging Face configs); parameter counts are for the model as built here.
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(rope_theta=100000.0),  # 134.5M, the field defaults
    "qwen2.5-0.5b": dict(  # 494.0M
        vocab_size=151936,
        n_positions=32768,
        n_embd=896,
        n_layer=24,
        n_head=14,
        n_kv_head=2,
        n_inner=4864,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=True,
        model_type="qwen2",
    ),  # fmt: skip
    "llama-3.2-1b": dict(  # 1235.8M
        vocab_size=128256,
        n_positions=131072,
        n_embd=2048,
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_inner=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),  # fmt: skip
    "tiny": dict(vocab_size=256, n_positions=128, n_embd=48, n_layer=2, n_head=6, n_kv_head=2, n_inner=96),  # 0.05M
}


def rope_inv_freq(config: LlamaConfig, *, local: bool = False, long: bool = False) -> torch.Tensor:
    """Rotary frequencies (rotary_dim/2,): theta ** (-2i / rotary_dim), with the config's scaling applied, then
    divided by its rope_freq_factors; local: the sliding layers' (rope_local_theta, unscaled); long: LongRoPE's
    long factors (else its short ones)."""
    dim = config.rotary_dim
    theta = config.rope_local_theta if local else config.rope_theta
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":  # transformers' _compute_longrope_parameters
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if local:
        return inv_freq
    inv_freq = _scaled(inv_freq, scaling)
    if config.rope_freq_factors is not None:  # as llama.cpp's rope divides by freq_factors
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq


def _scaled(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """The frequencies under rope_scaling (None: as they are)."""
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        # Position interpolation: position t is treated as t / factor, i.e. every frequency divided by factor.
        return inv_freq / factor
    # llama3: wavelengths longer than the original context / low_freq_factor are stretched by `factor`,
    # those shorter than original / high_freq_factor are kept, and the band between is blended linearly
    # in original / wavelength.
    original = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_band, blended, scaled)


def rotary_factor(config: LlamaConfig) -> float:
    """What cos and sin are multiplied by (LongRoPE's attention factor; 1 otherwise)."""
    scaling = config.rope_scaling or {}
    return float(scaling.get("attention_factor", 1.0)) if scaling.get("rope_type") == "longrope" else 1.0


def rope_cos_sin(
    config: LlamaConfig, n_positions: int, *, local: bool = False, long: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, each (n_positions, rotary_dim/2), times the rotary factor: the caches
    ONNX Runtime's GroupQueryAttention (do_rotary=1, rotary_interleaved=0) takes, as torch computes them; the fused
    graph computes the same from the frequencies (export/graph.py, tests/export/test_rotary_tables.py)."""
    check_table_memory(n_positions, config.head_dim, "the rotary cos and sin tables, (positions, head_dim / 2) each,")
    inv_freq = rope_inv_freq(config, local=local, long=long)
    angles = torch.arange(n_positions, dtype=torch.float32).unsqueeze(1) * inv_freq  # (P, rotary_dim/2)
    factor = 1.0 if local else rotary_factor(config)
    return torch.cos(angles) * factor, torch.sin(angles) * factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + r/2]) by the angle of their frequency, r the rotary width (the head's, or its first
    r values: partial rotary). x (B, nh, T, hs); cos, sin (B, 1, T, r)."""
    if cos.shape[-1] < x.shape[-1]:
        rotary = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (offset + weight) (Zhang & Sennrich 2019; Gemma's offset 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.offset + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
        self.qk_norm = config.qk_norm
        self.scale = config.attention_multiplier or (config.query_pre_attn_scalar or config.head_dim) ** -0.5

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.qk_norm:  # per head, over its head_dim values
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # None: a layer without positions (SmolLM3's NoPE layers)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # the cache holds rotated keys
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # (B, nkv, past + T, hs)
            v = torch.cat([past[1], v], dim=2)
        # Query head h reads key/value head h // (n_head / n_kv_head).
        group = self.n_head // self.n_kv_head
        k_heads = k.repeat_interleave(group, dim=1)  # (B, nh, past + T, hs)
        v_heads = v.repeat_interleave(group, dim=1)
        scores = (q @ k_heads.transpose(-2, -1)) * self.scale  # (B, nh, T, past + T)
        y = F.softmax(scores + bias, dim=-1) @ v_heads  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.o_proj(y), (k, v)


class GatedMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.n_inner, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.n_inner, bias=False)
        self.down_proj = nn.Linear(config.n_inner, config.n_embd, bias=False)
        self.tanh_gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, sliding: bool = False, rotary: bool = True):
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm(config.n_embd, eps, offset)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, eps, offset)  # sandwich: after attention
        self.mlp = GatedMLP(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.n_embd, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.n_embd, eps, offset)
        self.sliding = sliding  # a sliding-window layer: the local mask and rotary
        self.rotary = rotary  # False: no rotary positions (SmolLM3's NoPE layers)
        self.residual_multiplier = config.residual_multiplier

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier is None else x * self.residual_multiplier

    def forward(self, x, bias, cos, sin, past):
        if not self.rotary:
            cos = sin = None
        attn_out, present = self.self_attn(self.input_layernorm(x), bias, cos, sin, past)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn_out)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), present
        x = x + self.residual(attn_out)
        x = x + self.residual(self.mlp(self.post_attention_layernorm(x)))
        return x, present


class Llama(ReferenceModel):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.layer_types = config.layer_types or ["full_attention"] * config.n_layer
        layers = zip(self.layer_types, config.rotary_layers or [True] * config.n_layer, strict=True)
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
                layers=nn.ModuleList([Block(config, kind == "sliding_attention", rotary) for kind, rotary in layers]),
                norm=RMSNorm(config.n_embd, config.rms_norm_eps, config.norm_offset),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # (hs/2,)
        self.register_buffer("inv_freq_local", rope_inv_freq(config, local=True), persistent=False)
        self.register_buffer("inv_freq_long", rope_inv_freq(config, long=True), persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Past | None = None,
        *,
        last_token_logits: bool = False,
    ) -> tuple[torch.Tensor, Past]:
        """input_ids (B, T); attention_mask (B, past + T), 1 = real token, 0 = padding;
        position_ids (B, T); past_key_values: n_layer pairs of (B, n_kv_head, past, head_dim).
        Returns logits (B, T, vocab) (or (B, 1, vocab) with last_token_logits) and the present pairs."""
        past_length, attention_mask, position_ids = forward_inputs(
            input_ids, attention_mask, position_ids, past_key_values
        )
        T = input_ids.shape[1]
        bias = attention_bias(attention_mask, past_length, T)
        sliding = "sliding_attention" in self.layer_types
        window = self.config.sliding_window
        local_bias = attention_bias(attention_mask, past_length, T, window, position_ids) if sliding else bias

        def cos_sin(inv_freq: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
            angles = position_ids.unsqueeze(-1).float() * inv_freq  # (B, T, r/2)
            angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (B, 1, T, r): both halves of a pair
            return angles.cos() * factor, angles.sin() * factor

        rotary = cos_sin(self._inv_freq(attention_mask), rotary_factor(self.config))
        local_rotary = cos_sin(self.inv_freq_local) if sliding else rotary

        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        if self.config.embedding_scale:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        if self.config.embedding_multiplier is not None:
            x = x * self.config.embedding_multiplier
        present: Past = []
        for i, block in enumerate(self.model.layers):
            layer_bias, (cos, sin) = (local_bias, local_rotary) if block.sliding else (bias, rotary)
            x, layer_present = block(x, layer_bias, cos, sin, None if past_key_values is None else past_key_values[i])
            present.append(layer_present)
        x = self.model.norm(x)
        if last_token_logits:
            x = x[:, -1:, :]
        logits = self.lm_head(x)
        return logits if self.config.logits_scaling is None else logits / self.config.logits_scaling, present

    def _inv_freq(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The rotary frequencies, (r/2,), or with LongRoPE (B, 1, r/2): a row longer than the original context
        (its tokens so far, these included) rotates by the long factors. transformers decides so for a sequence
        alone (by its largest position); deciding per row keeps a row of a padded batch what it is alone."""
        scaling = self.config.rope_scaling
        if scaling is None or scaling["rope_type"] != "longrope":
            return self.inv_freq
        long = attention_mask.sum(-1, keepdim=True) > scaling["original_max_position_embeddings"]  # (B, 1)
        return torch.where(long, self.inv_freq_long, self.inv_freq).unsqueeze(1)
