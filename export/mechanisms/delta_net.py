"""Gated DeltaNet in place of attention (Qwen3.5's linear-attention layers; Yang, Kautz and Hatamizadeh 2024,
"Gated Delta Networks"): q, k, v from a depthwise causal convolution (+ SiLU) over in_proj(h), q and k L2-normalized,
beta = sigmoid(h W_b), g = -exp(A_log) softplus(h W_a + dt_bias), the gated delta rule, RMSNorm(out) * silu(h W_z),
out_proj. Its states are the graph's past.%d.conv (B, channels, kernel - 1) and past.%d.recurrent
(B, v_heads, v_dim, k_dim), the value-major layout of com.microsoft GatedDeltaNet.

The traced graph: the reference model's rule is one placeholder node (domain "edgelm", op PLACEHOLDER) that
export/traced.py turns into com.microsoft GatedDeltaNet with CONTRIB's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import helper

from ...runtime.contract import IONames
from ..graph_nodes import MS_DOMAIN, GraphSteps
from ..linear import Linear, Norm

PLACEHOLDER = "GatedDeltaNet"  # the traced graph's edgelm::GatedDeltaNet node (export/models/qwen35.py)
# the com.microsoft op it becomes: (its attributes, the positions of the optional inputs the placeholder leaves out)
CONTRIB = ({"update_rule": "gated_delta"}, (3,))  # 3: cu_seqlens (uniform batches)


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

    LINEARS = ("in_proj", "z", "b", "a", "out_proj")  # its Linear fields

    @property
    def linears(self) -> list[Linear]:
        return [getattr(self, name) for name in self.LINEARS]

    def states(self, io: IONames, i: int) -> list[tuple[str, str, list]]:
        return states(self, io, i)

    def step(self, g: GraphSteps, h: str, prefix: str, io: IONames, i: int, *, eps: float) -> str:
        return step(g, h, prefix, self, io, i, eps=eps)


def states(net: DeltaNet, io: IONames, i: int) -> list[tuple[str, str, list]]:
    """Layer i's states as (past name, present name, shape): the convolution's, then the recurrence's."""
    return [
        (io.past_conv % i, io.present_conv % i, ["batch_size", net.channels, net.kernel - 1]),
        (io.past_recurrent % i, io.present_recurrent % i, ["batch_size", net.v_heads, net.v_dim, net.k_dim]),
    ]


def step(g: GraphSteps, h: str, prefix: str, n: DeltaNet, io: IONames, i: int, *, eps: float) -> str:
    """Layer i's Gated DeltaNet: its conv state through com.microsoft CausalConvWithState (SiLU), the recurrence
    through com.microsoft GatedDeltaNet (io's past.%d.recurrent -> present.%d.recurrent), the gates in standard
    ops; eps: the output norm's. Returns its (B, T, n_embd) output."""
    p = f"{prefix}/delta"
    mixed = g.linear(h, f"{prefix}.delta.in_proj", n.in_proj)  # (B, T, channels)
    channels = g.op("Transpose", [mixed], f"{p}/Transpose", perm=[0, 2, 1])
    conv = f"{p}/CausalConvWithState"
    inputs = [channels, g.constant(f"{prefix}.delta.conv.weight", n.conv_weight), "", io.past_conv % i]
    g.nodes.append(
        helper.make_node(
            "CausalConvWithState", inputs, [conv, io.present_conv % i], name=conv, domain=MS_DOMAIN,
            activation="silu",
        )
    )  # fmt: skip
    g.float_output(conv, ["batch_size", n.channels, "sequence_length"])
    qkv = g.op("Transpose", [conv], f"{p}/back", perm=[0, 2, 1])  # (B, T, channels)
    widths = [n.k_heads * n.k_dim, n.k_heads * n.k_dim, n.v_heads * n.v_dim]
    sizes = g.small_constant(f"{p}/sizes", np.array(widths, dtype=np.int64))
    names = [f"{p}/q", f"{p}/k", f"{p}/v"]
    g.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{p}/Split", axis=-1))
    heads = lambda x, count, size: g.op(  # noqa: E731
        "Reshape", [x, g.small_constant(f"{x}/shape", np.array([0, 0, count, size], np.int64))], f"{x}/heads"
    )
    axis = g.small_constant(f"{p}/last_axis", np.array([-1], dtype=np.int64))
    epsilon = g.small_constant(f"{p}/eps", np.array(1e-6, dtype=np.float32))
    normed = []
    for x in names[:2]:  # x / sqrt(sum(x^2) + 1e-6) per head, as transformers' l2norm
        x = heads(x, n.k_heads, n.k_dim)
        total = g.op("ReduceSum", [g.op("Mul", [x, x], f"{x}/sq"), axis], f"{x}/sum", keepdims=1)
        inverse = g.op(
            "Reciprocal", [g.op("Sqrt", [g.op("Add", [total, epsilon], f"{x}/eps")], f"{x}/sqrt")], f"{x}/inv"
        )
        normed.append(g.op("Mul", [x, inverse], f"{x}/l2"))
    v = heads(names[2], n.v_heads, n.v_dim)
    beta = g.op("Sigmoid", [g.linear(h, f"{prefix}.delta.b", n.b)], f"{p}/beta")  # (B, T, v_heads)
    raw = g.op(
        "Add", [g.linear(h, f"{prefix}.delta.a", n.a), g.constant(f"{prefix}.delta.dt_bias", n.dt_bias)], f"{p}/a"
    )
    decay_scale = g.constant(f"{prefix}.delta.neg_exp_a_log", -np.exp(n.a_log.astype(np.float32)))
    decay = g.op("Mul", [g.op("Softplus", [raw], f"{p}/softplus"), decay_scale], f"{p}/decay")
    rule = f"{p}/GatedDeltaNet"
    attributes, _ = CONTRIB
    g.nodes.append(
        helper.make_node(
            "GatedDeltaNet", [*normed, v, "", decay, beta, io.past_recurrent % i], [rule, io.present_recurrent % i],
            name=rule, domain=MS_DOMAIN, **attributes,
        )
    )  # fmt: skip
    g.float_output(rule, ["batch_size", "sequence_length", n.v_heads, n.v_dim])
    inputs = [rule, g.constant(f"{prefix}.delta.norm.weight", n.norm.weight)]
    out = g.op("SimplifiedLayerNormalization", inputs, f"{p}/norm", axis=-1, epsilon=eps)
    g.float_output(out, ["batch_size", "sequence_length", n.v_heads, n.v_dim])
    z = heads(g.linear(h, f"{prefix}.delta.z", n.z), n.v_heads, n.v_dim)
    gated = g.op("Mul", [out, g.op("Mul", [z, g.op("Sigmoid", [z], f"{p}/z_sigmoid")], f"{p}/z_silu")], f"{p}/gated")
    if n.out_heads is not None:
        order = g.small_constant(f"{p}/out_heads", n.out_heads)
        gated = g.op("Gather", [gated, order], f"{p}/reordered", axis=2)
    flat = g.small_constant(f"{p}/flat", np.array([0, 0, -1], dtype=np.int64))
    return g.linear(g.op("Reshape", [gated, flat], f"{p}/flat_out"), f"{prefix}.delta.out_proj", n.out_proj)
