"""A Gather that reads rows of MatMulNBits' packed weights: how a tied embedding shares the LM head's
quantized blocks (com.microsoft MatMulNBits, https://github.com/microsoft/onnxruntime/blob/main/docs/ContribOperators.md).

Shared by quantize/ (the int4 recipe quantizes the head, then points the embedding at it) and export/
(a GGUF file's own blocks kept for a tied head), so it lives outside both.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _constants(p: str, *, bits: int, n_blocks: int, block_size: int) -> dict[str, np.ndarray]:
    """The initializers the gather's nodes read, named under the prefix p."""
    constants = {
        f"{p}_zero_point": np.array(2 ** (bits - 1), dtype=np.float32),
        f"{p}_last": np.array([-1], dtype=np.int64),
        f"{p}_row_shape": np.array([0, 0, n_blocks * block_size], dtype=np.int64),
    }
    if bits == 4:
        constants[f"{p}_sixteen"] = np.array(16, dtype=np.int32)
        constants[f"{p}_block_shape"] = np.array([0, 0, n_blocks, block_size], dtype=np.int64)
    return constants


def _node_maker(p: str):
    """make(op, inputs, output, **attrs): a one-output node named after its output, under the prefix p."""
    return lambda op, inputs, output, **attrs: helper.make_node(
        op, inputs, [output], name=f"{p}_{output[len(p) :]}", **attrs
    )


def _unpacked_rows(n, p: str, *, packed: str, ids: str, bits: int) -> tuple[list[onnx.NodeProto], str]:
    """Nodes gathering the ids' packed rows and unpacking them to one integer a value; returns their output."""
    nodes = [n("Gather", [packed, ids], f"{p}_bytes", axis=0)]  # (B, T, n_blocks, blob) uint8
    if bits == 8:  # one byte a value, blob == block
        return nodes, f"{p}_bytes"
    nodes += [
        n("Cast", [f"{p}_bytes"], f"{p}_ints", to=onnx.TensorProto.INT32),
        n("Mod", [f"{p}_ints", f"{p}_sixteen"], f"{p}_low"),
        n("Div", [f"{p}_ints", f"{p}_sixteen"], f"{p}_high"),
        n("Unsqueeze", [f"{p}_low", f"{p}_last"], f"{p}_low5"),
        n("Unsqueeze", [f"{p}_high", f"{p}_last"], f"{p}_high5"),
        n("Concat", [f"{p}_low5", f"{p}_high5"], f"{p}_pairs", axis=-1),  # (B, T, n_blocks, blob, 2)
        n("Reshape", [f"{p}_pairs", f"{p}_block_shape"], f"{p}_nibbles"),  # (B, T, n_blocks, block)
    ]
    return nodes, f"{p}_nibbles"


def _dequantized_blocks(
    n, p: str, values: str, *, scales: str, ids: str, offsets: str | None
) -> tuple[list[onnx.NodeProto], str]:
    """Nodes turning the unpacked values into floats: (q - zero point) * scale (+ offset); returns their output."""
    nodes = [
        n("Cast", [values], f"{p}_float", to=onnx.TensorProto.FLOAT),
        n("Sub", [f"{p}_float", f"{p}_zero_point"], f"{p}_centered"),
        n("Gather", [scales, ids], f"{p}_scales", axis=0),  # (B, T, n_blocks)
        n("Unsqueeze", [f"{p}_scales", f"{p}_last"], f"{p}_scales4"),
        n("Mul", [f"{p}_centered", f"{p}_scales4"], f"{p}_blocks"),
    ]
    if offsets is None:
        return nodes, f"{p}_blocks"
    nodes += [  # w = scale * (q - zero point) + offset
        n("Gather", [offsets, ids], f"{p}_offset_columns", axis=1),  # (n_blocks, B, T)
        n("Transpose", [f"{p}_offset_columns"], f"{p}_offsets", perm=[1, 2, 0]),  # (B, T, n_blocks)
        n("Unsqueeze", [f"{p}_offsets", f"{p}_last"], f"{p}_offsets4"),
        n("Add", [f"{p}_blocks", f"{p}_offsets4"], f"{p}_shifted"),
    ]
    return nodes, f"{p}_shifted"


def gather_from_nbits(
    model: onnx.ModelProto,
    gather: onnx.NodeProto,
    packed: str,
    scales: str,
    *,
    bits: int,
    block_size: int,
    n_blocks: int | None = None,
    offsets: str | None = None,
) -> None:
    """Rewire an embedding's Gather (a tied one's columns then Transpose, or an untied table's rows, axis 0) to
    read MatMulNBits' packed weights (vocab, n_blocks, blob) and
    dequantize only the gathered rows: symmetric, so the zero point is 2^(bits-1); 4-bit values are
    packed two to a byte, low nibble first; times the block scale; plus, given `offsets` (the name of a
    (n_blocks, vocab) float tensor, the head's block offsets: export/graph.py), each block's offset. n_blocks:
    blocks a row; None: read from the packed initializer (a tensor computed at load must give it)."""
    assert bits in (4, 8), f"MatMulNBits gather supports 4 or 8 bits, got {bits}"
    graph = model.graph
    index = list(graph.node).index(gather)
    ids, out = gather.input[1], gather.output[0]
    columns = any(a.name == "axis" and a.i == 1 for a in gather.attribute)  # else rows of a (vocab, C) table
    transpose = (
        next(n for n in graph.node if n.input and n.input[0] == out and n.op_type == "Transpose") if columns else None
    )
    p = (gather.name or out) + f"_int{bits}"
    if n_blocks is None:
        n_blocks = next(i.dims for i in graph.initializer if i.name == packed)[1]  # of (vocab, n_blocks, blob)
    constants = _constants(p, bits=bits, n_blocks=n_blocks, block_size=block_size)
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())
    make = _node_maker(p)
    unpack, values = _unpacked_rows(make, p, packed=packed, ids=ids, bits=bits)
    dequantize, blocks = _dequantized_blocks(make, p, values, scales=scales, ids=ids, offsets=offsets)
    result = transpose.output[0] if columns else out
    rows = helper.make_node("Reshape", [blocks, f"{p}_row_shape"], [result], name=f"{p}_rows")
    if columns:
        graph.node.remove(transpose)
    graph.node.remove(gather)
    for offset, node in enumerate([*unpack, *dequantize, rows]):
        graph.node.insert(index + offset, node)
