"""The tied embedding through quantization.

Export stores a tied embedding once: one (C, V) matrix read by both the LM head (MatMul) and the
embedding (Gather along axis 1, then Transpose). Quantizing the LM head would leave the Gather reading a
float copy; these rewrites point it at the quantized matrix instead and dequantize only the gathered
columns, so the package keeps one quantized table: int8 (dynamic and static recipes) or MatMulNBits'
packed blocks (int4 recipe).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def column_gathers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Gather(axis=1) nodes: export's shared embedding reads columns of the LM head's (n_embd, vocab)
    matrix (see module docstring)."""
    return [
        n for n in model.graph.node if n.op_type == "Gather" and any(a.name == "axis" and a.i == 1 for a in n.attribute)
    ]


def tied_gathers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The shared embedding's Gathers while they still read the float matrix itself (an initializer)."""
    initializers = {init.name for init in model.graph.initializer}
    return [n for n in column_gathers(model) if n.input[0] in initializers]


def gather_from_int8(
    model: onnx.ModelProto, gather: onnx.NodeProto, quantized: str, scale: str, zero_point: str | None
) -> None:
    """Rewire a tied-embedding Gather to gather int8 columns and dequantize only those:
    Gather(W_q, ids, axis=1) (d, B, T) -> Cast -> [- zp] -> Transpose (B, T, d) -> * scale[ids][..., None]."""
    graph = model.graph
    index = list(graph.node).index(gather)
    ids, out = gather.input[1], gather.output[0]
    transpose = next(n for n in graph.node if n.input and n.input[0] == out and n.op_type == "Transpose")
    name = gather.name or out
    columns, as_float, centered = f"{name}_q_columns", f"{name}_q_float", f"{name}_q_centered"
    scales, scales_3d = f"{name}_q_scales", f"{name}_q_scales_3d"
    axes = f"{name}_q_axes"
    nodes = [
        helper.make_node("Gather", [quantized, ids], [columns], axis=1, name=f"{name}_q_gather"),
        helper.make_node("Cast", [columns], [as_float], to=onnx.TensorProto.FLOAT, name=f"{name}_q_cast"),
    ]
    source = as_float
    if zero_point is not None:
        zp = f"{name}_q_zp_float"
        nodes += [
            helper.make_node("Gather", [zero_point, ids], [zp + "_g"], axis=0, name=f"{name}_q_zp_gather"),
            helper.make_node("Cast", [zp + "_g"], [zp], to=onnx.TensorProto.FLOAT, name=f"{name}_q_zp_cast"),
            helper.make_node("Sub", [as_float, zp], [centered], name=f"{name}_q_sub"),
        ]
        source = centered
    graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), axes))
    nodes += [
        helper.make_node("Gather", [scale, ids], [scales], axis=0, name=f"{name}_q_scale_gather"),
        helper.make_node("Unsqueeze", [scales, axes], [scales_3d], name=f"{name}_q_unsqueeze"),
    ]
    # the Transpose that followed the Gather now reads the dequantized columns' transpose
    transposed = f"{name}_q_rows"
    nodes.append(helper.make_node("Transpose", [source], [transposed], perm=[1, 2, 0], name=f"{name}_q_transpose"))
    nodes.append(helper.make_node("Mul", [transposed, scales_3d], [transpose.output[0]], name=f"{name}_q_mul"))
    graph.node.remove(transpose)
    graph.node.remove(gather)
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)


def gather_from_nbits(
    model: onnx.ModelProto, gather: onnx.NodeProto, packed: str, scales: str, *, bits: int, block_size: int
) -> None:
    """Rewire a tied-embedding Gather to read MatMulNBits' packed weights (vocab, n_blocks, blob) and
    dequantize only the gathered rows: symmetric, so the zero point is 2^(bits-1); 4-bit values are
    packed two to a byte, low nibble first; times the block scale."""
    assert bits in (4, 8), f"MatMulNBits gather supports 4 or 8 bits, got {bits}"
    graph = model.graph
    index = list(graph.node).index(gather)
    ids, out = gather.input[1], gather.output[0]
    transpose = next(n for n in graph.node if n.input and n.input[0] == out and n.op_type == "Transpose")
    rows_out = transpose.output[0]
    p = (gather.name or out) + f"_int{bits}"
    packed_dims = next(i.dims for i in graph.initializer if i.name == packed)  # (vocab, n_blocks, blob)
    n_blocks = packed_dims[1]
    constants = {
        f"{p}_zero_point": np.array(2 ** (bits - 1), dtype=np.float32),
        f"{p}_last": np.array([-1], dtype=np.int64),
        f"{p}_row_shape": np.array([0, 0, n_blocks * block_size], dtype=np.int64),
    }
    if bits == 4:
        constants[f"{p}_sixteen"] = np.array(16, dtype=np.int32)
        constants[f"{p}_block_shape"] = np.array([0, 0, n_blocks, block_size], dtype=np.int64)
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())
    n = lambda op, inputs, output, **attrs: helper.make_node(
        op, inputs, [output], name=f"{p}_{output[len(p) :]}", **attrs
    )
    nodes = [n("Gather", [packed, ids], f"{p}_bytes", axis=0)]  # (B, T, n_blocks, blob) uint8
    values = f"{p}_bytes"  # 8 bits: one byte a value, blob == block
    if bits == 4:
        values = f"{p}_nibbles"
        nodes += [
            n("Cast", [f"{p}_bytes"], f"{p}_ints", to=onnx.TensorProto.INT32),
            n("Mod", [f"{p}_ints", f"{p}_sixteen"], f"{p}_low"),
            n("Div", [f"{p}_ints", f"{p}_sixteen"], f"{p}_high"),
            n("Unsqueeze", [f"{p}_low", f"{p}_last"], f"{p}_low5"),
            n("Unsqueeze", [f"{p}_high", f"{p}_last"], f"{p}_high5"),
            n("Concat", [f"{p}_low5", f"{p}_high5"], f"{p}_pairs", axis=-1),  # (B, T, n_blocks, blob, 2)
            n("Reshape", [f"{p}_pairs", f"{p}_block_shape"], values),  # (B, T, n_blocks, block)
        ]
    nodes += [
        n("Cast", [values], f"{p}_float", to=onnx.TensorProto.FLOAT),
        n("Sub", [f"{p}_float", f"{p}_zero_point"], f"{p}_centered"),
        n("Gather", [scales, ids], f"{p}_scales", axis=0),  # (B, T, n_blocks)
        n("Unsqueeze", [f"{p}_scales", f"{p}_last"], f"{p}_scales4"),
        n("Mul", [f"{p}_centered", f"{p}_scales4"], f"{p}_blocks"),
        helper.make_node("Reshape", [f"{p}_blocks", f"{p}_row_shape"], [rows_out], name=f"{p}_rows"),
    ]
    graph.node.remove(transpose)
    graph.node.remove(gather)
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)


def drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    used |= {o.name for o in model.graph.output}
    for init in [i for i in model.graph.initializer if i.name not in used]:
        model.graph.initializer.remove(init)


def share_int8_embedding(model: onnx.ModelProto, weight_names: dict) -> None:
    """After int8 quantization of the LM head: point the tied Gather at the int8 copy.

    Dynamic quantization leaves the Gather reading the fp32 table and names the int8 copy after it
    (weight_names: table -> (quantized, scale, zero point)); QDQ rewires the Gather to the table's
    DequantizeLinear, which would dequantize the whole (n_embd, vocab) matrix on every step."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    for gather in column_gathers(model):
        table = gather.input[0]
        dequantize = producers.get(table)
        if table in weight_names:
            quantized, scale, zero_point = weight_names[table]
        elif dequantize is not None and dequantize.op_type == "DequantizeLinear" and dequantize.input[0] in inits:
            quantized, scale = dequantize.input[0], dequantize.input[1]
            zero_point = dequantize.input[2] if len(dequantize.input) > 2 else ""
        else:
            continue
        if quantized not in inits or scale not in inits:
            continue
        if numpy_helper.to_array(inits[scale]).ndim != 1:
            continue  # per-tensor scale: not worth special-casing
        zp = zero_point if zero_point in inits and numpy_helper.to_array(inits[zero_point]).any() else None
        gather_from_int8(model, gather, quantized, scale, zp)
    drop_unused_initializers(model)
