"""A short gated convolution in place of attention (LFM2's, Liquid AI 2025): B, C, x = in_proj(h) split in three
(channels first), y = a depthwise causal convolution of B * x whose state is the last kernel - 1 inputs (com.microsoft
CausalConvWithState), out = out_proj(C * y). The state is the graph's past.%d.conv / present.%d.conv,
(B, channels, kernel - 1). The traced graph needs no placeholder: the reference's Conv1d traces to standard ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import helper

from ...runtime.contract import IONames
from ..graph_nodes import MS_DOMAIN, GraphSteps
from ..linear import Linear


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

    @property
    def channels(self) -> int:
        return self.weight.shape[0]

    LINEARS = ("in_proj", "out_proj")  # its Linear fields

    @property
    def linears(self) -> list[Linear]:
        return [getattr(self, name) for name in self.LINEARS]

    def states(self, io: IONames, i: int) -> list[tuple[str, str, list]]:
        return states(self, io, i)

    def step(self, g: GraphSteps, h: str, prefix: str, io: IONames, i: int, *, eps: float) -> str:
        """The step every state mixer has (eps: the Decoder's norm epsilon, which this one does not use)."""
        return step(g, h, prefix, self, io, i)


def states(conv: ShortConv, io: IONames, i: int) -> list[tuple[str, str, list]]:
    """Layer i's state as (past name, present name, shape): (B, channels, kernel - 1)."""
    return [(io.past_conv % i, io.present_conv % i, ["batch_size", conv.channels, conv.kernel - 1])]


def step(g: GraphSteps, h: str, prefix: str, conv: ShortConv, io: IONames, i: int) -> str:
    """Layer i's convolution: in_proj, B * x through com.microsoft CausalConvWithState (its state past.%d.conv ->
    present.%d.conv), times C, out_proj. Returns its (B, T, channels) output."""
    past, present = io.past_conv % i, io.present_conv % i
    gates = g.linear(h, f"{prefix}.conv.in_proj", conv.in_proj)  # (B, T, 3C)
    channels = g.op("Transpose", [gates], f"{prefix}/conv/Transpose", perm=[0, 2, 1])  # (B, 3C, T)
    sizes = g.small_constant(f"{prefix}/conv/sizes", np.array([conv.channels] * 3, dtype=np.int64))
    b, c, x = (f"{prefix}/conv/{name}" for name in "bcx")
    g.nodes.append(helper.make_node("Split", [channels, sizes], [b, c, x], name=f"{prefix}/conv/Split", axis=1))
    gated = g.op("Mul", [b, x], f"{prefix}/conv/gated")
    bias = "" if conv.bias is None else g.constant(f"{prefix}.conv.bias", conv.bias)
    inputs = [gated, g.constant(f"{prefix}.conv.weight", conv.weight), bias, past]
    y = f"{prefix}/conv/CausalConvWithState"
    g.nodes.append(helper.make_node("CausalConvWithState", inputs, [y, present], name=y, domain=MS_DOMAIN))
    g.float_output(y, ["batch_size", conv.channels, "sequence_length"])
    out = g.op("Transpose", [g.op("Mul", [c, y], f"{prefix}/conv/out")], f"{prefix}/conv/back", perm=[0, 2, 1])
    return g.linear(out, f"{prefix}.conv.out_proj", conv.out_proj)
