"""The Qwen3.5 text reference model (transformers' Qwen3_5ForCausalLM, model_type qwen3_5_text), in PyTorch.

Three Gated DeltaNet layers (linear attention) for each full-attention layer, by config.json's layer_types:

    linear attention    qkv = silu(depthwise causal conv (kernel K) over in_proj_qkv(h)), split in q, k, v heads;
                        q, k L2-normalized; beta = sigmoid(in_proj_b(h)); g = -exp(A_log) softplus(in_proj_a(h) +
                        dt_bias); per value head the gated delta rule S_t = e^g S + k (beta (v - e^g S^T k))^T,
                        o_t = S_t^T q / sqrt(dk); out_proj(RMSNorm(o) * silu(in_proj_z(h)))
    full attention      grouped-query attention whose q_proj also gives a gate (out = o_proj(attn * sigmoid(gate))),
                        query/key RMSNorm per head, rotary on the first partial_rotary_factor of each head
    norms               RMSNorm scaled by 1 + w (zero-centred weights), the gated one by w

A linear-attention layer keeps two states (onnxruntime-genai's names): `conv` (batch, conv channels, K - 1) and
`recurrent` (batch, value heads, dv, dk), the value-major layout of ONNX Runtime's com.microsoft GatedDeltaNet,
which the standard graph runs the recurrence with (its placeholder below; export/traced.py names it): the delta
rule over tokens has no practical form in standard ONNX ops. A padded position's input is zeroed, so its keys are
0 and an empty state stays empty through left padding.

    logits, present = model(input_ids, attention_mask, position_ids, past)

past and present: (key, value) for attention layers, (conv, recurrent) for linear-attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..mechanisms.delta_net import PLACEHOLDER
from .llama import RMSNorm
from .reference import StateReferenceModel

ATTENTION, LINEAR = "full_attention", "linear_attention"
State = list[tuple[torch.Tensor, ...]]


@dataclass
class Qwen35Config:
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_inner: int
    layer_types: list[str]
    rotary_dim: int  # the rotated part of each head (head_dim * partial_rotary_factor)
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int = 4
    n_positions: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    conv_dim: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.n_head % self.n_kv_head == 0 and self.linear_v_heads % self.linear_k_heads == 0
        assert len(self.layer_types) == self.n_layer and set(self.layer_types) <= {ATTENTION, LINEAR}
        assert 0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        self.conv_dim = 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim


def rope_inv_freq(c: Qwen35Config) -> torch.Tensor:
    return 1.0 / (c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float32) / c.rotary_dim))


def gated_delta_rule(q, k, v, g, beta, state):
    """The recurrence, token by token: q, k (B, T, Hv, dk) (heads already repeated), v (B, T, Hv, dv), g and beta
    (B, T, Hv), state (B, Hv, dv, dk). Returns the output (B, T, Hv, dv) and the final state."""
    scale = q.shape[-1] ** -0.5
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t]  # (B, H, dk)
        delta = (v[:, t] - (state @ k_t.unsqueeze(-1)).squeeze(-1)) * beta[:, t].unsqueeze(-1)  # (B, H, dv)
        state = state + delta.unsqueeze(-1) * k_t.unsqueeze(-2)  # (B, H, dv, dk)
        outputs.append((state @ q[:, t].unsqueeze(-1)).squeeze(-1) * scale)
    return torch.stack(outputs, dim=1), state


class GatedDeltaNet(torch.autograd.Function):
    """gated_delta_rule, exported as one placeholder node (export/mechanisms/delta_net.py) that export/traced.py
    turns into ONNX Runtime's com.microsoft GatedDeltaNet (q, k: (B, T, Hk, dk) unrepeated; the op shares each key
    head among Hv / Hk value heads, as repeat_interleave does)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state):
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        return gated_delta_rule(q, k, v, g, beta, state)

    @staticmethod
    def symbolic(g, q, k, v, decay, beta, state):
        output, final = g.op(f"edgelm::{PLACEHOLDER}", q, k, v, decay, beta, state, outputs=2)
        output.setType(v.type())
        final.setType(state.type())
        return output, final


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class LinearAttention(nn.Module):
    def __init__(self, c: Qwen35Config):
        super().__init__()
        self.c = c
        key_dim, value_dim = c.linear_k_heads * c.linear_k_dim, c.linear_v_heads * c.linear_v_dim
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(c.linear_v_heads))
        self.A_log = nn.Parameter(torch.zeros(c.linear_v_heads))
        self.norm = RMSNorm(c.linear_v_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, c.n_embd, bias=False)
        self.in_proj_qkv = nn.Linear(c.n_embd, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(c.n_embd, value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.n_embd, c.linear_v_heads, bias=False)
        self.in_proj_a = nn.Linear(c.n_embd, c.linear_v_heads, bias=False)

    def forward(self, x, mask, past):
        c = self.c
        B, T, _ = x.shape
        x = x * mask.unsqueeze(-1).to(x.dtype)
        window = torch.cat([past[0], self.in_proj_qkv(x).transpose(1, 2)], dim=2)  # (B, conv_dim, K - 1 + T)
        conv_state = window[:, :, window.shape[2] - past[0].shape[2] :]
        qkv = F.silu(self.conv1d(window)).transpose(1, 2)  # (B, T, conv_dim)
        key_dim = c.linear_k_heads * c.linear_k_dim
        q = l2norm(qkv[..., :key_dim].reshape(B, T, c.linear_k_heads, c.linear_k_dim))
        k = l2norm(qkv[..., key_dim : 2 * key_dim].reshape(B, T, c.linear_k_heads, c.linear_k_dim))
        v = qkv[..., 2 * key_dim :].reshape(B, T, c.linear_v_heads, c.linear_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)
        out, state = GatedDeltaNet.apply(q, k, v, g, beta, past[1])
        z = self.in_proj_z(x).reshape(B, T, c.linear_v_heads, c.linear_v_dim)
        out = self.norm(out) * F.silu(z)
        return self.out_proj(out.reshape(B, T, -1)), (conv_state, state)


class Attention(nn.Module):
    def __init__(self, c: Qwen35Config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.rotary_dim = c.n_head, c.n_kv_head, c.head_dim, c.rotary_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.n_embd, 2 * c.n_head * c.head_dim, bias=bias)  # queries and their gates
        self.k_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, 1.0)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, 1.0)

    def rotate(self, x, cos, sin):
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)

    def forward(self, x, bias, cos, sin, past):
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.n_head, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        group = self.n_head // self.n_kv_head
        scores = (q @ k.repeat_interleave(group, dim=1).transpose(-2, -1)) * self.head_dim**-0.5
        y = (F.softmax(scores + bias, dim=-1) @ v.repeat_interleave(group, dim=1)).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(y * torch.sigmoid(gate.reshape(B, T, -1))), (k, v)


class MLP(nn.Module):
    def __init__(self, c: Qwen35Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.n_embd, c.n_inner, bias=False)
        self.up_proj = nn.Linear(c.n_embd, c.n_inner, bias=False)
        self.down_proj = nn.Linear(c.n_inner, c.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Qwen35Config, kind: str):
        super().__init__()
        self.kind = kind
        if kind == ATTENTION:
            self.self_attn = Attention(c)
        else:
            self.linear_attn = LinearAttention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.n_embd, c.rms_norm_eps, 1.0)
        self.post_attention_layernorm = RMSNorm(c.n_embd, c.rms_norm_eps, 1.0)

    def forward(self, x, bias, cos, sin, mask, past):
        h = self.input_layernorm(x)
        if self.kind == ATTENTION:
            out, present = self.self_attn(h, bias, cos, sin, past)
        else:
            out, present = self.linear_attn(h, mask, past)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), present


class Qwen35(StateReferenceModel):
    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
                layers=nn.ModuleList([Block(config, kind) for kind in config.layer_types]),
                norm=RMSNorm(config.n_embd, config.rms_norm_eps, 1.0),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def state_layout(self) -> dict:
        """What the package's manifest says each layer keeps (runtime/contract.py Architecture)."""
        c = self.config
        return {
            "layer_types": list(c.layer_types),
            "conv_state": [c.conv_dim, c.conv_kernel - 1],
            "recurrent_state": [c.linear_v_heads, c.linear_v_dim, c.linear_k_dim],
        }

    def empty_state(self, batch: int) -> State:
        c = self.config
        return [
            (torch.zeros(batch, c.n_kv_head, 0, c.head_dim), torch.zeros(batch, c.n_kv_head, 0, c.head_dim))
            if kind == ATTENTION
            else (
                torch.zeros(batch, c.conv_dim, c.conv_kernel - 1),
                torch.zeros(batch, c.linear_v_heads, c.linear_v_dim, c.linear_k_dim),
            )
            for kind in c.layer_types
        ]

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)
