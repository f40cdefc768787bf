"""A source model's graph without its weights, the weights read one tensor at a time, and the new model's
weights computed one tensor at a time as they are written.

The recipes rewrite the graph (small: nodes and initializer names, types and shapes) and never hold the
model's weights as a whole. `SourceModel.array` maps one initializer's bytes from the source's
`model.onnx.data` (a memory map of that tensor's range only, released when the array goes); a new
initializer is a placeholder (writers/onnxfile.py) whose bytes a `Deferred` computes when
`onnxfile.save_model` writes it, so the memory a recipe needs is one weight and its quantized form, not
the model: the same code for a package of 20 MB or 20 GB, and none of ONNX's 2 GB protobuf limit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgelm.writers.onnxfile import placeholder, save_model

SLAB_BYTES = 64 << 20  # of a weight read at a time where a recipe can work slab by slab


class Deferred:
    """An array computed when it is written: numpy's array protocol (`np.asarray`) runs `compute`. shape and
    dtype are known beforehand, so the data file's layout is planned before any weight is computed."""

    def __init__(self, shape: tuple[int, ...], dtype, compute: Callable[[], np.ndarray]):
        self.shape, self.dtype, self.compute = tuple(shape), np.dtype(dtype), compute
        self.size = int(np.prod(self.shape, dtype=np.int64))

    def __array__(self, dtype=None, copy=None):
        array = np.asarray(self.compute())
        assert array.shape == self.shape and array.dtype == self.dtype, (
            f"computed {array.dtype}{array.shape}, planned {self.dtype}{self.shape}"
        )
        return array if dtype is None else array.astype(dtype, copy=False)


class Outputs:
    """Several initializers computed together (a weight's quantized values and its scales): the first one
    written runs `compute` once and keeps the others until they are written."""

    def __init__(self, compute: Callable[[], tuple[np.ndarray, ...]]):
        self.compute, self.results = compute, None

    def part(self, index: int, shape: tuple[int, ...], dtype) -> Deferred:
        return Deferred(shape, dtype, lambda: self._take(index))

    def _take(self, index: int) -> np.ndarray:
        if self.results is None:
            self.results = list(self.compute())
        array, self.results[index] = self.results[index], None  # each is written once; drop our reference
        return array


class SourceModel:
    """An ONNX model file's graph (loaded without external data) and its initializers' values on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.model = onnx.load(str(self.path), load_external_data=False)
        # copies: a recipe rewrites the model's own initializers (new types, data locations) as it goes
        self.initializers = {t.name: _copy(t) for t in self.model.graph.initializer}

    def array(self, name: str) -> np.ndarray:
        """Initializer `name`'s values: a read-only memory map of its bytes in the data file, or the inline
        data. The location was checked by read_package (runtime/onnx_external.py) before any recipe runs."""
        tensor = self.initializers[name]
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(tensor)
        info = {entry.key: entry.value for entry in tensor.external_data}
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        shape = tuple(tensor.dims)
        if not int(np.prod(shape, dtype=np.int64)):
            return np.zeros(shape, dtype)
        offset = int(info.get("offset", 0))
        return np.memmap(self.path.parent / info["location"], dtype=dtype, mode="r", offset=offset, shape=shape)

    def dims(self, name: str) -> tuple[int, ...]:
        return tuple(self.initializers[name].dims)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of initializer `name` along its first axis (a 1-D one: values), mapped alone: a
        map's pages count as the process's memory until it is dropped, so a large weight is read a slab at a
        time (`slabs`) rather than mapped whole."""
        tensor = self.initializers[name]
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            inline = numpy_helper.to_array(tensor)
            return inline if inline.ndim == 0 else inline[start:stop]
        shape = self.dims(name)
        row = int(np.prod(shape[1:], dtype=np.int64))
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        if stop <= start or not row:
            return np.zeros((max(0, stop - start), *shape[1:]), dtype)
        info = {entry.key: entry.value for entry in tensor.external_data}
        offset = int(info.get("offset", 0)) + start * row * np.dtype(dtype).itemsize
        path = self.path.parent / info["location"]
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(stop - start, *shape[1:]))

    def slabs(self, name: str, *, multiple: int = 1) -> Iterator[tuple[int, int]]:
        """(start, stop) row ranges of about SLAB_BYTES each (a multiple of `multiple` rows) covering `name`."""
        shape = self.dims(name) or (1,)
        row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64))) * 4
        step = max(multiple, SLAB_BYTES // row_bytes // multiple * multiple)
        for start in range(0, shape[0], step):
            yield start, min(start + step, shape[0])


def _copy(tensor: onnx.TensorProto) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)  # no weight bytes: they are in the data file
    return copy


def add_initializer(model: onnx.ModelProto, weights: dict, name: str, value: Deferred | np.ndarray) -> None:
    """Append a placeholder initializer for `value` (written by save_model) to the model."""
    model.graph.initializer.append(placeholder(name, value))
    weights[name] = value


def write(model: onnx.ModelProto, source: SourceModel, dst: Path, weights: dict) -> None:
    """Save `model` (a rewrite of source.model) to dst with `weights` (placeholders' values): every initializer
    that still points into the source's data file is copied from it, one tensor at a time."""
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            assert tensor.name not in weights, f"{tensor.name} is both a source weight and a new one"
            array = Deferred(tuple(tensor.dims), helper.tensor_dtype_to_np_dtype(tensor.data_type), None)
            array.compute = lambda name=tensor.name: np.asarray(source.array(name))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
            weights[tensor.name] = array
    save_model(model, dst, weights=weights)


@contextlib.contextmanager
def reading_from(source: SourceModel):
    """While open, `onnx.numpy_helper.to_array` (through which onnxruntime's quantizers and float16 converter
    read initializers) gives the source's external weights from `SourceModel.array`: the tools run on the graph
    alone, and each weight is mapped while a tool uses it, instead of loading the model's weights up front."""
    original = numpy_helper.to_array

    def to_array(tensor, base_dir=""):
        known = source.initializers.get(tensor.name)
        if (
            tensor.data_location == onnx.TensorProto.EXTERNAL
            and known is not None
            and known.data_type == tensor.data_type
        ):
            return np.asarray(source.array(tensor.name))
        return original(tensor, base_dir)

    numpy_helper.to_array = to_array
    try:
        yield
    finally:
        numpy_helper.to_array = original
