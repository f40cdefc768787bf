"""Attention as the fused graph builds it: one com.microsoft GroupQueryAttention node per layer on the packed Q/K/V
product, with the parts a layer may have: per-head norms (Qwen3, Gemma 3; a weightless value norm), an output gate
after V (Qwen3.5), rotary positions inside the node or, where it cannot take them (per-row tables, a rotary width
it does not take), a RotaryEmbedding before it, a sliding window, and KV sharing: a layer that reads an earlier
layer's cache (Gemma 4), whose node is given the key and value inputs that layer's node wrote (`kv_inputs`).
Its config parts are the Layer's attention fields (export/decoder.py); the traced graph needs no placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import helper

from ..graph_nodes import MS_DOMAIN, GraphSteps

# export/decoder.py's Decoder and Layer, which hold the mechanisms' parts (so this module cannot import them)
Decoder = Layer = Any


@dataclass
class RotaryCaches:
    """A layer's rotary tables in the graph (export/graph.py computes them from the Decoder's Rotary)."""

    caches: list[str]  # cos and sin tables
    width: int  # how many of a head's values rotate
    positions: str | None = None  # (B, T) rows of the tables, per row; None: GroupQueryAttention rotates itself


def split_qkv(g: GraphSteps, qkv: str, prefix: str, d: Decoder, layer: Layer | None = None) -> list[str]:
    """Q, K and V split from the packed product (V is K's projection where the layer says so)."""
    n_head, n_kv_head, head_dim = d.heads(layer) if layer is not None else (d.n_head, d.n_kv_head, d.head_dim)
    widths = [n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim]
    names = [f"{prefix}/q", f"{prefix}/k", f"{prefix}/v"]
    if layer is not None and layer.value_is_key:
        widths, names = widths[:2], names[:2]
    sizes = g.small_constant(f"{prefix}/qkv_sizes", np.array(widths, dtype=np.int64))
    g.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{prefix}/qkv_Split", axis=-1))
    return names if len(names) == 3 else [*names, names[1]]


def head_norm(
    g: GraphSteps, x: str, prefix: str, name: str, weight: np.ndarray, heads: int, head_dim: int, eps: float
) -> str:
    """x (B, T, heads * hs) RMS-normalized over each head's values, times `weight` (hs,)."""
    shape = g.small_constant(f"{prefix}/{name}_head_shape", np.array([0, 0, -1, head_dim], dtype=np.int64))
    flat = g.small_constant(f"{prefix}/{name}_flat_shape", np.array([0, 0, -1], dtype=np.int64))
    split = g.op("Reshape", [x, shape], f"{prefix}/{name}_heads")  # (B, T, heads, hs)
    inputs = [split, g.constant(f"{prefix}.{name}_norm.weight", weight)]
    normed = g.op("SimplifiedLayerNormalization", inputs, f"{prefix}/{name}_norm", axis=-1, epsilon=eps)
    g.float_output(normed, ["batch_size", "sequence_length", heads, head_dim])
    return g.op("Reshape", [normed, flat], f"{prefix}/{name}_normed")  # (B, T, heads * hs)


def head_norms(g: GraphSteps, qkv: str, prefix: str, layer: Layer, decoder: Decoder) -> list[str]:
    """GroupQueryAttention's query, key and value inputs: the packed product alone, or, with per-head norms
    (Qwen3, Gemma 3), Q and K split from it and RMS-normalized over each head's head_dim values (V as it is,
    or weightless-normed: Gemma 4's v_norm)."""
    if layer.q_norm is None:
        return [qkv, "", ""]
    d = decoder
    n_head, n_kv_head, head_dim = d.heads(layer)
    if layer.attention_gate:  # the gate after V (Qwen3.5)
        widths = [n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim, n_head * head_dim]
        sizes = g.small_constant(f"{prefix}/qkv_sizes", np.array(widths, dtype=np.int64))
        names = [f"{prefix}/q", f"{prefix}/k", f"{prefix}/v", f"{prefix}/gate"]
        g.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{prefix}/qkv_Split", axis=-1))
    else:
        names = split_qkv(g, qkv, prefix, d, layer)
    q = head_norm(g, names[0], prefix, "q", layer.q_norm.weight, n_head, head_dim, d.norm_eps)
    k = head_norm(g, names[1], prefix, "k", layer.k_norm.weight, n_kv_head, head_dim, d.norm_eps)
    v = names[2]
    if layer.v_norm:
        v = head_norm(g, v, prefix, "v", np.ones(head_dim, np.float32), n_kv_head, head_dim, d.norm_eps)
    return [q, k, v]


def rotated(g: GraphSteps, qkv: list[str], prefix: str, d: Decoder, rotary: RotaryCaches) -> list[str]:
    """Q and K rotated before attention, each row at its own positions into the tables (com.microsoft
    RotaryEmbedding; the first rotary_dim values of each head), V as it is."""
    if qkv[1] == "":
        qkv = split_qkv(g, qkv[0], prefix, d)
    q, k, v = qkv
    width = rotary.width
    inputs = [rotary.positions, *rotary.caches]
    q = g.op("RotaryEmbedding", [q, *inputs], f"{prefix}/q_rotary", domain=MS_DOMAIN, num_heads=d.n_head,
                rotary_embedding_dim=width)  # fmt: skip
    k = g.op("RotaryEmbedding", [k, *inputs], f"{prefix}/k_rotary", domain=MS_DOMAIN, num_heads=d.n_kv_head,
                rotary_embedding_dim=width)  # fmt: skip
    g.float_output(q, ["batch_size", "sequence_length", d.n_head * d.head_dim])
    g.float_output(k, ["batch_size", "sequence_length", d.n_kv_head * d.head_dim])
    return [q, k, v]


def shared_inputs(g: GraphSteps, qkv: str, prefix: str, layer: Layer, d: Decoder) -> list[str]:
    """A KV-shared layer's GroupQueryAttention inputs: its query (normed), and the key and value inputs of the
    layer it reads (kv_inputs), which that layer's node already wrote into the cache this node reads."""
    n_head, _, head_dim = d.heads(layer)
    q = qkv if layer.q_norm is None else head_norm(g, qkv, prefix, "q", layer.q_norm.weight, n_head, head_dim,
                                                        d.norm_eps)  # fmt: skip
    return [q, *g.kv_inputs[f"layers.{layer.kv_source}"]]


def step(
    g: GraphSteps,
    h: str,
    prefix: str,
    layer: Layer,
    d: Decoder,
    io: tuple[tuple[str, str], tuple[str, str]],
    lengths: list[str],
    rotary: RotaryCaches | None,
) -> str:
    """One GroupQueryAttention node on the packed Q/K/V product of h; `lengths`: seqlens_k and the total length;
    `rotary`: the layer's rotary caches (None: no positions), applied inside the node or, where it cannot
    (per-row tables, a rotary width it does not take), before it. Returns its (B, T, n_head * head_dim) output."""
    past, present = io
    n_head, n_kv_head, head_dim = d.heads(layer)
    qkv = g.linear(h, f"{prefix}.qkv", layer.qkv)  # (B, T, (n_head + 2 n_kv_head) hs): Q, K, V packed
    if layer.kv_source is not None:  # Q alone: keys and values are another layer's, read from its cache
        inputs = shared_inputs(g, qkv, prefix, layer, d)
    else:
        inputs = head_norms(g, qkv, prefix, layer, d)
        if inputs[1] == "" and g.kv_inputs is not None:
            inputs = split_qkv(g, qkv, prefix, d, layer)
        if g.kv_inputs is not None:
            g.kv_inputs[prefix] = inputs[1:]
    # a sliding layer: its own rotary caches and window (ONNX Runtime 1.32's CPU kernel counts the query's
    # own position in local_window_size, as transformers' sliding_window does: checked against it)
    window = {} if layer.sliding_window is None else {"local_window_size": layer.sliding_window}
    inside = rotary is not None and rotary.positions is None
    if rotary is not None and not inside:
        inputs = rotated(g, inputs, prefix, d, rotary)
    caches = rotary.caches if inside else []
    g.nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [*inputs, *past, *lengths, *caches],
            [f"{prefix}/attention", *present],
            name=f"{prefix}/GroupQueryAttention",
            domain=MS_DOMAIN,
            num_heads=n_head,
            kv_num_heads=n_kv_head,
            scale=d.attention_scale or 1.0 / float(np.sqrt(head_dim)),
            **({"do_rotary": 1, "rotary_interleaved": 0} if inside else {}),
            **window,
        )
    )
    out = g.float_output(f"{prefix}/attention", ["batch_size", "sequence_length", n_head * head_dim])
    if not layer.attention_gate:
        return out
    gate = g.op("Sigmoid", [f"{prefix}/gate"], f"{prefix}/gate/Sigmoid")
    return g.op("Mul", [out, gate], f"{prefix}/gated_attention")
