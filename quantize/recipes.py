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
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from edgelm.nbits_gather import gather_from_nbits
from edgelm.onnxfile import save_model

from .tied_embedding import drop_unused_initializers, share_int8_embedding, tied_gathers

# onnxruntime.quantization logs every node at INFO and advises pre-processing on the root logger
logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
# the sessions the quantizers open would warn that num_logits_to_keep, an input with a default, is
# not constant-folded: true by design, and noise to a user
ort.set_default_logger_severity(3)

CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
INT4_LM_HEADS = ("int8", "int4")  # precision of the LM head (and tied embedding) in int4 mode


class _QuietRootLogger:
    """onnxruntime.quantization warns on the root logger that the model was not pre-processed; our
    graphs are shape-inferred by the exporter, and pre-processing's optimizations would fuse away the
    MatMuls we quantize. Silence that one call's root warnings."""

    def __enter__(self):
        self.level = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)

    def __exit__(self, *exc):
        logging.getLogger().setLevel(self.level)


class _FlatHistograms:
    """onnxruntime's histogram calibrators (entropy, percentile) stack each tensor's values from all
    calibration runs into one array, which fails when runs differ in shape, as a prompt pass and a
    decode step do. A histogram only needs the values: flatten each run's array first."""

    def __enter__(self):
        from onnxruntime.quantization import calibrate

        self.collector = calibrate.HistogramCollector
        self.original = original = self.collector.collect

        def collect(collector, name_to_arr):
            flat = {
                name: np.concatenate([np.ravel(a) for a in arrays]) if isinstance(arrays, list) else arrays
                for name, arrays in name_to_arr.items()
            }
            return original(collector, flat)

        self.collector.collect = collect

    def __exit__(self, *exc):
        self.collector.collect = self.original


def _linear_matmuls(model: onnx.ModelProto) -> list[str]:
    """Names of MatMul nodes whose weight (input B) is an initializer: the model's linear layers. A weight that
    is also a graph input (a LoRA slot's A or B, runtime/lora_contract.py) is a run's to bind: it stays fp32."""
    initializers = {init.name for init in model.graph.initializer} - {i.name for i in model.graph.input}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in initializers]


def _overridable_matmuls(model: onnx.ModelProto) -> list[str]:
    """MatMuls whose weight a run may override (LoRA slots): never quantized."""
    inputs = {i.name for i in model.graph.input}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inputs]


def _dynamic_int8(model: onnx.ModelProto | Path, dst: Path, *, nodes: list[str], per_channel: bool) -> None:
    """int8 weights, activations quantized at run time, for the named MatMuls (the dynamic recipe;
    static int8 uses it for the LM head)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        model if isinstance(model, onnx.ModelProto) else str(model),
        str(dst),
        per_channel=per_channel,
        reduce_range=True,  # 7-bit weights: see the module docstring
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul"],
        nodes_to_quantize=nodes,
        # ONNX's shape inference cannot type contrib ops' outputs (Llama's SimplifiedLayerNormalization)
        extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
    )


def quantize_dynamic_int8(src: Path, dst: Path, *, per_channel: bool = True) -> dict:
    model = onnx.load(str(src))
    tied = {g.input[0] for g in tied_gathers(model)}
    with _QuietRootLogger():
        _dynamic_int8(model, dst, nodes=_linear_matmuls(model), per_channel=per_channel)
    _share_tied_int8(dst, tied)
    return {
        "mode": "dynamic",
        "weights": "int8 symmetric, 7-bit range (reduce_range)",
        "per_channel": per_channel,
        "activations": "uint8, quantized at run time",
        "ops": "linear MatMuls + tied embedding",
    }


def _lm_head(model: onnx.ModelProto) -> str | None:
    """The MatMul that produces the logits (a graph output)."""
    outputs = {o.name for o in model.graph.output}
    return next((n.name for n in model.graph.node if n.op_type == "MatMul" and n.output[0] in outputs), None)


def _share_tied_int8(dst: Path, tied: set[str]) -> None:
    """Point the tied embedding's Gather at the LM head's int8 weights in dst, dropping its fp32 copy."""
    quantized = onnx.load(str(dst))
    share_int8_embedding(quantized, {t: (f"{t}_quantized", f"{t}_scale", f"{t}_zero_point") for t in tied})
    save_model(quantized, dst)


_STATIC_OPTIONS = {
    "MatMulConstBOnly": True,
    "DefaultTensorType": onnx.TensorProto.FLOAT,  # as in _dynamic_int8
    "WeightSymmetric": True,
    "ActivationSymmetric": False,
    "CalibTensorRangeSymmetric": False,
    "CalibPercentile": 99.999,
    "CalibStridedMinMax": None,
    # a linear layer's output goes on in float (bias, GELU, attention, residual): quantizing
    # it would only add a Q/DQ round trip, costing accuracy and a requantizing kernel
    "OpTypesToExcludeOutputQuantization": ["MatMul"],
}


def _static_qdq(src: Path, dst: Path, *, reader, nodes: list[str], method: str, per_channel: bool) -> None:
    """Static QDQ for the named MatMuls: int8 weights, uint8 activations with calibrated ranges."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    # the histogram calibrators print their progress to stdout; our progress bar already says it
    with _QuietRootLogger(), _FlatHistograms(), contextlib.redirect_stdout(io.StringIO()):
        quantize_static(
            str(src),
            str(dst),
            reader,
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=nodes,
            per_channel=per_channel,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=methods[method],
            calibration_providers=["CPUExecutionProvider"],
            extra_options=_STATIC_OPTIONS,
        )


def quantize_static_int8(src: Path, dst: Path, *, reader, method: str = "percentile", per_channel: bool = True) -> dict:
    model = onnx.load(str(src))
    tied = {g.input[0] for g in tied_gathers(model)}
    # The LM head's input is where one 8-bit range for all tokens costs most (docs/results.md,
    # "Quantization accuracy"), so the head gets int8 weights with its activations quantized at run
    # time, per call (the dynamic recipe), and the blocks' linear layers are static QDQ.
    head = _lm_head(model)
    blocks = [n for n in _linear_matmuls(model) if n != head]
    _static_qdq(src, dst, reader=reader, nodes=blocks, method=method, per_channel=per_channel)
    if head is not None:
        with _QuietRootLogger():
            _dynamic_int8(dst, dst, nodes=[head], per_channel=per_channel)
    _share_tied_int8(dst, tied)
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
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two >= 16, got {block_size}")
    inits = {i.name: i for i in model.graph.initializer}
    for gather in tied_gathers(model):
        n_embd = inits[gather.input[0]].dims[0]
        if n_embd % block_size:
            raise ValueError(f"block size {block_size} does not divide the embedding width {n_embd}; use a smaller one")


def _nbits_blocks(model: onnx.ModelProto, *, bits: int, block_size: int, head: str | None, head_bits: int):
    """Every MatMul with a constant weight as MatMulNBits with `bits`-bit blocks, the head with head_bits.
    MatMuls without a constant weight (attention products of the standard graph) are left as they are."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # accuracy_level 4: the kernel quantizes activations to int8 per block and runs integer dot products
    # (the other levels, compared in docs/results.md, were no more accurate and slower)
    nbits = dict(block_size=block_size, is_symmetric=True, accuracy_level=4, op_types_to_quantize=("MatMul",))
    slots = _overridable_matmuls(model)
    excluded = [head] if head is not None and head_bits != bits else []
    quantizer = MatMulNBitsQuantizer(model, bits=bits, nodes_to_exclude=excluded + slots, **nbits)
    quantizer.process()
    if not excluded:
        return quantizer.model.model
    quantizer = MatMulNBitsQuantizer(quantizer.model.model, bits=head_bits, nodes_to_exclude=slots, **nbits)
    quantizer.process()  # the head is the one MatMul left with a constant weight
    return quantizer.model.model


def _gather_tied_from_nbits(quantized: onnx.ModelProto, block_size: int) -> None:
    """The tied embedding gathers from the LM head's quantized weights instead of keeping an fp32 copy."""
    packed = {n.input[1]: n for n in quantized.graph.node if n.op_type == "MatMulNBits"}
    for gather in tied_gathers(quantized):
        table = gather.input[0]
        reader = packed.get(f"{table}_Q8") or packed.get(f"{table}_Q4")
        assert reader is not None and len(reader.input) == 3, f"no symmetric MatMulNBits reads the tied {table}"
        table_bits = next(a.i for a in reader.attribute if a.name == "bits")
        gather_from_nbits(quantized, gather, reader.input[1], reader.input[2], bits=table_bits, block_size=block_size)
    drop_unused_initializers(quantized)


def quantize_weight_only(src: Path, dst: Path, *, bits: int, block_size: int = 32, lm_head: str = "int8") -> dict:
    """Weight-only blocks (MatMulNBits) for the linear layers, activations quantized per row and block by
    the kernel, so a row's result does not depend on the other rows of a batch. bits=4 is the int4
    recipe: lm_head="int8" keeps the LM head (and the tied embedding that reads it) at 8 bits, since its
    rounding errors are the ones that change the most likely token. bits=8 is int8-weight-only: every
    linear layer in 8-bit blocks."""
    if lm_head not in INT4_LM_HEADS:
        raise ValueError(f"unknown int4 LM head precision {lm_head!r}; valid: {', '.join(INT4_LM_HEADS)}")
    model = onnx.load(str(src))
    _check_block_size(model, block_size)
    head = _lm_head(model)
    assert head is not None or lm_head == "int4", "found no LM head (a MatMul whose output is a graph output)"
    head_bits = 8 if lm_head == "int8" else bits
    quantized = _nbits_blocks(model, bits=bits, block_size=block_size, head=head, head_bits=head_bits)
    _gather_tied_from_nbits(quantized, block_size)
    save_model(quantized, dst)
    return {
        "mode": "int4" if bits == 4 else "int8-weight-only",
        "bits": bits,
        "op": "MatMulNBits",
        "algorithm": "round to nearest",
        "block_size": block_size,
        "symmetric": True,
        "accuracy_level": 4,
        "lm_head": lm_head,
        "ops": f"linear MatMuls of the blocks int{bits}; LM head {lm_head}, read by the tied embedding too",
    }


def convert_fp16(src: Path, dst: Path) -> dict:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    converted = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)
    save_model(converted, dst)
    return {"mode": "fp16", "note": "for GPU execution providers; KV cache and logits in float16"}


@dataclass
class Options:
    """Every recipe's settings; each reads the ones it uses."""

    per_channel: bool = True  # int8: one scale per output channel
    block_size: int = 32  # int4: weights per scale
    int4_lm_head: str = "int8"  # int4: precision of the LM head and the tied embedding
    calibration: object = None  # static: an onnxruntime CalibrationDataReader (quantize/calibration.py)
    calibration_method: str = "percentile"  # static: minmax, entropy or percentile


@dataclass(frozen=True)
class Recipe:
    precision: str  # the new package's precision
    run: Callable[[Path, Path, Options], dict]  # fp32 model file -> quantized model file; returns the recipe facts
    calibrated: bool = False  # needs calibration text
    kv_dtype: str = "float32"  # the cache's type in the new graph
    evaluated: bool = True  # an accuracy report on the CPU makes sense (fp16 is for GPUs)


RECIPES: dict[str, Recipe] = {
    "dynamic": Recipe("int8-dynamic", lambda src, dst, o: quantize_dynamic_int8(src, dst, per_channel=o.per_channel)),
    "static": Recipe(
        "int8-static",
        lambda src, dst, o: quantize_static_int8(
            src, dst, reader=o.calibration, method=o.calibration_method, per_channel=o.per_channel
        ),
        calibrated=True,
    ),
    "int4": Recipe(
        "int4",
        lambda src, dst, o: quantize_weight_only(src, dst, bits=4, block_size=o.block_size, lm_head=o.int4_lm_head),
    ),
    "int8-weight-only": Recipe(
        "int8-weight-only",
        lambda src, dst, o: quantize_weight_only(src, dst, bits=8, block_size=o.block_size, lm_head="int8"),
    ),
    "fp16": Recipe("fp16", lambda src, dst, o: convert_fp16(src, dst), kv_dtype="float16", evaluated=False),
}
