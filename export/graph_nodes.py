"""The fused graph builder's primitives (export/graph.py): a list of nodes and of initializers that every other
part of the builder appends to, each node named after its output. Initializers are placeholders: the arrays stay
in `weights` (a LazyArray is read only when written) for writers/onnxfile.py save_model to write one at a time. Small
values that shape inference needs (axes, Slice bounds) are Constant nodes instead, and com.microsoft outputs are
declared with their type, which ONNX shape inference cannot give them.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgelm.writers.onnxfile import placeholder

from .lazy_weights import LazyArray
from .linear import Linear, Norm

MS_DOMAIN = "com.microsoft"


class _Nodes:
    """Collects nodes and initializers; names every node after its output."""

    def __init__(self):
        self.weight_nodes: list[onnx.NodeProto] = []  # compact blocks' unpacking, first in the graph
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []  # placeholders: the data is in `weights`
        self.weights: dict[str, np.ndarray] = {}
        self.value_info: list[onnx.ValueInfoProto] = []

    def float_output(self, name: str, shape: list) -> str:
        """Declare a contrib op's output: ONNX shape inference cannot type com.microsoft nodes, and the
        quantizers need the type of every tensor a MatMul reads."""
        self.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def constant(self, name: str, array: np.ndarray) -> str:
        """An initializer; floating arrays but float16 ones are written as float32 (by save_model, no copy here)."""
        array = array if isinstance(array, LazyArray) else np.asarray(array)  # a LazyArray is read when written
        self.initializers.append(placeholder(name, array))
        self.weights[name] = array
        return name

    def small_constant(self, name: str, array: np.ndarray) -> str:
        """A Constant node, not an initializer: saving the weights as external data then never moves
        the values that shape inference needs (a ReduceSum's axes, a Slice's bounds)."""
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(array)))
        return name

    def op(self, op_type: str, inputs: list[str], output: str, *, domain: str = "", **attributes) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, domain=domain, **attributes))
        return output

    def weight_op(self, op_type: str, inputs: list[str], output: str, **attributes) -> str:
        """A node of constants only, which ONNX Runtime folds at load (export/compact_blocks.py)."""
        self.weight_nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attributes))
        return output


class GraphSteps(Protocol):
    """What a mechanism's graph step (export/mechanisms/) is given: the builder of export/graph.py, whose node
    helpers are _Nodes' and whose `linear` and `norm` write a Linear and a Norm (export/linear.py) as the graph
    writes every other (float weights or kept blocks, LoRA slots, the Decoder's kind of norm)."""

    nodes: list[onnx.NodeProto]
    kv_inputs: dict[str, list[str]] | None

    def float_output(self, name: str, shape: list) -> str: ...
    def constant(self, name: str, array: np.ndarray) -> str: ...
    def small_constant(self, name: str, array: np.ndarray) -> str: ...
    def op(self, op_type: str, inputs: list[str], output: str, *, domain: str = "", **attributes) -> str: ...
    def linear(self, x: str, prefix: str, layer: Linear) -> str: ...
    def nbits_weights(self, prefix: str, nbits: Any) -> tuple[str, str, str | None]: ...  # export/graph_blocks.py
    def norm(self, x: str, prefix: str, norm: Norm, decoder: Any) -> str: ...  # an export/decoder.py Decoder
