"""A decoder-only transformer as the ONNX graph builder sees it: the differences between model families
stated as data (fields named after what they do), and the weights in MatMul layout.

    part              GPT-2 (export/models/gpt2.py)           Llama family (export/models/llama.py)
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

Each family module (export/families/) turns its reference model into a Decoder; export/graph.py builds the
graph from a Decoder alone and never asks which family it has. A family made of mechanisms the Decoder has
touches neither file; one that needs a new mechanism adds it here as a field named after what it does and to
graph.py as one step that reads it (Qwen3's head norms and Gemma 3's parts came so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .gguf_blocks import LazyRuns, Runs, load_runs, pack, runs_have_offsets, runs_shape, widen

NORMS = ("layer", "rms")
ACTIVATIONS = ("gelu_new", "gelu", "silu")


@dataclass
class NBits:
    """A weight kept in ONNX Runtime's MatMulNBits blocks (com.microsoft): W[k, n] = (q - 2^(bits - 1)) * scale +
    offset for the block of `block_size` consecutive k in column n, from a GGUF file's own quantized blocks
    (export/gguf_blocks.py), part after part along the outputs (Q, K and V of a packed linear), unpacked only
    when the graph writes them (export/gguf_blocks.py LazyRuns). The graph
    writes them compactly (export/compact_blocks.py) or as the arrays below, and adds the offsets as (block
    sums of x) @ block_offsets beside the MatMulNBits node."""

    bits: int  # 4 or 8
    block_size: int  # 16 or 32
    sources: list[Runs | LazyRuns]  # along the outputs; a LazyRuns is unpacked from its file when `parts` is read

    @property
    def parts(self) -> list[Runs]:
        """The parts in these bits and block size, unpacked now (each read makes them anew: the graph reads
        them once, when it writes this linear, and lets them go)."""
        return [widen(load_runs(part), self.bits, self.block_size) for part in self.sources]

    @property
    def by_rows(self) -> bool:
        """Whether `rows` can unpack some output rows alone: one part, from a file whose rows are the weight's."""
        return len(self.sources) == 1 and isinstance(self.sources[0], LazyRuns) and self.sources[0].rows is not None

    def rows(self, start: int, stop: int) -> NBits:
        """Output rows [start, stop) alone (by_rows must hold): what writes a large table a slice at a time."""
        return NBits(self.bits, self.block_size, [self.sources[0].rows(start, stop)])

    def raw_parts(self, kinds: tuple[int, ...]) -> list[tuple[int, int, Callable[[], np.ndarray]]] | None:
        """The file's own blocks along the outputs as (ggml type, rows, read: uint8 (rows, row bytes)), neighbouring
        parts of one type joined; None unless every part has them, of a type in `kinds` (runtime/packed.py)."""
        if not all(isinstance(p, LazyRuns) and p.raw is not None and p.kind in kinds for p in self.sources):
            return None
        groups: list[tuple[int, list[LazyRuns]]] = []
        for part in self.sources:
            if groups and groups[-1][0] == part.kind:
                groups[-1][1].append(part)
            else:
                groups.append((part.kind, [part]))

        def read(parts: list[LazyRuns]) -> Callable[[], np.ndarray]:
            return parts[0].raw if len(parts) == 1 else lambda: np.concatenate([p.raw() for p in parts])

        return [(kind, sum(p.shape[0] for p in parts), read(parts)) for kind, parts in groups]

    @property
    def shape(self) -> tuple[int, int]:
        """(in, out), as a Linear's weight."""
        shapes = [runs_shape(part) for part in self.sources]
        return shapes[0][1], sum(n for n, _ in shapes)

    @property
    def has_offsets(self) -> bool:
        return any(runs_have_offsets(part) for part in self.sources)

    @property
    def packed(self) -> np.ndarray:
        """MatMulNBits' B: uint8 (N, K / block_size, block_size * bits / 8), out features first."""
        return pack(np.concatenate([part.values for part in self.parts]), self.bits, self.block_size)

    @property
    def scales(self) -> np.ndarray:
        """float32 (N, K / block_size)."""
        return np.concatenate([part.scales for part in self.parts])

    @property
    def block_offsets(self) -> np.ndarray | None:
        """float32 (K / block_size, N): the types' minimums (0 for a part without them); None: all 0."""
        if not self.has_offsets:
            return None
        pieces = [part.offsets if part.offsets is not None else np.zeros_like(part.scales) for part in self.parts]
        return np.ascontiguousarray(np.concatenate(pieces).T)


@dataclass
class Linear:
    weight: np.ndarray | None  # (in, out): MatMul's layout, the transpose of nn.Linear's; None when nbits is set
    bias: np.ndarray | None = None  # (out,)
    nbits: NBits | None = None  # set: the graph multiplies by these blocks (MatMulNBits), not a float weight
    lora: tuple[str, str] | None = None  # a LoRA slot: the graph adds x @ A @ B, A and B inputs named so

    def __post_init__(self) -> None:
        assert (self.weight is None) != (self.nbits is None), "a Linear has a float weight or nbits blocks"


@dataclass
class Norm:
    weight: np.ndarray  # (C,)
    bias: np.ndarray | None = None  # (C,); None for RMSNorm


@dataclass
class ShortConv:
    """A short gated convolution in place of attention (LFM2): B, C, x = in_proj(h) split in three (channels
    first), y = depthwise causal conv of B * x with a state of the last kernel - 1 inputs, out = out_proj(C * y)."""

    in_proj: Linear  # out = 3 * n_embd: B, C, x
    weight: np.ndarray  # (n_embd, 1, kernel): the depthwise kernel
    bias: np.ndarray | None
    out_proj: Linear

    @property
    def kernel(self) -> int:
        return self.weight.shape[-1]


@dataclass
class DeltaNet:
    """A Gated DeltaNet layer in place of attention (Qwen3.5): q, k, v from a depthwise causal conv (+ SiLU) over
    in_proj(h), q and k L2-normalized, beta = sigmoid(h W_b), g = -exp(A_log) softplus(h W_a + dt_bias), the gated
    delta rule (com.microsoft GatedDeltaNet, state (B, v_heads, v_dim, k_dim)), RMSNorm(out) * silu(h W_z),
    out_proj."""

    in_proj: Linear  # out = 2 * k_heads * k_dim + v_heads * v_dim: q, k, v
    z: Linear  # out = v_heads * v_dim
    b: Linear  # out = v_heads
    a: Linear  # out = v_heads
    conv_weight: np.ndarray  # (conv channels, 1, kernel)
    a_log: np.ndarray  # (v_heads,)
    dt_bias: np.ndarray  # (v_heads,)
    norm: Norm  # (v_dim,)
    out_proj: Linear
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    # the value heads in the order out_proj takes them (int64 (v_heads,)): a GGUF file's kept blocks keep
    # llama.cpp's tiled order; None: as the rule gives them
    out_heads: np.ndarray | None = None

    @property
    def kernel(self) -> int:
        return self.conv_weight.shape[-1]

    @property
    def channels(self) -> int:
        return self.conv_weight.shape[0]


@dataclass
class PerLayerInput:
    """A layer's share of the per-layer input embeddings (Gemma 4), after its MLP's residual Add:
    x + norm(proj(act(x W_gate) * its (B, T, D) input))."""

    gate: Linear  # (n_embd, D)
    projection: Linear  # (D, n_embd)
    norm: Norm  # (n_embd,)


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
    def linears(self) -> list[Linear]:
        if self.conv is not None:
            mixer = [self.conv.in_proj, self.conv.out_proj]
        elif self.delta_net is not None:
            n = self.delta_net
            mixer = [n.in_proj, n.z, n.b, n.a, n.out_proj]
        else:
            mixer = [self.qkv, self.attention_out]
        extra = [] if self.per_layer is None else [self.per_layer.gate, self.per_layer.projection]
        return [*mixer, self.up, self.down, *extra]


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
