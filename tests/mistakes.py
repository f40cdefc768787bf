"""Deliberate mistakes in the fused graph, for proving that export's proof catches them (tests/export/test_proof.py,
benchmarks/proof_mistakes.py). Each is a function that edits the `Decoder` the graph is built from, as a family
module with that bug would have built it, while the reference model stays right; it returns False where the
model has nothing it could get wrong (no sliding window, no softcap, ...).

    with injected("rope_base"):
        export_package(...)   # the proof must refuse the package
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import numpy as np

from edgelm.export import onnx_export
from edgelm.export.decoder import Decoder, Linear, NBits
from edgelm.export.gguf_blocks import load_runs, widen


def _refrequency(d: Decoder, name: str, change: Callable[[np.ndarray], np.ndarray]) -> bool:
    rotary = getattr(d, name)
    if rotary is None:
        return False
    setattr(d, name, dataclasses.replace(rotary, inv_freq=change(rotary.inv_freq).astype(np.float32)))
    return True


def rope_base(d: Decoder) -> bool:
    """The rotary base b read as b ** 1.1 (1e4 -> 2.5e4): every frequency theta_j = b^(-2j/r) raised to 1.1."""
    changed = _refrequency(d, "rotary", lambda theta: theta**1.1)
    return _refrequency(d, "rotary_local", lambda theta: theta**1.1) or changed


def rope_scaling(d: Decoder) -> bool:
    """The full layers' positions scaled twice over (a linear rope scaling applied again)."""
    return _refrequency(d, "rotary", lambda theta: theta / 2)


def _norms(d: Decoder) -> list:
    found = [d.final_norm]
    for layer in d.layers:
        names = ("attention_norm", "mlp_norm", "attention_post_norm", "mlp_post_norm", "q_norm", "k_norm")
        found += [getattr(layer, name) for name in names if getattr(layer, name) is not None]
    return found


def norm_plus_one(d: Decoder) -> bool:
    """Gemma's RMSNorm scales by (1 + w): the 1 left out."""
    if not d.family.startswith("gemma3"):
        return False
    for norm in _norms(d):
        norm.weight = norm.weight - 1
    return True


def _permuted(linear: Linear, order: np.ndarray) -> None:
    """The linear's outputs in `order` (float weight columns, or the rows of its blocks)."""
    if linear.weight is not None:
        linear.weight = linear.weight[:, order]
        if linear.bias is not None:
            linear.bias = linear.bias[order]
        return
    nbits = linear.nbits
    parts = [widen(load_runs(part), nbits.bits, nbits.block_size) for part in nbits.sources]
    values = np.concatenate([p.values for p in parts])[order]
    scales = np.concatenate([p.scales for p in parts])[order]
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
        offsets = offsets[order]
    whole = parts[0]._replace(values=values, scales=scales, offsets=offsets)
    linear.nbits = NBits(nbits.bits, nbits.block_size, [whole])


def _width(linear: Linear) -> int:
    return linear.weight.shape[1] if linear.weight is not None else linear.nbits.shape[1]


def head_order(d: Decoder) -> bool:
    """Query heads 0 and 1 swapped (a converter's head permutation applied wrongly)."""
    changed = False
    for layer in d.layers:
        if layer.qkv is None:
            continue
        head = d.heads(layer)[2]
        order = np.arange(_width(layer.qkv))
        order[: 2 * head] = np.concatenate([order[head : 2 * head], order[:head]])
        _permuted(layer.qkv, order)
        changed = True
    return changed


def gate_up(d: Decoder) -> bool:
    """The gated MLP's gate and up projections swapped."""
    if not d.gated_mlp:
        return False
    for layer in d.layers:
        half = _width(layer.up) // 2
        _permuted(layer.up, np.concatenate([np.arange(half, 2 * half), np.arange(half)]))
    return True


def softcap(d: Decoder) -> bool:
    """The final logit softcap dropped."""
    if d.logits_softcap is None:
        return False
    d.logits_softcap = None
    return True


def sliding_window(d: Decoder) -> bool:
    """Every sliding window one position too wide."""
    changed = False
    for layer in d.layers:
        if layer.sliding_window is not None:
            layer.sliding_window += 1
            changed = True
    return changed


def embedding_scale(d: Decoder) -> bool:
    """Gemma's sqrt(n_embd) embedding scale dropped."""
    if d.embedding_scale is None:
        return False
    d.embedding_scale = None
    return True


def embedding_scale_bf16(d: Decoder) -> bool:
    """The embedding scale rounded to bfloat16 (HF's Gemma computed it so once): 9.7980 -> 9.8125 at 96 wide."""
    if d.embedding_scale is None:
        return False
    bits = np.array(d.embedding_scale, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    if float(rounded) == d.embedding_scale:
        return False
    d.embedding_scale = float(rounded)
    return True


def attention_scale(d: Decoder) -> bool:
    """Attention scores scaled by 1/sqrt(head_dim) * 1.25 (a query_pre_attn_scalar misread)."""
    base = d.attention_scale if d.attention_scale is not None else d.head_dim**-0.5
    d.attention_scale = base * 1.25
    return True


def kv_source(d: Decoder) -> bool:
    """A layer that reads another layer's keys and values reading the wrong one (an earlier layer of its kind)."""
    for index, layer in enumerate(d.layers):
        if layer.kv_source is None:
            continue
        same_kind = [
            i
            for i, other in enumerate(d.layers[:index])
            if other.kv_source is None
            and (other.sliding_window is None) == (layer.sliding_window is None)
            and d.heads(other) == d.heads(d.layers[layer.kv_source])
        ]
        wrong = [i for i in same_kind if i != layer.kv_source]
        if wrong:
            layer.kv_source = wrong[0]
            return True
    return False


MISTAKES: dict[str, Callable[[Decoder], bool]] = {
    "rope_base": rope_base,
    "rope_scaling": rope_scaling,
    "norm_plus_one": norm_plus_one,
    "head_order": head_order,
    "gate_up": gate_up,
    "softcap": softcap,
    "sliding_window": sliding_window,
    "embedding_scale": embedding_scale,
    "embedding_scale_bf16": embedding_scale_bf16,
    "attention_scale": attention_scale,
    "kv_source": kv_source,
}


class NotApplicable(Exception):
    """The model has nothing this mistake could get wrong."""


@contextmanager
def injected(name: str) -> Iterator[None]:
    """Export builds its fused graph from a Decoder with mistake `name` in it; NotApplicable is raised from the
    export where the model has nothing it could get wrong."""
    mistake = MISTAKES[name]
    build = onnx_export.build_fused_graph

    def wrong_graph(decoder: Decoder, *args, **kwargs):
        if not mistake(decoder):
            raise NotApplicable(name)
        return build(decoder, *args, **kwargs)

    with mock.patch.object(onnx_export, "build_fused_graph", wrong_graph):
        yield
