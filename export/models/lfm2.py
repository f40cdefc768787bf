"""The LFM2 reference model (Liquid AI's LFM2 / LFM2.5, transformers' Lfm2ForCausalLM), in PyTorch.

Most layers are short gated convolutions; the rest are grouped-query attention with per-head query/key
RMSNorm and rotary positions. A convolution layer keeps a state, not a KV cache:

    B, C, x = in_proj(norm(h)) split in three       each (batch, hidden, T), channels first
    u = B * x                                       the gated input
    y = depthwise causal conv (kernel L) over [state, u]
    out = out_proj(C * y)                           state' = the last L - 1 columns of [state, u]

The state is (batch, hidden, L - 1), as onnxruntime-genai's LFM2 builder keeps it (`past.%d.conv`). A padded
position's input is zeroed before the projection (transformers' apply_mask_to_padding_states), so a left-padded
row's state after its prompt equals an unpadded row's: the zeros its padding feeds are what an empty state holds.

    logits, present = model(input_ids, attention_mask, position_ids, past)

past and present hold one tuple per layer: (key, value) for attention layers, (conv,) for convolution layers.
Parameter names are transformers', so a checkpoint's state dict loads unrenamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import RMSNorm, apply_rotary
from .reference import StateReferenceModel

ATTENTION, CONV = "full_attention", "conv"
State = list[tuple[torch.Tensor, ...]]


@dataclass
class Lfm2Config:
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_inner: int  # the MLP's width after transformers' block_auto_adjust_ff_dim
    layer_types: list[str]  # per layer: "full_attention" or "conv"
    n_positions: int = 128000
    conv_kernel: int = 3  # conv_L_cache: the convolution's kernel; the state keeps kernel - 1 columns
    conv_bias: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.n_embd % self.n_head == 0, "hidden_size is not a multiple of num_attention_heads"
        assert self.n_head % self.n_kv_head == 0, "num_attention_heads is not a multiple of num_key_value_heads"
        assert len(self.layer_types) == self.n_layer and set(self.layer_types) <= {ATTENTION, CONV}
        self.head_dim = self.n_embd // self.n_head


def rope_inv_freq(c: Lfm2Config) -> torch.Tensor:
    """Rotary frequencies (head_dim / 2,): theta ** (-2i / head_dim)."""
    return 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))


class Attention(nn.Module):
    def __init__(self, c: Lfm2Config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.q_proj = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=False)
        self.out_proj = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)
        self.q_layernorm = RMSNorm(c.head_dim, c.norm_eps)
        self.k_layernorm = RMSNorm(c.head_dim, c.norm_eps)

    def forward(self, x, bias, cos, sin, past):
        B, T, _ = x.shape
        q = self.q_layernorm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_layernorm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        group = self.n_head // self.n_kv_head
        scores = (q @ k.repeat_interleave(group, dim=1).transpose(-2, -1)) * self.head_dim**-0.5
        y = F.softmax(scores + bias, dim=-1) @ v.repeat_interleave(group, dim=1)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v)


class ShortConv(nn.Module):
    def __init__(self, c: Lfm2Config):
        super().__init__()
        self.conv = nn.Conv1d(c.n_embd, c.n_embd, c.conv_kernel, groups=c.n_embd, bias=c.conv_bias)
        self.in_proj = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.conv_bias)
        self.out_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.conv_bias)

    def forward(self, x, mask, past):
        """x (B, T, C); mask (B, T) of the new positions; past (B, C, kernel - 1)."""
        gates = self.in_proj(x * mask.unsqueeze(-1).to(x.dtype)).transpose(1, 2)  # (B, 3C, T)
        b, c, h = gates.chunk(3, dim=1)
        window = torch.cat([past[0], b * h], dim=2)  # (B, C, kernel - 1 + T)
        y = self.conv(window)  # no padding: (B, C, T)
        state = window[:, :, window.shape[2] - past[0].shape[2] :]
        return self.out_proj((c * y).transpose(1, 2)), (state,)


class GatedMLP(nn.Module):
    def __init__(self, c: Lfm2Config):
        super().__init__()
        self.w1 = nn.Linear(c.n_embd, c.n_inner, bias=False)
        self.w3 = nn.Linear(c.n_embd, c.n_inner, bias=False)
        self.w2 = nn.Linear(c.n_inner, c.n_embd, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: Lfm2Config, kind: str):
        super().__init__()
        self.kind = kind
        if kind == ATTENTION:
            self.self_attn = Attention(c)
        else:
            self.conv = ShortConv(c)
        self.feed_forward = GatedMLP(c)
        self.operator_norm = RMSNorm(c.n_embd, c.norm_eps)
        self.ffn_norm = RMSNorm(c.n_embd, c.norm_eps)

    def forward(self, x, bias, cos, sin, mask, past):
        h = self.operator_norm(x)
        out, present = self.self_attn(h, bias, cos, sin, past) if self.kind == ATTENTION else self.conv(h, mask, past)
        x = x + out
        return x + self.feed_forward(self.ffn_norm(x)), present


class Lfm2(StateReferenceModel):
    def __init__(self, config: Lfm2Config):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
                layers=nn.ModuleList([Block(config, kind) for kind in config.layer_types]),
                embedding_norm=RMSNorm(config.n_embd, config.norm_eps),  # the final norm, despite its name
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def empty_state(self, batch: int) -> State:
        """The state before any token: (key, value) of no positions, (conv,) of zeros."""
        c = self.config
        kv = lambda: torch.zeros(batch, c.n_kv_head, 0, c.head_dim)  # noqa: E731
        return [
            (kv(), kv()) if kind == ATTENTION else (torch.zeros(batch, c.n_embd, c.conv_kernel - 1),)
            for kind in c.layer_types
        ]

    def state_layout(self) -> dict:
        """What the package's manifest says each layer keeps (runtime/contract.py Architecture)."""
        return {
            "layer_types": list(self.config.layer_types),
            "conv_state": [self.config.n_embd, self.config.conv_kernel - 1],
        }

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.embedding_norm(x)
