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
