"""Saving an ONNX model, for export and quantize alike: weights go to a side file past protobuf's
2 GB limit (ONNX's external data), and the model file alone below it.

Export hands its weights over as numpy arrays beside a model whose initializers are placeholders (name,
type and dims, no data), and `save_model` writes each array's bytes straight into the file, one tensor at a
time, so no second full copy of the weights (a TensorProto per array, then the serialized model) is ever
held. This works because protobuf fields may come in any order and repeated fields may be split: a
GraphProto is its nodes and inputs followed by `initializer` entries appended one by one, and a
ModelProto is its other fields followed by the `graph` entry (https://protobuf.dev/programming-guides/encoding/).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from edgelm import __version__

EXTERNAL_DATA_LIMIT = 1_800_000_000  # bytes of serialized model above which weights go to <model>.data
_GRAPH_FIELD, _INITIALIZER_FIELD, _RAW_DATA_FIELD = 7, 5, 9  # ModelProto.graph, GraphProto.initializer, raw_data


def placeholder(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An initializer without its data: what `save_model(..., weights={name: array})` fills in."""
    dtype = np.float32 if array.dtype.kind == "f" else array.dtype
    return onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=array.shape)


def save_model(model: onnx.ModelProto, path: str | Path, *, weights: dict[str, np.ndarray] | None = None) -> str | None:
    """Write `model` to `path`; returns the external-data file's name, or None when there is none.
    weights: initializer name -> array for the placeholder initializers (see `placeholder`); floating arrays
    are written as float32, C order, converted one at a time; each is removed from `weights` once written,
    so the caller's other references decide when its memory goes."""
    path = Path(path)
    model.producer_name = "edgelm"
    model.producer_version = __version__
    if not weights:
        return _save_whole(model, path)
    data_bytes = sum(_nbytes(a) for a in weights.values())
    if model.ByteSize() + data_bytes <= EXTERNAL_DATA_LIMIT:
        _stream(model, path, weights)
        return None
    return _stream_external(model, path, weights)


def _save_whole(model: onnx.ModelProto, path: Path) -> str | None:
    if model.ByteSize() <= EXTERNAL_DATA_LIMIT:
        onnx.save_model(model, str(path))
        return None
    location = path.name + ".data"
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=1024,
    )
    return location


def _nbytes(array: np.ndarray) -> int:
    return array.size * (4 if array.dtype.kind == "f" else array.dtype.itemsize)


def _contiguous(array: np.ndarray) -> np.ndarray:
    """The bytes to write: float32 for floating arrays, C order; no copy when it already is."""
    return np.ascontiguousarray(array, dtype=np.float32 if array.dtype.kind == "f" else array.dtype)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _key(field: int) -> bytes:
    return _varint(field << 3 | 2)  # wire type 2: length-delimited


def _split(model: onnx.ModelProto) -> tuple[bytes, bytes, list[onnx.TensorProto]]:
    """(the model without its graph, the graph without its initializers, the initializers): all small while
    the weights are placeholders."""
    shell = onnx.ModelProto()
    shell.CopyFrom(model)
    shell.ClearField("graph")
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    initializers = list(graph.initializer)
    graph.ClearField("initializer")
    return shell.SerializeToString(), graph.SerializeToString(), initializers


def _stream(model: onnx.ModelProto, path: Path, weights: dict[str, np.ndarray]) -> None:
    """One file: each placeholder's serialized header followed by its raw_data field, written from the array."""
    shell, graph, initializers = _split(model)
    entries = []  # (name, header bytes, data bytes)
    for tensor in initializers:
        header, data_size = tensor.SerializeToString(), 0
        if tensor.name in weights:
            array = weights[tensor.name]
            assert not tensor.raw_data and tuple(tensor.dims) == array.shape, f"{tensor.name} is not its placeholder"
            data_size = _nbytes(array)
            header += _key(_RAW_DATA_FIELD) + _varint(data_size)
        entries.append((tensor.name, header, data_size))
    sizes = [len(header) + data_size for _, header, data_size in entries]
    graph_size = len(graph) + sum(len(_key(_INITIALIZER_FIELD)) + len(_varint(s)) + s for s in sizes)
    with open(path, "wb") as f:
        f.write(shell + _key(_GRAPH_FIELD) + _varint(graph_size) + graph)
        for (name, header, data_size), size in zip(entries, sizes, strict=True):
            f.write(_key(_INITIALIZER_FIELD) + _varint(size) + header)
            if data_size:
                f.write(_contiguous(weights.pop(name)).reshape(-1).view(np.uint8))  # dropped once written


def _stream_external(model: onnx.ModelProto, path: Path, weights: dict[str, np.ndarray]) -> str:
    """Past the limit: the arrays go to <model>.data one by one, and the placeholders point at them."""
    location, offset = path.name + ".data", 0
    placeholders = {t.name: t for t in model.graph.initializer if t.name in weights}
    with open(path.parent / location, "wb") as f:
        for name, tensor in placeholders.items():
            data = _contiguous(weights.pop(name)).reshape(-1).view(np.uint8)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", location), ("offset", offset), ("length", data.nbytes)):
                tensor.external_data.add(key=key, value=str(value))
            f.write(data)
            offset += data.nbytes
    onnx.save_model(model, str(path))
    return location
