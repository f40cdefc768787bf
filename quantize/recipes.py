"""Quantization recipes, one function each from an fp32 ONNX model file to a quantized one, built on
onnxruntime.quantization, and the table quantize_package chooses from (gpt-fast keeps one handler per
mode the same way). Why each recipe is as it is, with the measurements: docs/results.md.

- dynamic: int8 weights of every linear layer (MatMul with a constant weight) and of the tied embedding,
  per channel, 7-bit range (reduce_range: without VNNI, onnxruntime's u8 x s8 kernels add pairs of
  products in int16, which saturates with full 8-bit weights); activations quantized at run time.
- static: QDQ, int8 weights per channel, uint8 activations calibrated on text run the way the model
  runs (prompt passes and decode steps with their caches), the blocks' linear layers only; the LM head,
  whose input suffers most from one calibrated range, gets the dynamic recipe.
- int4: MatMulNBits, block-wise symmetric 4-bit weights (round to nearest) for the blocks; the LM head
  and the tied embedding 8-bit blocks; activations quantized to int8 per block at run time.
- int8-weight-only: the int4 recipe with 8-bit blocks everywhere (MatMulNBits bits=8). Its kernel
  quantizes activations per row and block, so, unlike dynamic int8 (one activation scale over the whole
  batch), a row's output does not depend on the other rows of a batch.
- fp16: every float tensor in half precision, for GPU providers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from edgelm.writers.float16 import FP16_FACTS, half_graph, to_half
from edgelm.writers.nbits_gather import gather_from_nbits
from edgelm.writers.onnxfile import placeholder

from .calibration import calibrated_ranges
from .modes import MODES
from .tied_embedding import drop_unused_initializers, share_int8_embedding, tied_gathers
from .weight_only import ACCURACY_LEVEL, WeightOnly, quantize_blocks
from .weights import Deferred, Outputs, SourceModel, add_initializer, reading_from, write

# onnxruntime.quantization logs every node at INFO and advises pre-processing on the root logger
logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
# the sessions the quantizers open would warn that num_logits_to_keep, an input with a default, is
# not constant-folded: true by design, and noise to a user
ort.set_default_logger_severity(3)

UNTIED_TABLE = "embed.weight"  # export's name for an untied token embedding's (V, C) table (export/graph.py)


class _QuietRootLogger:
    """onnxruntime.quantization warns on the root logger that the model was not pre-processed; our
    graphs are shape-inferred by the exporter, and pre-processing's optimizations would fuse away the
    MatMuls we quantize. Silence that one call's root warnings."""

    def __enter__(self):
        self.level = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)

    def __exit__(self, *exc):
        logging.getLogger().setLevel(self.level)


def _linear_matmuls(model: onnx.ModelProto) -> list[str]:
    """Names of MatMul nodes whose weight (input B) is an initializer: the model's linear layers. A weight that
    is also a graph input (a LoRA slot's A or B, runtime/lora_contract.py) is a run's to bind: it stays fp32."""
    initializers = {init.name for init in model.graph.initializer} - {i.name for i in model.graph.input}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in initializers]


def _with_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with ONNX's inferred types and shapes (value_info, which onnxruntime's quantizers read), as
    their own loaders would add them. Inference runs on a skeleton whose initializers carry type and dims only
    (marked external): a model holding new weights in memory may be past protobuf's 2 GB limit."""
    from onnxruntime.quantization.quant_utils import add_infer_metadata

    graph = model.graph
    skeleton = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions)
    skeleton.graph.CopyFrom(
        onnx.GraphProto(
            name=graph.name, node=graph.node, input=graph.input, output=graph.output, value_info=graph.value_info
        )
    )
    for tensor in graph.initializer:
        stub = skeleton.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        stub.data_location = onnx.TensorProto.EXTERNAL
        stub.external_data.add(key="location", value="stub")
    inferred = onnx.shape_inference.infer_shapes(skeleton)
    del graph.value_info[:]
    graph.value_info.extend(inferred.graph.value_info)
    add_infer_metadata(model)
    return model


@contextlib.contextmanager
def _on_the_graph(source: SourceModel):
    """onnxruntime's quantizers working on the graph alone: weights read from the source one at a time
    (weights.reading_from), and their shape inference (which would save the model and load it back, weights
    and all) run in memory on the skeleton (_with_shapes)."""
    from unittest import mock

    from onnxruntime.quantization import base_quantizer, onnx_quantizer

    with (
        _QuietRootLogger(),
        reading_from(source),
        mock.patch.object(onnx_quantizer, "save_and_reload_model_with_shape_infer", _with_shapes),
        mock.patch.object(base_quantizer, "save_and_reload_model_with_shape_infer", _with_shapes),
    ):
        yield


def _dynamic_int8(
    model: onnx.ModelProto, source: SourceModel, *, nodes: list[str], per_channel: bool
) -> onnx.ModelProto:
    """int8 weights, activations quantized at run time, for the named MatMuls (the dynamic recipe; static int8
    uses it for the LM head): onnxruntime's quantize_dynamic, run on the graph with the weights read from the
    source one at a time (weights.reading_from). Returns the quantized model, new weights in memory."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode, update_opset_version

    with _on_the_graph(source):
        model = update_opset_version(_with_shapes(model), QuantType.QInt8)
        quantizer = ONNXQuantizer(
            model,
            per_channel,
            True,  # reduce_range, 7-bit weights: see the module docstring
            QuantizationMode.IntegerOps,
            False,  # static
            QuantType.QInt8,
            QuantType.QUInt8,  # activations, quantized at run time
            None,
            nodes,
            [],
            ["MatMul"],
            # ONNX's shape inference cannot type contrib ops' outputs (Llama's SimplifiedLayerNormalization)
            {"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )
        quantizer.quantize_model()
    quantizer.model.topological_sort()  # as its save_model_to_file does
    return quantizer.model.model


def quantize_dynamic_int8(src: Path, dst: Path, *, per_channel: bool = True) -> dict:
    source = SourceModel(src)
    tied = {g.input[0] for g in tied_gathers(source.model)}
    quantized = _dynamic_int8(source.model, source, nodes=_linear_matmuls(source.model), per_channel=per_channel)
    _share_tied_int8(quantized, tied)
    write(quantized, source, dst, {})
    return {
        "mode": "dynamic",
        "weights": "int8 symmetric, 7-bit range (reduce_range)",
        "per_channel": per_channel,
        "activations": "uint8, quantized at run time",
        "ops": "linear MatMuls + tied embedding",
    }


def _lm_head(model: onnx.ModelProto) -> str | None:
    """The MatMul that produces the logits (a graph output), itself or through the scaling and soft-capping after
    it (Granite's Div, Gemma 4's Div, Tanh and Mul: each reads the product as its first input)."""
    producers = {output: node for node in model.graph.node for output in node.output}
    for output in model.graph.output:
        node = producers.get(output.name)
        while node is not None and node.op_type in ("Div", "Tanh", "Mul"):
            node = producers.get(node.input[0])
        if node is not None and node.op_type == "MatMul":
            return node.name
    return None


def _share_tied_int8(quantized: onnx.ModelProto, tied: set[str]) -> None:
    """Point the tied embedding's Gather at the LM head's int8 weights, dropping its fp32 copy."""
    share_int8_embedding(quantized, {t: (f"{t}_quantized", f"{t}_scale", f"{t}_zero_point") for t in tied})


_STATIC_OPTIONS = {
    "MatMulConstBOnly": True,
    "DefaultTensorType": onnx.TensorProto.FLOAT,  # as in _dynamic_int8
    "WeightSymmetric": True,
    "ActivationSymmetric": False,
    # a linear layer's output goes on in float (bias, GELU, attention, residual): quantizing
    # it would only add a Q/DQ round trip, costing accuracy and a requantizing kernel
    "OpTypesToExcludeOutputQuantization": ["MatMul"],
}


def _static_qdq(
    model: onnx.ModelProto, source: SourceModel, *, ranges, nodes: list[str], per_channel: bool
) -> onnx.ModelProto:
    """Static QDQ for the named MatMuls: int8 weights, uint8 activations with the calibrated ranges
    (quantize/calibration.py): onnxruntime's quantize_static after its calibration step, run on the graph
    with the weights read from the source one at a time. Returns the quantized model, new weights in memory."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import update_opset_version

    with _on_the_graph(source):
        model = update_opset_version(_with_shapes(model), QuantType.QInt8, QuantType.QUInt8)
        quantizer = QDQQuantizer(
            model,
            per_channel,
            False,  # reduce_range
            QuantType.QInt8,
            QuantType.QUInt8,
            ranges,
            nodes,
            [],
            ["MatMul"],
            _STATIC_OPTIONS,
        )
        quantizer.quantize_model()
    quantizer.model.topological_sort()  # as its save_model_to_file does
    return quantizer.model.model


def quantize_static_int8(src: Path, dst: Path, *, reader, method: str = "percentile", per_channel: bool = True) -> dict:
    source = SourceModel(src)
    tied = {g.input[0] for g in tied_gathers(source.model)}
    # The LM head's input is where one 8-bit range for all tokens costs most (docs/results.md,
    # "Quantization accuracy"), so the head gets int8 weights with its activations quantized at run
    # time, per call (the dynamic recipe), and the blocks' linear layers are static QDQ.
    head = _lm_head(source.model)
    blocks = [n for n in _linear_matmuls(source.model) if n != head]
    ranges = calibrated_ranges(source, reader, nodes=blocks, method=method)
    quantized = _static_qdq(source.model, source, ranges=ranges, nodes=blocks, per_channel=per_channel)
    if head is not None:
        quantized = _dynamic_int8(quantized, source, nodes=[head], per_channel=per_channel)
    _share_tied_int8(quantized, tied)
    write(quantized, source, dst, {})
    return {
        "mode": "static",
        "format": "QDQ",
        "weights": "int8 symmetric",
        "per_channel": per_channel,
        "activations": "uint8 asymmetric, calibrated",
        "calibration_method": method,
        "calibration_samples": reader.samples,
        "calibration_feeds": len(reader),
        "ops": "linear MatMuls of the blocks (static QDQ); LM head + tied embedding int8 with activations "
        "quantized at run time; attention, LayerNorm, GELU, softmax stay float",
    }


def _check_block_size(model: onnx.ModelProto, block_size: int) -> None:
    """ValueError unless `block_size` divides the embedding's width (a power of two >= 16 is WeightOnly.of's)."""
    inits = {i.name: i for i in model.graph.initializer}
    untied = _untied_embedding(model)
    for gather in tied_gathers(model) + ([untied] if untied is not None else []):
        n_embd = inits[gather.input[0]].dims[0 if gather is not untied else 1]
        if n_embd % block_size:
            raise ValueError(f"block size {block_size} does not divide the embedding width {n_embd}; use a smaller one")


def _blocks(source: SourceModel, name: str, *, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A (K, N) weight as MatMulNBits' blocks (quantize/weight_only.py): packed values (N, blocks, blob) and scales
    (N, blocks). Blocks run along K and are quantized each on its own, so the weight is read a slab of rows at a
    time."""
    rows, cols = source.dims(name)
    packed = np.zeros((cols, -(-rows // block_size), block_size * bits // 8), dtype=np.uint8)
    scales = np.zeros((cols, -(-rows // block_size)), dtype=np.float32)
    for start, stop in source.slabs(name, multiple=block_size):
        slab_packed, slab_scales = quantize_blocks(source.rows(name, start, stop), bits=bits, block_size=block_size)
        first = start // block_size
        packed[:, first : first + slab_packed.shape[1]] = slab_packed
        scales[:, first : first + slab_scales.shape[1]] = slab_scales
    return packed, scales


def _nbits_node(node, source: SourceModel, model: onnx.ModelProto, weights: dict, *, bits: int, block_size: int):
    """The MatMulNBits node (names as onnxruntime's MatMulNBitsQuantizer gives them) replacing a MatMul,
    its packed weights and scales added to the model as placeholders computed when written."""
    name = node.input[1]
    rows, cols = source.dims(name)
    k_blocks = -(-rows // block_size)
    outputs = Outputs(lambda: _blocks(source, name, bits=bits, block_size=block_size))
    add_initializer(
        model, weights, f"{name}_Q{bits}", outputs.part(0, (cols, k_blocks, block_size * bits // 8), np.uint8)
    )
    add_initializer(model, weights, f"{name}_scales", outputs.part(1, (cols, k_blocks), np.float32))
    return helper.make_node(
        "MatMulNBits",
        [node.input[0], f"{name}_Q{bits}", f"{name}_scales"],
        list(node.output),
        name=f"{node.name}_Q{bits}" if node.name else "",
        domain="com.microsoft",
        K=rows,
        N=cols,
        bits=bits,
        block_size=block_size,
        accuracy_level=ACCURACY_LEVEL,
    )


def _untied_embedding(model: onnx.ModelProto) -> onnx.NodeProto | None:
    """The Gather (axis 0) of rows of an untied embedding's float (V, C) table, which export names UNTIED_TABLE."""
    floats = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2}
    rows = lambda n: all(a.i == 0 for a in n.attribute if a.name == "axis")  # noqa: E731
    gathers = (n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == UNTIED_TABLE)
    return next((n for n in gathers if n.input[0] in floats and rows(n)), None)


def _row_blocks(source: SourceModel, name: str, *, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A (V, C) table as V rows of blocks along C, as MatMulNBits holds a (C, V) weight: packed (V, blocks, blob) and
    scales (V, blocks), by quantize/weight_only.py; read a slab of rows at a time."""
    vocab, width = source.dims(name)
    packed = np.zeros((vocab, width // block_size, block_size * bits // 8), dtype=np.uint8)
    scales = np.zeros((vocab, width // block_size), dtype=np.float32)
    for start, stop in source.slabs(name):
        rows = np.asarray(source.rows(name, start, stop), dtype=np.float32).T  # (C, rows)
        packed[start:stop], scales[start:stop] = quantize_blocks(rows, bits=bits, block_size=block_size)
    return packed, scales


def _embedding_blocks(
    gather: onnx.NodeProto, source: SourceModel, model: onnx.ModelProto, weights: dict, *, bits: int, block_size: int
) -> tuple[str, str]:
    """An untied table's blocks (names as export gives them), added to the model before the table (export's order)
    as placeholders computed when written; returns (packed, scales)."""
    name = gather.input[0]
    vocab, width = source.dims(name)
    blocks = width // block_size
    outputs = Outputs(lambda: _row_blocks(source, name, bits=bits, block_size=block_size))
    packed, scales = f"{name}_Q{bits}", f"{name}_scales"
    weights[packed] = outputs.part(0, (vocab, blocks, block_size * bits // 8), np.uint8)
    weights[scales] = outputs.part(1, (vocab, blocks), np.float32)
    at = next(i for i, t in enumerate(model.graph.initializer) if t.name == name)  # where export writes them
    for offset, new in enumerate((packed, scales)):
        model.graph.initializer.insert(at + offset, placeholder(new, weights[new]))
    return packed, scales


def _gather_tied_from_nbits(quantized: onnx.ModelProto) -> None:
    """The tied embedding gathers from the LM head's quantized weights instead of keeping an fp32 copy."""
    packed = {n.input[1]: n for n in quantized.graph.node if n.op_type == "MatMulNBits"}
    for gather in tied_gathers(quantized):
        table = gather.input[0]
        reader = packed.get(f"{table}_Q8") or packed.get(f"{table}_Q4")
        assert reader is not None and len(reader.input) == 3, f"no symmetric MatMulNBits reads the tied {table}"
        table_bits, block_size = (
            next(a.i for a in reader.attribute if a.name == key) for key in ("bits", "block_size")
        )
        gather_from_nbits(quantized, gather, reader.input[1], reader.input[2], bits=table_bits, block_size=block_size)
    drop_unused_initializers(quantized)


def quantize_weight_only(src: Path, dst: Path, *, mode: str, block_size: int = 32, lm_head: str = "int8") -> dict:
    """Weight-only blocks (MatMulNBits) for the linear layers, activations quantized per row and block by
    the kernel, so a row's result does not depend on the other rows of a batch. mode "int4": 4-bit blocks, and
    lm_head="int8" keeps the LM head (and the tied embedding that reads it) at 8 bits, since its rounding errors
    are the ones that change the most likely token; "int8-weight-only": every linear layer in 8-bit blocks
    (quantize/weight_only.py WeightOnly). Each weight is quantized as it is written (quantize/weights.py)."""
    source = SourceModel(src)
    model = source.model
    head = _lm_head(model)
    head_node = next((n for n in model.graph.node if head is not None and n.name == head), None)
    head_width = None if head_node is None else source.dims(head_node.input[1])[0]
    plan = WeightOnly.of(mode, block_size=block_size, lm_head=lm_head, head_width=head_width)
    _check_block_size(model, block_size)
    assert head is not None or lm_head == "int4", "found no LM head (a MatMul whose output is a graph output)"
    bits, head_bits, head_block = plan.bits, plan.head_bits, plan.head_block
    linear, weights = set(_linear_matmuls(model)), {}
    embedding, table = _untied_embedding(model), None
    nodes = []
    for n in model.graph.node:  # new weights in node order, as export writes them
        if n is embedding:
            table = _embedding_blocks(n, source, model, weights, bits=head_bits, block_size=head_block)
        if n.name in linear and len(source.dims(n.input[1])) == 2:
            width, size = (head_bits, head_block) if n.name == head else (bits, block_size)
            n = _nbits_node(n, source, model, weights, bits=width, block_size=size)
        nodes.append(n)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.add(domain="com.microsoft", version=1)
    if table is not None:  # an untied embedding's rows gathered from its own blocks, at the head's bits
        gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == UNTIED_TABLE)
        gather_from_nbits(model, gather, *table, bits=head_bits, block_size=head_block)
    _gather_tied_from_nbits(model)
    write(model, source, dst, weights)
    return plan.recipe(embedding_bits=None if table is None else head_bits)


def convert_fp16(src: Path, dst: Path) -> dict:
    """onnxruntime's convert_float_to_float16 on the graph; the float weights it converts (in its graph, a
    type change) are converted as they are written (writers/float16.py, shared with export --quantize fp16)."""
    source = SourceModel(src)
    converted, names = half_graph(source.model)
    weights = {}
    for tensor in converted.graph.initializer:
        if tensor.name in names:
            shape = source.dims(tensor.name)
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
            rows = partial(source.rows, tensor.name)
            weights[tensor.name] = Deferred(shape, np.float16, lambda shape=shape, rows=rows: to_half(shape, rows))
    write(converted, source, dst, weights)
    return FP16_FACTS


@dataclass
class Options:
    """Every recipe's settings; each reads the ones it uses."""

    per_channel: bool = True  # int8: one scale per output channel
    block_size: int = 32  # int4: weights per scale
    int4_lm_head: str = "int8"  # int4: precision of the LM head and the tied embedding (modes.LM_HEADS)
    calibration: object = None  # static: an onnxruntime CalibrationDataReader (quantize/calibration.py)
    calibration_method: str = "percentile"  # static: modes.CALIBRATION_METHODS


@dataclass(frozen=True)
class Recipe:
    """How a mode of quantize/modes.py's MODES (its precision and help there) is run."""

    run: Callable[[Path, Path, Options], dict]  # fp32 model file -> quantized model file; returns the recipe facts
    calibrated: bool = False  # needs calibration text
    kv_dtype: str = "float32"  # the cache's type in the new graph
    evaluated: bool = True  # an accuracy report on the CPU makes sense (fp16 is for GPUs)


RECIPES: dict[str, Recipe] = {
    "dynamic": Recipe(lambda src, dst, o: quantize_dynamic_int8(src, dst, per_channel=o.per_channel)),
    "static": Recipe(
        lambda src, dst, o: quantize_static_int8(
            src, dst, reader=o.calibration, method=o.calibration_method, per_channel=o.per_channel
        ),
        calibrated=True,
    ),
    "int4": Recipe(
        lambda src, dst, o: quantize_weight_only(src, dst, mode="int4", block_size=o.block_size, lm_head=o.int4_lm_head)
    ),
    "int8-weight-only": Recipe(
        lambda src, dst, o: quantize_weight_only(
            src, dst, mode="int8-weight-only", block_size=o.block_size, lm_head="int8"
        )
    ),
    "fp16": Recipe(lambda src, dst, o: convert_fp16(src, dst), kv_dtype="float16", evaluated=False),
}
assert list(RECIPES) == list(MODES), "a recipe for every mode of quantize/modes.py, in its order"
