"""A decoder-only transformer as the ONNX graph builder sees it: the differences between model families
stated as data (fields named after what they do), and the weights in MatMul layout (export/linear.py).

    part              GPT-2 (export/models/gpt2.py)    Llama family (export/models/llama.py)
    normalization     LayerNorm (weight + bias)        RMSNorm (weight only; Gemma's 1 + w folded in)
    positions         learned table added to tokens    rotary, applied to Q and K inside attention
    attention heads   n_kv_head == n_head              n_kv_head <= n_head (grouped-query)
    Q/K/V biases      yes                              Qwen2 only
    output bias       yes                              no
    Q/K head norms    no                               Qwen3, Gemma 3 (RMSNorm per head, before the rotary)
    MLP               GELU(x W_fc) W_proj              (act(x W_gate) * x W_up) W_down, act SiLU or GELU-tanh
    LM head           tied                             tied or untied
    Gemma 3 also      -                                an embedding scale, norms after attention and the MLP,
                                                       its attention scale, sliding-window layers with their
                                                       own rotary frequencies
    others also       -                                layers without rotary (SmolLM3), Granite's multipliers,
                                                       partial rotary and LongRoPE's long frequencies (Phi-3)
    Gemma 4 also      -                                head sizes and KV heads per layer, layers reading an
                                                       earlier layer's keys and values, per-layer input
                                                       embeddings, layer output scales, logit softcapping

    mixers and parts  module (export/mechanisms/)      Layer / Decoder field
    attention         attention.py                     qkv, attention_out and the fields after them
    short convolution short_conv.py                    Layer.conv: ShortConv (LFM2)
    Gated DeltaNet    delta_net.py                     Layer.delta_net: DeltaNet (Qwen3.5)
    per-layer inputs  per_layer_input.py               Layer.per_layer: PerLayerInput, Decoder.per_layer_* (Gemma 4)

Each family module (export/families/) turns its reference model into a Decoder; export/graph.py builds the
graph from a Decoder alone and never asks which family it has. A family made of mechanisms the Decoder has
touches neither file. A small new part (a norm, a scale) is a field here named after what it does and one step
of graph.py that reads it (Qwen3's head norms and Gemma 3's parts came so); a new kind of mixer or layer part is a
module of export/mechanisms/ (its config part, graph step and traced placeholder) and its field here
(docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .linear import Linear, NBits, Norm
from .mechanisms.delta_net import DeltaNet
from .mechanisms.per_layer_input import PerLayerInput
from .mechanisms.short_conv import ShortConv

NORMS = ("layer", "rms")
ACTIVATIONS = ("gelu_new", "gelu", "silu")


@dataclass
class Rotary:
    """Rotary positions (Su et al. 2021) as a few numbers rather than tables: the graph computes its cos and sin
    caches, (context_length, r / 2) each, as cos(p * inv_freq) * factor for p = 0 .. context_length - 1 (a float32
    product, as the reference's torch.arange(P)[:, None] * inv_freq; export/graph.py), and ONNX Runtime folds them
    once at session start, so a package holds no table that grows with the context. r: the rotary width, the head
    size or its first values (partial rotary: Phi-3, Qwen3.5); a frequency of 0 leaves its pair as it is (Gemma 4's
    proportional rotary)."""

    inv_freq: np.ndarray  # (r / 2,) float32
    factor: float = 1.0  # cos and sin times this (LongRoPE's attention factor)
    # LongRoPE (Phi-3): the long factors' frequencies (r / 2,), which a row longer than long_after tokens rotates by
    long_inv_freq: np.ndarray | None = None
    long_after: int | None = None

    def __post_init__(self) -> None:
        assert self.inv_freq.dtype == np.float32 and self.inv_freq.ndim == 1, "inv_freq is float32 (r / 2,)"
        assert (self.long_after is None) == (self.long_inv_freq is None), "long frequencies and their threshold"
        long = self.long_inv_freq
        assert long is None or (long.dtype, long.shape) == (np.float32, self.inv_freq.shape), "long: as inv_freq"

    @property
    def width(self) -> int:
        """How many of a head's values rotate (r)."""
        return 2 * self.inv_freq.shape[0]


@dataclass
class Layer:
    attention_norm: Norm  # the norm before attention, or before the layer's convolution
    qkv: Linear | None  # Q, K, V packed: out = (n_head + 2 * n_kv_head) * head_dim; None in a convolution layer
    attention_out: Linear | None
    mlp_norm: Norm
    up: Linear  # gated MLP: gate and up packed, out = 2 * inner (gate first); else out = inner
    down: Linear
    q_norm: Norm | None = None  # (head_dim,): RMSNorm over each query head before the rotary (Qwen3)
    k_norm: Norm | None = None  # (head_dim,): the same over each key head
    attention_post_norm: Norm | None = None  # on the attention output, before the residual Add (Gemma 3)
    mlp_post_norm: Norm | None = None  # on the MLP output, before the residual Add (Gemma 3)
    sliding_window: int | None = None  # queries see the last this many positions (theirs included), with
    # the Decoder's local rotary; None: full causal attention
    rotary: bool = True  # False: Q and K of this layer take no positions (SmolLM3's NoPE layers)
    conv: ShortConv | None = None  # a convolution layer (its state is past.%d.conv): no attention
    delta_net: DeltaNet | None = None  # a linear-attention layer (past.%d.conv and past.%d.recurrent)
    attention_gate: bool = False  # qkv also gives a gate after V: attention output * sigmoid(gate) (Qwen3.5)
    # Gemma 4's parts
    head_dim: int | None = None  # this layer's head size and KV heads where they are not the Decoder's
    n_kv_head: int | None = None
    inner_dim: int | None = None  # this layer's MLP width where it is not the Decoder's (a double-wide MLP)
    kv_source: int | None = None  # an earlier layer whose keys and values this one attends over (its qkv is Q alone)
    value_is_key: bool = False  # qkv is Q and K; V is K's projection, before the key norm
    v_norm: bool = False  # RMSNorm without a weight over each value head
    per_layer: PerLayerInput | None = None
    output_scale: float | None = None  # the residual stream times this after the layer

    def __post_init__(self) -> None:
        mixers = (self.qkv is not None) + (self.conv is not None) + (self.delta_net is not None)
        assert mixers == 1, "a layer has attention, a convolution or a DeltaNet"
        assert not self.attention_gate or self.q_norm is not None, "the gate is split beside the head norms"

    @property
    def state_mixer(self) -> ShortConv | DeltaNet | None:
        """The mixer in place of attention (export/mechanisms/: its `step`, `states` and `LINEARS`); None:
        attention."""
        return next((part for part in (self.conv, self.delta_net) if part is not None), None)

    @property
    def linears(self) -> list[Linear]:
        mixer = self.state_mixer
        own = [self.qkv, self.attention_out] if mixer is None else mixer.linears
        extra = [] if self.per_layer is None else self.per_layer.linears
        return [*own, self.up, self.down, *extra]


@dataclass
class Decoder:
    family: str  # the manifest's architecture.type (a row of export/families/ FAMILIES)
    vocab_size: int
    context_length: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    inner_dim: int
    norm: str  # "layer" or "rms"
    norm_eps: float
    activation: str  # "gelu_new" (tanh GELU), "gelu" (exact) or "silu"
    gated_mlp: bool  # act(x W_gate) * (x W_up)
    embedding: np.ndarray  # (V, C)
    layers: list[Layer]
    final_norm: Norm
    lm_head: np.ndarray | None  # (C, V); None: tied, the embedding's transpose
    head_nbits: NBits | None = None  # the LM head (and a tied embedding) as blocks
    embedding_nbits: NBits | None = None  # untied: the token embedding as blocks, its rows gathered from them
    position_table: np.ndarray | None = None  # (P, C), added to the token embeddings (GPT-2)
    rotary: Rotary | None = None  # rotary positions inside attention (Llama)
    rotary_local: Rotary | None = None  # the sliding-window layers' (Gemma 3)
    embedding_scale: float | None = None  # token embeddings times this (Gemma 3: sqrt(n_embd) in fp32)
    attention_scale: float | None = None  # scores times this; None: 1 / sqrt(head_dim)
    residual_scale: float | None = None  # attention and MLP outputs times this before the residual Add (Granite)
    logits_divisor: float | None = None  # logits divided by this (Granite's logits_scaling)
    # Gemma 4's per-layer input embeddings: a table gathered per token (times sqrt(D)) plus the token embedding
    # projected (times n_embd ** -0.5) and RMS-normed over D, times 2 ** -0.5; layer i reads its D values
    per_layer_embedding: np.ndarray | None = None  # (V, n_layer * D)
    per_layer_embedding_nbits: NBits | None = None  # the same table as blocks, its rows gathered from them
    per_layer_projection: Linear | None = None  # (n_embd, n_layer * D)
    per_layer_norm: Norm | None = None  # (D,)
    logits_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 4)

    def __post_init__(self) -> None:
        assert self.norm in NORMS, f"norm must be one of {NORMS}, got {self.norm!r}"
        assert self.activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {self.activation!r}"
        assert self.n_head % self.n_kv_head == 0, f"n_head {self.n_head} is not a multiple of n_kv_head"
        assert (self.position_table is None) != (self.rotary is None), "positions: a table or rotary, not both"
        sliding = any(layer.sliding_window is not None for layer in self.layers)
        assert not sliding or self.rotary_local is not None, "sliding-window layers need local rotary frequencies"
        assert not sliding or self.rotary.long_inv_freq is None, "LongRoPE with sliding layers"

    def heads(self, layer: Layer) -> tuple[int, int, int]:
        """(query heads, KV heads, head size) of a layer."""
        return self.n_head, layer.n_kv_head or self.n_kv_head, layer.head_dim or self.head_dim

    @property
    def per_layer_dim(self) -> int:
        return 0 if self.per_layer_norm is None else self.per_layer_norm.weight.shape[0]

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def tied(self) -> bool:
        return self.lm_head is None
