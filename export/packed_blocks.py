"""The fallback graph of a package whose kept GGUF blocks are the file's own rows (runtime/packed.py).

model.onnx runs the rows through edgelm's ai.edgelm ops. Beside it export writes the same decoder as the plain graph
(MatMulNBits and the gathers of today's packages, export/graph_blocks.py) whose block arrays are not written: each
is an initializer at runtime/packed.py's CONVERTED location, and model.fallback.json says which raw tensors of
model.onnx it is computed from, so the runtime converts them at load where the native library cannot run. Every other
initializer of the fallback graph points at model.onnx's own bytes (the same name, the same external data), or is
small and inline, so the fallback costs the package a graph and a JSON file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgelm.writers.onnxfile import INLINE_LIMIT, SameBytes
from edgelm.writers.package_writer import write_json

from ..runtime.contract import IONames
from ..runtime.onnx_external import external_data
from ..runtime.packed import CONVERTED, FALLBACK_MODEL, FALLBACK_PLAN, PLAN_FORMAT
from .decoder import Decoder
from .graph import build_fused_graph


class Fallback:
    """The fallback graph, built while the Decoder is at hand (before model.onnx is written) and saved after."""

    def __init__(self, decoder: Decoder, io: IONames, *, opset: int, accuracy_level: int):
        self.plan: dict[str, dict] = {}
        self.model, weights = build_fused_graph(
            decoder, io, opset=opset, accuracy_level=accuracy_level, compact=False, fallback_plan=self.plan
        )
        # only what is inline (under INLINE_LIMIT) or names another tensor: the rest is model.onnx's bytes
        self.weights = {n: w for n, w in weights.items() if isinstance(w, SameBytes) or _nbytes(w) < INLINE_LIMIT}

    def save(self, model_path: Path) -> None:
        """Write FALLBACK_MODEL and FALLBACK_PLAN beside model_path (model.onnx, already written)."""
        written = {entry.tensor: entry for entry in external_data(model_path)}
        for tensor in self.model.graph.initializer:
            name, weight = tensor.name, self.weights.get(tensor.name)
            if isinstance(weight, SameBytes) and weight.of in self.plan:
                self.plan[name] = {"same_as": weight.of}
            if name in self.plan:
                _point(tensor, CONVERTED, 0, _size(tensor))
            elif tensor.raw_data or tensor.float_data or tensor.int64_data or tensor.int32_data:
                continue  # written with its values (a gather's constants)
            elif name in written:
                entry = written[name]
                _point(tensor, entry.location, int(entry.offset or 0), entry.length)
            elif weight is not None and not isinstance(weight, SameBytes):
                dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
                tensor.raw_data = np.ascontiguousarray(np.asarray(weight, dtype=dtype)).tobytes()
            else:
                raise AssertionError(f"fallback initializer {name} is neither model.onnx's nor computed at load")
        onnx.save(self.model, model_path.parent / FALLBACK_MODEL)
        write_json(model_path.parent / FALLBACK_PLAN, {"format": PLAN_FORMAT, "arrays": self.plan})


def _nbytes(weight) -> int:
    if isinstance(weight, SameBytes):
        return 0
    return int(np.prod(weight.shape, dtype=np.int64)) * np.dtype(weight.dtype).itemsize


def _size(tensor: TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _point(tensor: TensorProto, location: str, offset: int, length) -> None:
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (
        ("location", location),
        ("offset", str(offset)),
        ("length", None if length is None else str(length)),
    ):
        if value is not None:
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
