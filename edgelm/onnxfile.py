"""Saving an ONNX model, for export and quantize alike: the graph in `model.onnx`, every initializer of at
least `INLINE_LIMIT` bytes in one side file beside it, `model.onnx.data` (ONNX's external data), small ones
(shape constants) inline.

ONNX Runtime memory-maps external data instead of parsing it out of the protobuf and copying it, so a
session builds faster and with a lower peak of memory. Its rule (onnxruntime/core/framework/tensorprotoutils.cc
`GetFileContent`: map the tensor's byte range, read it into a buffer if mapping fails): on POSIX
`Env::MapFileIntoMemory` rounds the offset down to a page itself, so any offset maps; on Windows
`MapViewOfFile` needs the offset to be a multiple of the allocation granularity, 64 KiB, and releases before
1.23 refused other offsets there and fell back to the copy (microsoft/onnxruntime#25833, onnx/onnx#6247). So
each tensor of at least `ALIGNMENT` bytes starts at a multiple of 64 KiB (a multiple of the page size
everywhere); smaller ones, whose copy costs little, are packed at `SMALL_ALIGNMENT` to keep the padding
small. ONNX Runtime's own writer (ModelSavingOptions.align_offset) pads the same way, above a threshold.

Export hands its weights over as numpy arrays beside a model whose initializers are placeholders (name,
type and dims, no data), and `save_model` writes each array's bytes straight into the data file, one
tensor at a time; a whole model (quantize) has its tensors' bytes moved out one at a time. So no second
full copy of the weights is ever held.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from edgelm import __version__

INLINE_LIMIT = 1024  # bytes: initializers smaller than this stay inside model.onnx
ALIGNMENT = 1 << 16  # offset of every tensor of at least this many bytes: Windows' allocation granularity
SMALL_ALIGNMENT = 64  # offset of the smaller ones (a cache line)
PROTOBUF_LIMIT = 1_800_000_000  # bytes: past this a whole model cannot be serialized as one protobuf (2 GB)


def placeholder(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An initializer without its data: what `save_model(..., weights={name: array})` fills in."""
    dtype = np.float32 if array.dtype.kind == "f" else array.dtype
    return onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=array.shape)


def data_file(model_path: str | Path) -> Path:
    """Where `save_model` puts the weights of the model at model_path."""
    model_path = Path(model_path)
    return model_path.parent / (model_path.name + ".data")


def save_model(model: onnx.ModelProto, path: str | Path, *, weights: dict[str, np.ndarray] | None = None) -> str | None:
    """Write `model` to `path` and its initializers of at least INLINE_LIMIT bytes to `<path>.data`; returns
    that file's name, or None when no initializer is that large (then no data file is left behind).
    weights: initializer name -> array for the placeholder initializers (see `placeholder`); floating arrays
    are written as float32, C order, converted one at a time; each is removed from `weights` once written,
    so the caller's other references decide when its memory goes. The model's initializers are changed in
    place to point into the data file."""
    path = Path(path)
    model.producer_name = "edgelm"
    model.producer_version = __version__
    weights = weights if weights is not None else {}
    target = data_file(path)
    location, offset = target.name, 0
    with open(target, "wb") as f:
        for tensor in model.graph.initializer:
            data = _take_data(tensor, weights)
            if data is None:
                continue
            start = _aligned(offset, data.nbytes)
            f.write(bytes(start - offset))  # zero padding up to the aligned offset
            f.write(data)
            offset = start + data.nbytes
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", location), ("offset", start), ("length", data.nbytes)):
                tensor.external_data.add(key=key, value=str(value))
    assert not weights, f"no placeholder initializer for {sorted(weights)[:5]}"
    if offset == 0:
        target.unlink()
        location = None
    onnx.save_model(model, str(path))
    return location


def _take_data(tensor: onnx.TensorProto, weights: dict[str, np.ndarray]) -> np.ndarray | None:
    """The bytes of `tensor` to move into the data file (uint8, flat), cleared from the tensor; None to keep
    it inline. A placeholder's bytes come from `weights` (popped); another tensor's from its raw_data."""
    if tensor.name in weights:
        array = weights.pop(tensor.name)
        assert not tensor.raw_data and tuple(tensor.dims) == array.shape, f"{tensor.name} is not its placeholder"
        return _contiguous(array).reshape(-1).view(np.uint8)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise ValueError(f"initializer {tensor.name} still points at external data: load the model with its data")
    if not tensor.HasField("raw_data"):  # typed fields (float_data, ...): small constants in our graphs
        return None
    raw = tensor.raw_data
    if len(raw) < INLINE_LIMIT:
        return None
    tensor.ClearField("raw_data")  # the proto's copy goes; `raw` is the one copy of this tensor now
    return np.frombuffer(raw, dtype=np.uint8)


def _aligned(offset: int, size: int) -> int:
    step = ALIGNMENT if size >= ALIGNMENT else SMALL_ALIGNMENT
    return -(-offset // step) * step


def _contiguous(array: np.ndarray) -> np.ndarray:
    """The bytes to write: float32 for floating arrays, C order; no copy when it already is."""
    return np.ascontiguousarray(array, dtype=np.float32 if array.dtype.kind == "f" else array.dtype)
