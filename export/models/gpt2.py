"""The reference decoder-only transformer (GPT-2 / "Attention Is All You Need", decoder half).

One PyTorch module that serves both the prompt (past length 0) and one-token decode steps:

    logits, present = model(input_ids, attention_mask, position_ids, past_key_values)

Past keys/values go in as tensors and present keys/values come out as tensors, shaped
(B, n_head, past + T, head_dim): exactly what the ONNX graph exposes. Parameter names follow
Hugging Face's GPT-2 (`transformer.h.{i}.attn.c_attn`, ...) so a GPT-2 state dict maps onto this
model with a short list of transposed weights (export/families/gpt2.py).

References: Vaswani et al. 2017 (attention, sinusoidal positions); Radford et al. 2019 (GPT-2:
pre-LayerNorm blocks, learned positions, tied LM head); nanoGPT's model.py for the layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..limits import check_table_memory
from .reference import Past, ReferenceModel, attention_bias, forward_inputs


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # tokens in the vocabulary
    n_positions: int = 1024  # context length: the most tokens (past + new) the model attends over
    n_embd: int = 768  # model width d
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads; head_dim = n_embd // n_head
    n_inner: int | None = None  # feed-forward width; None means 4 * n_embd
    positional: str = "learned"  # "learned" (GPT-2) or "sinusoidal" (Vaswani et al.)
    tie_word_embeddings: bool = True  # LM head shares the token-embedding matrix
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"  # "gelu_new" (tanh approximation, GPT-2) or "gelu" (exact erf)
    dropout: float = 0.0  # residual, embedding and attention dropout (training only)
    bos_token_id: int = 50256
    eos_token_id: int = 50256

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.positional not in ("learned", "sinusoidal"):
            raise ValueError(f"positional must be 'learned' or 'sinusoidal', got {self.positional!r}")
        if self.activation not in ("gelu_new", "gelu"):
            raise ValueError(f"activation must be 'gelu_new' or 'gelu', got {self.activation!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self) -> int:
        return self.n_head  # every head has its own keys and values (Llama's grouped-query attention shares them)

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    def to_dict(self) -> dict:
        return asdict(self)


# Named presets. Parameter counts are for the tied model with learned positions.
PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124.4M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 354.8M
    "distilgpt2": dict(n_layer=6, n_head=12, n_embd=768),  # 81.9M
    "tiny": dict(vocab_size=256, n_positions=64, n_layer=2, n_head=4, n_embd=32),  # 0.03M
}


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's tanh approximation of GELU (Hendrycks & Gimpel 2016)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def sinusoidal_table(n_positions: int, n_embd: int) -> torch.Tensor:
    """PE(t, 2i) = sin(t / 10000^(2i/d)), PE(t, 2i+1) = cos(t / 10000^(2i/d))."""
    check_table_memory(n_positions, n_embd, "the sinusoidal position table, (positions, n_embd),")
    position = torch.arange(n_positions, dtype=torch.float32).unsqueeze(1)  # (P, 1)
    inv_freq = torch.exp(torch.arange(0, n_embd, 2, dtype=torch.float32) * (-math.log(10000.0) / n_embd))
    table = torch.zeros(n_positions, n_embd)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: n_embd // 2])
    return table


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # Q, K, V in one product
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)  # W^O
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # (B, nh, past + T, hs)
            v = torch.cat([past[1], v], dim=2)
        # softmax(Q K^T / sqrt(d_k) + mask) V; `bias` is 0 where attending is allowed, a large negative
        # number elsewhere (finite, so a fully padded row gives a uniform softmax, not NaN).
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, past + T)
        probs = self.attn_dropout(F.softmax(scores + bias, dim=-1))
        y = probs @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # heads concatenated
        return self.resid_dropout(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.inner_dim)
        self.c_proj = nn.Linear(config.inner_dim, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.exact_gelu = config.activation == "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        h = F.gelu(h) if self.exact_gelu else gelu_new(h)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x, bias, past):
        attn_out, present = self.attn(self.ln_1(x), bias, past)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        return x, present


class GPT(ReferenceModel):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        if config.positional == "learned":
            self.transformer["wpe"] = nn.Embedding(config.n_positions, config.n_embd)
        else:
            self.register_buffer("sinusoid", sinusoidal_table(config.n_positions, config.n_embd), persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections: std 0.02 / sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

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
        position_ids (B, T); past_key_values: n_layer pairs of (B, nh, past, hs).
        Returns logits (B, T, vocab) (or (B, 1, vocab) with last_token_logits) and the present pairs."""
        past_length, attention_mask, position_ids = forward_inputs(
            input_ids, attention_mask, position_ids, past_key_values
        )
        bias = attention_bias(attention_mask, past_length, input_ids.shape[1])  # (B, 1, T, past + T)

        x = self.transformer.wte(input_ids)  # (B, T, C)
        if self.config.positional == "learned":
            x = x + self.transformer.wpe(position_ids)
        else:
            x = x + self.sinusoid[position_ids]
        x = self.transformer.drop(x)

        present: Past = []
        for i, block in enumerate(self.transformer.h):
            x, layer_present = block(x, bias, None if past_key_values is None else past_key_values[i])
            present.append(layer_present)
        x = self.transformer.ln_f(x)
        if last_token_logits:
            x = x[:, -1:, :]
        return self.lm_head(x), present
