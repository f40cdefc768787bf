"""The fused graph's token mixers, one per kind of layer (export/graph.py calls them): attention as one
com.microsoft GroupQueryAttention node on the packed Q/K/V product (per-head norms, an output gate, rotary
positions inside the node or, where it cannot take them, a RotaryEmbedding before it, and KV sharing: a layer
that reads another's cache); LFM2's short convolution through com.microsoft CausalConvWithState; and Qwen3.5's
Gated DeltaNet through CausalConvWithState and com.microsoft GatedDeltaNet. Each keeps its state in the graph's
cache inputs and outputs and returns its (B, T, n_embd) output before the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import helper

from ..runtime.contract import IONames
from .decoder import Decoder, DeltaNet, Layer, ShortConv
from .graph_nodes import MS_DOMAIN, _Nodes


@dataclass
class _Rotary:
    caches: list[str]  # cos and sin tables
    width: int  # how many of a head's values rotate
    positions: str | None = None  # (B, T) rows of the tables, per row; None: GroupQueryAttention rotates itself


class _Mixers(_Nodes):
    """Attention and the state layers; `linear` is the builder's (export/graph.py)."""

    def split_qkv(self, qkv: str, prefix: str, d: Decoder, layer: Layer | None = None) -> list[str]:
        """Q, K and V split from the packed product (V is K's projection where the layer says so)."""
        n_head, n_kv_head, head_dim = d.heads(layer) if layer is not None else (d.n_head, d.n_kv_head, d.head_dim)
        widths = [n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim]
        names = [f"{prefix}/q", f"{prefix}/k", f"{prefix}/v"]
        if layer is not None and layer.value_is_key:
            widths, names = widths[:2], names[:2]
        sizes = self.small_constant(f"{prefix}/qkv_sizes", np.array(widths, dtype=np.int64))
        self.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{prefix}/qkv_Split", axis=-1))
        return names if len(names) == 3 else [*names, names[1]]

    def head_norm(
        self, x: str, prefix: str, name: str, weight: np.ndarray, heads: int, head_dim: int, eps: float
    ) -> str:
        """x (B, T, heads * hs) RMS-normalized over each head's values, times `weight` (hs,)."""
        shape = self.small_constant(f"{prefix}/{name}_head_shape", np.array([0, 0, -1, head_dim], dtype=np.int64))
        flat = self.small_constant(f"{prefix}/{name}_flat_shape", np.array([0, 0, -1], dtype=np.int64))
        split = self.op("Reshape", [x, shape], f"{prefix}/{name}_heads")  # (B, T, heads, hs)
        inputs = [split, self.constant(f"{prefix}.{name}_norm.weight", weight)]
        normed = self.op("SimplifiedLayerNormalization", inputs, f"{prefix}/{name}_norm", axis=-1, epsilon=eps)
        self.float_output(normed, ["batch_size", "sequence_length", heads, head_dim])
        return self.op("Reshape", [normed, flat], f"{prefix}/{name}_normed")  # (B, T, heads * hs)

    def head_norms(self, qkv: str, prefix: str, layer: Layer, decoder: Decoder) -> list[str]:
        """GroupQueryAttention's query, key and value inputs: the packed product alone, or, with per-head norms
        (Qwen3, Gemma 3), Q and K split from it and RMS-normalized over each head's head_dim values (V as it is,
        or weightless-normed: Gemma 4's v_norm)."""
        if layer.q_norm is None:
            return [qkv, "", ""]
        d = decoder
        n_head, n_kv_head, head_dim = d.heads(layer)
        if layer.attention_gate:  # the gate after V (Qwen3.5)
            widths = [n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim, n_head * head_dim]
            sizes = self.small_constant(f"{prefix}/qkv_sizes", np.array(widths, dtype=np.int64))
            names = [f"{prefix}/q", f"{prefix}/k", f"{prefix}/v", f"{prefix}/gate"]
            self.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{prefix}/qkv_Split", axis=-1))
        else:
            names = self.split_qkv(qkv, prefix, d, layer)
        q = self.head_norm(names[0], prefix, "q", layer.q_norm.weight, n_head, head_dim, d.norm_eps)
        k = self.head_norm(names[1], prefix, "k", layer.k_norm.weight, n_kv_head, head_dim, d.norm_eps)
        v = names[2]
        if layer.v_norm:
            v = self.head_norm(v, prefix, "v", np.ones(head_dim, np.float32), n_kv_head, head_dim, d.norm_eps)
        return [q, k, v]

    def rotated(self, qkv: list[str], prefix: str, d: Decoder, rotary: _Rotary) -> list[str]:
        """Q and K rotated before attention, each row at its own positions into the tables (com.microsoft
        RotaryEmbedding; the first rotary_dim values of each head), V as it is."""
        if qkv[1] == "":
            qkv = self.split_qkv(qkv[0], prefix, d)
        q, k, v = qkv
        width = rotary.width
        inputs = [rotary.positions, *rotary.caches]
        q = self.op("RotaryEmbedding", [q, *inputs], f"{prefix}/q_rotary", domain=MS_DOMAIN, num_heads=d.n_head,
                    rotary_embedding_dim=width)  # fmt: skip
        k = self.op("RotaryEmbedding", [k, *inputs], f"{prefix}/k_rotary", domain=MS_DOMAIN, num_heads=d.n_kv_head,
                    rotary_embedding_dim=width)  # fmt: skip
        self.float_output(q, ["batch_size", "sequence_length", d.n_head * d.head_dim])
        self.float_output(k, ["batch_size", "sequence_length", d.n_kv_head * d.head_dim])
        return [q, k, v]

    def shared_inputs(self, qkv: str, prefix: str, layer: Layer, d: Decoder) -> list[str]:
        """A KV-shared layer's GroupQueryAttention inputs: its query (normed), and the key and value inputs of the
        layer it reads (kv_inputs), which that layer's node already wrote into the cache this node reads."""
        n_head, _, head_dim = d.heads(layer)
        q = qkv if layer.q_norm is None else self.head_norm(qkv, prefix, "q", layer.q_norm.weight, n_head, head_dim,
                                                            d.norm_eps)  # fmt: skip
        return [q, *self.kv_inputs[f"layers.{layer.kv_source}"]]

    def attention(
        self,
        h: str,
        prefix: str,
        layer: Layer,
        d: Decoder,
        io: tuple[tuple[str, str], tuple[str, str]],
        lengths: list[str],
        rotary: _Rotary | None,
    ) -> str:
        """One GroupQueryAttention node on the packed Q/K/V product of h; `lengths`: seqlens_k and the total length;
        `rotary`: the layer's rotary caches (None: no positions), applied inside the node or, where it cannot
        (per-row tables, a rotary width it does not take), before it. Returns its (B, T, n_head * head_dim) output."""
        past, present = io
        n_head, n_kv_head, head_dim = d.heads(layer)
        qkv = self.linear(h, f"{prefix}.qkv", layer.qkv)  # (B, T, (n_head + 2 n_kv_head) hs): Q, K, V packed
        if layer.kv_source is not None:  # Q alone: keys and values are another layer's, read from its cache
            inputs = self.shared_inputs(qkv, prefix, layer, d)
        else:
            inputs = self.head_norms(qkv, prefix, layer, d)
            if inputs[1] == "" and self.kv_inputs is not None:
                inputs = self.split_qkv(qkv, prefix, d, layer)
            if self.kv_inputs is not None:
                self.kv_inputs[prefix] = inputs[1:]
        # a sliding layer: its own rotary caches and window (ONNX Runtime 1.32's CPU kernel counts the query's
        # own position in local_window_size, as transformers' sliding_window does: checked against it)
        window = {} if layer.sliding_window is None else {"local_window_size": layer.sliding_window}
        inside = rotary is not None and rotary.positions is None
        if rotary is not None and not inside:
            inputs = self.rotated(inputs, prefix, d, rotary)
        caches = rotary.caches if inside else []
        self.nodes.append(
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
        out = self.float_output(f"{prefix}/attention", ["batch_size", "sequence_length", n_head * head_dim])
        if not layer.attention_gate:
            return out
        gate = self.op("Sigmoid", [f"{prefix}/gate"], f"{prefix}/gate/Sigmoid")
        return self.op("Mul", [out, gate], f"{prefix}/gated_attention")

    def short_conv(self, h: str, prefix: str, conv: ShortConv, d: Decoder, past: str, present: str) -> str:
        """A convolution layer (LFM2): in_proj, B * x through com.microsoft CausalConvWithState (its state
        `past` -> `present`, (B, n_embd, kernel - 1)), times C, out_proj. Returns its (B, T, n_embd) output."""
        gates = self.linear(h, f"{prefix}.conv.in_proj", conv.in_proj)  # (B, T, 3C)
        channels = self.op("Transpose", [gates], f"{prefix}/conv/Transpose", perm=[0, 2, 1])  # (B, 3C, T)
        sizes = self.small_constant(f"{prefix}/conv/sizes", np.array([d.n_embd] * 3, dtype=np.int64))
        b, c, x = (f"{prefix}/conv/{name}" for name in "bcx")
        self.nodes.append(helper.make_node("Split", [channels, sizes], [b, c, x], name=f"{prefix}/conv/Split", axis=1))
        gated = self.op("Mul", [b, x], f"{prefix}/conv/gated")
        bias = "" if conv.bias is None else self.constant(f"{prefix}.conv.bias", conv.bias)
        inputs = [gated, self.constant(f"{prefix}.conv.weight", conv.weight), bias, past]
        y = f"{prefix}/conv/CausalConvWithState"
        self.nodes.append(helper.make_node("CausalConvWithState", inputs, [y, present], name=y, domain=MS_DOMAIN))
        self.float_output(y, ["batch_size", d.n_embd, "sequence_length"])
        out = self.op(
            "Transpose", [self.op("Mul", [c, y], f"{prefix}/conv/out")], f"{prefix}/conv/back", perm=[0, 2, 1]
        )
        return self.linear(out, f"{prefix}.conv.out_proj", conv.out_proj)

    def delta_net(self, h: str, prefix: str, n: DeltaNet, d: Decoder, io: IONames, i: int) -> str:
        """A Gated DeltaNet layer (Qwen3.5): its conv state through com.microsoft CausalConvWithState (SiLU), the
        recurrence through com.microsoft GatedDeltaNet (io's past.%d.recurrent -> present.%d.recurrent), the
        gates in standard ops. Returns its (B, T, n_embd) output."""
        p = f"{prefix}/delta"
        mixed = self.linear(h, f"{prefix}.delta.in_proj", n.in_proj)  # (B, T, channels)
        channels = self.op("Transpose", [mixed], f"{p}/Transpose", perm=[0, 2, 1])
        conv = f"{p}/CausalConvWithState"
        inputs = [channels, self.constant(f"{prefix}.delta.conv.weight", n.conv_weight), "", io.past_conv % i]
        self.nodes.append(
            helper.make_node(
                "CausalConvWithState", inputs, [conv, io.present_conv % i], name=conv, domain=MS_DOMAIN,
                activation="silu",
            )
        )  # fmt: skip
        self.float_output(conv, ["batch_size", n.channels, "sequence_length"])
        qkv = self.op("Transpose", [conv], f"{p}/back", perm=[0, 2, 1])  # (B, T, channels)
        widths = [n.k_heads * n.k_dim, n.k_heads * n.k_dim, n.v_heads * n.v_dim]
        sizes = self.small_constant(f"{p}/sizes", np.array(widths, dtype=np.int64))
        names = [f"{p}/q", f"{p}/k", f"{p}/v"]
        self.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{p}/Split", axis=-1))
        heads = lambda x, count, size: self.op(  # noqa: E731
            "Reshape", [x, self.small_constant(f"{x}/shape", np.array([0, 0, count, size], np.int64))], f"{x}/heads"
        )
        axis = self.small_constant(f"{p}/last_axis", np.array([-1], dtype=np.int64))
        eps = self.small_constant(f"{p}/eps", np.array(1e-6, dtype=np.float32))
        normed = []
        for x in names[:2]:  # x / sqrt(sum(x^2) + 1e-6) per head, as transformers' l2norm
            x = heads(x, n.k_heads, n.k_dim)
            total = self.op("ReduceSum", [self.op("Mul", [x, x], f"{x}/sq"), axis], f"{x}/sum", keepdims=1)
            inverse = self.op(
                "Reciprocal", [self.op("Sqrt", [self.op("Add", [total, eps], f"{x}/eps")], f"{x}/sqrt")], f"{x}/inv"
            )
            normed.append(self.op("Mul", [x, inverse], f"{x}/l2"))
        v = heads(names[2], n.v_heads, n.v_dim)
        beta = self.op("Sigmoid", [self.linear(h, f"{prefix}.delta.b", n.b)], f"{p}/beta")  # (B, T, v_heads)
        raw = self.op(
            "Add",
            [self.linear(h, f"{prefix}.delta.a", n.a), self.constant(f"{prefix}.delta.dt_bias", n.dt_bias)],
            f"{p}/a",
        )
        decay_scale = self.constant(f"{prefix}.delta.neg_exp_a_log", -np.exp(n.a_log.astype(np.float32)))
        decay = self.op("Mul", [self.op("Softplus", [raw], f"{p}/softplus"), decay_scale], f"{p}/decay")
        rule = f"{p}/GatedDeltaNet"
        self.nodes.append(
            helper.make_node(
                "GatedDeltaNet", [*normed, v, "", decay, beta, io.past_recurrent % i], [rule, io.present_recurrent % i],
                name=rule, domain=MS_DOMAIN, update_rule="gated_delta",
            )
        )  # fmt: skip
        self.float_output(rule, ["batch_size", "sequence_length", n.v_heads, n.v_dim])
        inputs = [rule, self.constant(f"{prefix}.delta.norm.weight", n.norm.weight)]
        out = self.op("SimplifiedLayerNormalization", inputs, f"{p}/norm", axis=-1, epsilon=d.norm_eps)
        self.float_output(out, ["batch_size", "sequence_length", n.v_heads, n.v_dim])
        z = heads(self.linear(h, f"{prefix}.delta.z", n.z), n.v_heads, n.v_dim)
        gated = self.op(
            "Mul", [out, self.op("Mul", [z, self.op("Sigmoid", [z], f"{p}/z_sigmoid")], f"{p}/z_silu")], f"{p}/gated"
        )
        if n.out_heads is not None:
            order = self.small_constant(f"{p}/out_heads", n.out_heads)
            gated = self.op("Gather", [gated, order], f"{p}/reordered", axis=2)
        flat = self.small_constant(f"{p}/flat", np.array([0, 0, -1], dtype=np.int64))
        return self.linear(self.op("Reshape", [gated, flat], f"{p}/flat_out"), f"{prefix}.delta.out_proj", n.out_proj)
