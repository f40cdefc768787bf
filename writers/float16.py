"""Half precision for a graph whose weights are held apart from it (placeholders, or external data): onnxruntime's
convert_float_to_float16 on the graph alone, and its conversion of each weight's values, a slab at a time, when
the weight is written. `quantize --mode fp16` (from a package's data file) and `export --quantize fp16` (from the
checkpoint) share it, so both write the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

SLAB_VALUES = 1 << 24  # float32 values converted at once
FLOAT16 = onnx.TensorProto.FLOAT16
FP16_FACTS = {"mode": "fp16", "note": "for GPU execution providers; KV cache and logits in float16"}  # the recipe
# nodes whose names start so keep float32 (the graph's rotary tables, computed from positions that float16 holds
# exactly only up to 2048 and finitely up to 65504; export/graph.py); a node after them gives the float16 value
KEEP_FLOAT32 = "keep_float32/"


def half_graph(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """`model` with onnxruntime's float16 conversion (inputs and outputs too: the KV cache and logits in float16;
    the nodes named KEEP_FLOAT32... and their weights as they are), and the names of the float initializers it
    converted whose values it did not hold (no raw data in the graph): their values are the caller's to convert
    (`to_half`) as they are written."""
    from unittest import mock

    from onnxruntime.transformers import float16

    held_apart = {
        t.name
        for t in model.graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT and (t.data_location == onnx.TensorProto.EXTERNAL or _empty(t))
    }
    # the converter reads a converted weight's values only for its shape (make_value_info_from_tensor): the dims
    # say it without reading the weight
    value_info = lambda tensor: helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)  # noqa: E731
    with mock.patch.object(float16, "make_value_info_from_tensor", value_info):
        kept = [node.name for node in model.graph.node if node.name.startswith(KEEP_FLOAT32)]
        converted = float16.convert_float_to_float16(
            model, keep_io_types=False, disable_shape_infer=True, node_block_list=kept
        )
    names = [t.name for t in converted.graph.initializer if t.name in held_apart and t.data_type == FLOAT16]
    return converted, names


def to_half(shape: tuple[int, ...], rows: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """A float32 weight of `shape` as onnxruntime's converter makes it float16 (clamped to float16's finite
    range, tiny values kept from becoming 0), read as `rows(start, stop)` along its first axis a slab at a
    time: the conversion is per value."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    out = np.empty(shape, dtype=np.float16)
    flat = out.reshape(shape[0] if shape else 1, -1)
    step = max(1, SLAB_VALUES // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], step):
        stop = min(flat.shape[0], start + step)
        flat[start:stop] = convert_np_to_float16(np.asarray(rows(start, stop))).reshape(stop - start, -1)
    return out


def _empty(tensor: onnx.TensorProto) -> bool:
    """A placeholder (writers/onnxfile.py): dims and type, no values."""
    return not tensor.raw_data and not tensor.float_data
