"""Per-layer input embeddings (Gemma 4's; Gemma 3n's "per-layer embeddings"): beside the token embedding, a table
gathered per token gives every layer D values of its own, which the layer adds after its MLP's residual sum.

    the inputs   (B, T, n_layer, D): the table's rows (times sqrt(D)) plus the token embeddings projected (times
                 n_embd ** -0.5) and RMS-normed over D, times 2 ** -0.5 (the Decoder's per_layer_* fields)
    a layer      x + norm(proj(act(x W_gate) * its (B, T, D) input)): a PerLayerInput
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...runtime.contract import IONames
from ..graph_nodes import MS_DOMAIN, GraphSteps
from ..linear import Linear, Norm


@dataclass
class PerLayerInput:
    """A layer's share of the per-layer input embeddings (Gemma 4), after its MLP's residual Add:
    x + norm(proj(act(x W_gate) * its (B, T, D) input))."""

    gate: Linear  # (n_embd, D)
    projection: Linear  # (D, n_embd)
    norm: Norm  # (n_embd,)

    @property
    def linears(self) -> list[Linear]:
        return [self.gate, self.projection]


def inputs(g: GraphSteps, x: str, d: Any, io: IONames) -> str:
    """(B, T, n_layer, D): every layer's per-layer input for each token, from x, the token embeddings (B, T, C),
    and the table (d: the export/decoder.py Decoder, whose per_layer_* fields hold it)."""
    dim = d.per_layer_dim
    scalar = lambda name, value: g.small_constant(name, np.array(value, dtype=np.float32))  # noqa: E731
    if d.per_layer_embedding_nbits is not None:  # a stand-in table, rewired to read the blocks
        g.nbits_weights("per_layer.embed", d.per_layer_embedding_nbits)
        columns = g.op("Gather", ["per_layer.embed.weight_T", io.input_ids], "per_layer/Gather", axis=1)
        rows = g.op("Transpose", [columns], "per_layer/Transpose", perm=[1, 2, 0])  # (B, T, n_layer * D)
    else:
        table = g.constant("per_layer.embedding", d.per_layer_embedding)
        rows = g.op("Gather", [table, io.input_ids], "per_layer/Gather", axis=0)  # (B, T, n_layer * D)
    rows = g.op("Mul", [rows, scalar("per_layer/row_scale", dim**0.5)], "per_layer/rows")
    projected = g.linear(x, "per_layer.projection", d.per_layer_projection)
    projected = g.op("Mul", [projected, scalar("per_layer/projection_scale", d.n_embd**-0.5)], "per_layer/scaled")
    shape = g.small_constant("per_layer/shape", np.array([0, 0, d.n_layer, dim], dtype=np.int64))
    projected = g.op("Reshape", [projected, shape], "per_layer/projected")  # (B, T, n_layer, D)
    normed = g.op(
        "SimplifiedLayerNormalization",
        [projected, g.constant("per_layer.norm.weight", d.per_layer_norm.weight)],
        "per_layer/norm",
        axis=-1,
        epsilon=d.norm_eps,
    )
    g.float_output(normed, ["batch_size", "sequence_length", d.n_layer, dim])
    total = g.op("Add", [normed, g.op("Reshape", [rows, shape], "per_layer/rows_4d")], "per_layer/sum")
    return g.op("Mul", [total, scalar("per_layer/mean_scale", 2.0**-0.5)], "per_layer/inputs")


def step(g: GraphSteps, x: str, prefix: str, part: PerLayerInput, d: Any, inputs: str, index: int) -> str:
    """x + norm(proj(act(x W_gate) * layer `index`'s (B, T, D) slice of `inputs`)); d: the Decoder (its norm)."""
    mine = g.op("Gather", [inputs, g.small_constant(f"{prefix}/per_layer_index", np.array(index))],
                f"{prefix}/per_layer_input", axis=2)  # fmt: skip
    gate = g.linear(x, f"{prefix}.per_layer.gate", part.gate)  # (B, T, D)
    shape = ["batch_size", "sequence_length", d.per_layer_dim]
    act = g.float_output(g.op("FastGelu", [gate], f"{prefix}/per_layer/FastGelu", domain=MS_DOMAIN), shape)
    out = g.linear(g.op("Mul", [act, mine], f"{prefix}/per_layer/gated"), f"{prefix}.per_layer.projection",
                   part.projection)  # fmt: skip
    out = g.norm(out, f"{prefix}.per_layer.norm", part.norm, d)
    return g.op("Add", [x, out], f"{prefix}/per_layer_residual")
