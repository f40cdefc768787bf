"""Saving an ONNX model, for export and quantize alike: the graph in `model.onnx`, every initializer of at
least `INLINE_LIMIT` bytes in one side file beside it, `model.onnx.data` (ONNX's external data), small ones
(shape constants) inline.

ONNX Runtime memory-maps external data instead of parsing it out of the protobuf and copying it, so a
session builds faster and with a lower peak of memory. Its rule (onnxruntime/core/framework/tensorprotoutils.cc
`GetFileContent`: map the tensor's byte range, read it into a buffer if mapping fails): on POSIX
`Env::MapFileIntoMemory` rounds the offset down to a page itself, so any offset maps; on Windows releases
before 1.23 mapped only offsets at a multiple of the allocation granularity, 64 KiB, and copied the others
(microsoft/onnxruntime#25833, onnx/onnx#6247). Aligning every large tensor to 64 KiB pads a package by
up to 64 KiB a tensor (docs/results.md has what that cost), so each tensor of at least `ALIGNMENT` bytes
starts on a page of its own (4 KiB): its pages are never shared with a neighbour's, and it is padded by less
than a page. Smaller ones fill the gaps this leaves where they fit (`_layout`); the rest of each gap is zeros.

Export hands its weights over as numpy arrays beside a model whose initializers are placeholders (name,
type and dims, no data), and `save_model` writes each array's bytes straight into the data file, one
tensor at a time; a whole model (quantize) has its tensors' bytes moved out one at a time. So no second
full copy of the weights is ever held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from edgelm.writers.version import __version__

INLINE_LIMIT = 1024  # bytes: initializers smaller than this stay inside model.onnx
ALIGNMENT = 1 << 12  # offset of every tensor of at least this many bytes: a page
SMALL_ALIGNMENT = 64  # offset of the smaller ones (a cache line)
PROTOBUF_LIMIT = 1_800_000_000  # bytes: past this a whole model cannot be serialized as one protobuf (2 GB)


@dataclass(frozen=True)
class SameBytes:
    """A weight of `save_model` whose initializer points at another one's bytes in the data file (`of`, of the
    same type and shape) instead of a copy: ONNX Runtime maps the two apart, so a node reading a few rows of one
    (a tied embedding's gather) does not keep resident the pages another node's prepacking read of the other."""

    of: str


def placeholder(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An initializer without its data: what `save_model(..., weights={name: array})` fills in."""
    dtype = _stored_dtype(array)
    return onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=array.shape)


def data_file(model_path: str | Path) -> Path:
    """Where `save_model` puts the weights of the model at model_path."""
    model_path = Path(model_path)
    return model_path.parent / (model_path.name + ".data")


def save_model(
    model: onnx.ModelProto,
    path: str | Path,
    *,
    weights: dict[str, np.ndarray] | None = None,
    on_write: Callable[[int], None] | None = None,
) -> str | None:
    """Write `model` to `path` and its initializers of at least INLINE_LIMIT bytes to `<path>.data`; returns
    that file's name, or None when no initializer is that large (then no data file is left behind).
    weights: initializer name -> array for the placeholder initializers (see `placeholder`), or SameBytes;
    floating arrays but float16 ones are written as float32, C order, converted one at a time; each is removed
    from `weights` once written, so the caller's other references decide when its memory goes. The model's
    initializers are changed in place to point into the data file. on_write: called with each tensor's bytes
    once it is written (progress)."""
    path = Path(path)
    model.producer_name = "edgelm"
    model.producer_version = __version__
    weights = weights if weights is not None else {}
    shared = {name: weights.pop(name).of for name in [n for n, w in weights.items() if isinstance(w, SameBytes)]}
    for tensor in model.graph.initializer:  # small placeholders (shape constants) are filled in inline
        if tensor.name in weights and _nbytes(weights[tensor.name]) < INLINE_LIMIT:
            tensor.raw_data = _take_data(tensor, weights).tobytes()
    moved = [(t, _size(t, weights)) for t in model.graph.initializer]
    moved = [(t, size) for t, size in moved if size is not None]
    unplaced = set(weights) - {t.name for t in model.graph.initializer}
    assert not unplaced, f"no placeholder initializer for {sorted(unplaced)[:5]}"
    target = data_file(path)
    location = target.name if moved else None
    if moved:
        offsets = _layout([size for _, size in moved])
        with open(target, "wb") as f:
            for (tensor, size), offset in zip(moved, offsets, strict=True):
                f.seek(offset)  # a gap left behind reads as zeros
                _write(f, tensor, weights, size)
                if on_write is not None:
                    on_write(size)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                del tensor.external_data[:]
                for key, value in (("location", location), ("offset", offset), ("length", size)):
                    tensor.external_data.add(key=key, value=str(value))
    elif target.exists():
        target.unlink()  # an old one from an earlier save
    by_name = {tensor.name: tensor for tensor in model.graph.initializer}
    for name, of in shared.items():
        tensor, source = by_name[name], by_name[of]
        assert source.data_location == onnx.TensorProto.EXTERNAL, f"{name}: {of} is not in the data file"
        assert (tensor.data_type, tensor.dims) == (source.data_type, source.dims), f"{name} is not shaped as {of}"
        tensor.data_location = onnx.TensorProto.EXTERNAL
        tensor.external_data.extend(source.external_data)
    onnx.save_model(model, str(path))
    return location


def stored_bytes(weights: dict[str, np.ndarray]) -> int:
    """Bytes `save_model(..., weights=weights)` writes for them (before alignment)."""
    return sum(_nbytes(array) for array in weights.values() if not isinstance(array, SameBytes))


def _size(tensor: onnx.TensorProto, weights: dict[str, np.ndarray]) -> int | None:
    """Bytes `tensor` will take in the data file, or None when it stays inline."""
    if tensor.name in weights:
        return _nbytes(weights[tensor.name])
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise ValueError(f"initializer {tensor.name} still points at external data: load the model with its data")
    if not tensor.HasField("raw_data"):  # typed fields (float_data, ...): small constants in our graphs
        return None
    size = len(tensor.raw_data)
    return size if size >= INLINE_LIMIT else None


def _write(f, tensor: onnx.TensorProto, weights: dict[str, np.ndarray], size: int) -> None:
    """Write `tensor`'s bytes at f's position: a placeholder whose array has `chunks` (export/lazy_weights.py
    LazyArray) one slice along its first axis at a time, so no more than a slice of it is ever held."""
    chunks = getattr(weights.get(tensor.name), "chunks", None)
    if chunks is None:
        f.write(_take_data(tensor, weights))
        return
    array = weights.pop(tensor.name)
    assert not tensor.raw_data and tuple(tensor.dims) == array.shape, f"{tensor.name} is not its placeholder"
    written = 0
    for chunk in chunks():
        assert chunk.shape[1:] == array.shape[1:], f"{tensor.name}: a slice of shape {chunk.shape}, not {array.shape}"
        data = np.ascontiguousarray(chunk, dtype=_stored_dtype(array)).reshape(-1).view(np.uint8)
        f.write(data)
        written += data.size
    assert written == size, f"{tensor.name}: its slices hold {written} bytes, not {size}"


def _take_data(tensor: onnx.TensorProto, weights: dict[str, np.ndarray]) -> np.ndarray | bytes:
    """The bytes of `tensor`, cleared from it: a placeholder's from `weights` (popped), another's raw_data."""
    if tensor.name in weights:
        array = weights.pop(tensor.name)
        assert not tensor.raw_data and tuple(tensor.dims) == array.shape, f"{tensor.name} is not its placeholder"
        return _contiguous(array).reshape(-1).view(np.uint8)
    raw = tensor.raw_data
    tensor.ClearField("raw_data")  # the proto's copy goes; `raw` is the one copy of this tensor now
    return raw


def _layout(sizes: list[int]) -> list[int]:
    """Each tensor's offset: tensors of at least ALIGNMENT bytes at multiples of it, in order; the smaller ones
    fill the gaps this leaves before them (first fit, at SMALL_ALIGNMENT), and the rest go after the last."""
    offsets: list[int] = [0] * len(sizes)
    small = [i for i, size in enumerate(sizes) if size < ALIGNMENT]
    end = 0
    for i, size in enumerate(sizes):
        if size < ALIGNMENT:
            continue
        start = _round_up(end, ALIGNMENT)
        for j in list(small):
            if _round_up(end, SMALL_ALIGNMENT) + sizes[j] <= start:
                offsets[j] = _round_up(end, SMALL_ALIGNMENT)
                end = offsets[j] + sizes[j]
                small.remove(j)
        offsets[i], end = start, start + size
    for j in small:
        offsets[j] = _round_up(end, SMALL_ALIGNMENT)
        end = offsets[j] + sizes[j]
    return offsets


def _round_up(offset: int, step: int) -> int:
    return -(-offset // step) * step


def _stored_dtype(array: np.ndarray) -> np.dtype:
    """float32 for floating arrays (export computes some in float64) but float16 ones, which are meant so."""
    return np.dtype(np.float32) if array.dtype.kind == "f" and array.dtype != np.float16 else array.dtype


def _nbytes(array: np.ndarray) -> int:
    return array.size * _stored_dtype(array).itemsize


def _contiguous(array: np.ndarray) -> np.ndarray:
    """The bytes to write: as `_stored_dtype` says, C order; no copy when it already is."""
    return np.ascontiguousarray(array, dtype=_stored_dtype(array))
