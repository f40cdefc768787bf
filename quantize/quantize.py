"""Quantize a model package into a new one: dynamic int8, static int8 (QDQ), int4 weight-only, fp16.

Each mode is one function from an fp32 ONNX model file to a quantized one, built on
onnxruntime.quantization; quantize_package wraps it: it reads a package, writes a complete new one
(model, genai_config.json, tokenizer, manifest with precision and recipe) atomically, and stores the
accuracy report against the fp32 package when given held-out text.

Recipes, chosen for accuracy on decoder LMs:
- dynamic: int8 weights of every linear layer (MatMul with a constant weight) and of the embedding,
  per-channel; activations quantized at run time, per tensor.
- static: QDQ, int8 weights per channel, uint8 activations calibrated on text run the way the model
  really runs (prompt passes *and* decode steps with their past keys/values). Only the linear layers
  are quantized: attention's QK^T and softmax(.)V products, LayerNorm, GELU, softmax and residual
  adds stay in float, because their activations are where 8-bit ranges lose decoder LMs. The LM
  head, whose input suffers most from one calibrated range, has its activations quantized at run
  time instead (int8 weights all the same).
- int4: MatMulNBits, block-wise symmetric 4-bit weights rounded to nearest, for the blocks' linear
  layers; the kernel quantizes activations to int8 at run time (accuracy_level 4). The LM head, whose
  rounding errors are the ones that change the most likely token, gets 8-bit blocks (MatMulNBits
  bits=8): on the bundled model, top-1 agreement with fp32 goes from 89% to 93% for about 10% more
  bytes (docs/results.md).
- int8-weight-only: the int4 recipe with 8-bit blocks everywhere (MatMulNBits bits=8, block 32). Its
  kernel quantizes activations per row and block, so, unlike dynamic int8 (one activation scale over
  the whole batch), a row's output does not depend on the other rows of a batch.
- fp16: every float tensor in half precision, for GPU providers.

The tied embedding: export stores one (n_embd, vocab) matrix read by both the LM head (MatMul) and
the embedding (Gather along axis 1). After int8 quantization the Gather reads the quantized matrix
and dequantizes just the gathered columns, so the package keeps one int8 copy, not an fp32 one. In
int4 mode the Gather reads the LM head's MatMulNBits blocks (8-bit, or 4-bit with lm_head="int4").
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from edgelm import __version__

from ..runtime import PackageError, load
from ..runtime.outputs import StagedOutput
from ..runtime.package import MANIFEST_FILE, list_files, read_package, write_json
from .calibration import DecoderCalibrationReader
from .evaluate import evaluate_package

# onnxruntime.quantization logs every node at INFO and advises pre-processing on the root logger
logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
# the sessions the quantizers open would warn that num_logits_to_keep, an input with a default, is
# not constant-folded: true by design, and noise to a user
ort.set_default_logger_severity(3)

MODES = ("dynamic", "static", "int4", "int8-weight-only", "fp16")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
INT4_LM_HEADS = ("int8", "int4")  # precision of the LM head (and tied embedding) in int4 mode
MIN_CALIBRATION_TOKENS = 256
# REDUCE_RANGE: weights quantized at run-time-activation layers use 7 bits (reduce_range=True). On x86
# without VNNI (AVX2, this project's machines) onnxruntime's u8 x s8 kernels add pairs of products in
# int16, which can saturate with full 8-bit weights; on the bundled model dynamic int8 agrees with fp32
# on 97.36% of next tokens with 7-bit weights and 97.07% with 8-bit ones.


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


def _save(model: onnx.ModelProto, path: Path) -> None:
    if model.ByteSize() > 1_800_000_000:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))


def _linear_matmuls(model: onnx.ModelProto) -> list[str]:
    """Names of MatMul nodes whose weight (input B) is an initializer: the model's linear layers."""
    initializers = {init.name for init in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in initializers]


def _column_gathers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Gather(axis=1) nodes: export's shared embedding reads columns of the LM head's (n_embd, vocab)
    matrix (see module docstring)."""
    return [
        n for n in model.graph.node if n.op_type == "Gather" and any(a.name == "axis" and a.i == 1 for a in n.attribute)
    ]


def _tied_gathers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The shared embedding's Gathers while they still read the float matrix itself (an initializer)."""
    initializers = {init.name for init in model.graph.initializer}
    return [n for n in _column_gathers(model) if n.input[0] in initializers]


def _gather_from_int8(
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


def _gather_from_nbits(
    model: onnx.ModelProto, gather: onnx.NodeProto, packed: str, scales: str, *, bits: int, block_size: int
) -> None:
    """Rewire a tied-embedding Gather to read MatMulNBits' packed weights (vocab, n_blocks, blob) and
    dequantize only the gathered rows: symmetric, so the zero point is 2^(bits-1); 4-bit values are
    packed two to a byte, low nibble first; times the block scale."""
    assert bits in (4, 8), f"MatMulNBits gather supports 4 or 8 bits, got {bits}"
    graph = model.graph
    index = list(graph.node).index(gather)
    ids, out = gather.input[1], gather.output[0]
    transpose = next(n for n in graph.node if n.input and n.input[0] == out and n.op_type == "Transpose")
    rows_out = transpose.output[0]
    p = (gather.name or out) + f"_int{bits}"
    packed_dims = next(i.dims for i in graph.initializer if i.name == packed)  # (vocab, n_blocks, blob)
    n_blocks = packed_dims[1]
    constants = {
        f"{p}_zero_point": np.array(2 ** (bits - 1), dtype=np.float32),
        f"{p}_last": np.array([-1], dtype=np.int64),
        f"{p}_row_shape": np.array([0, 0, n_blocks * block_size], dtype=np.int64),
    }
    if bits == 4:
        constants[f"{p}_sixteen"] = np.array(16, dtype=np.int32)
        constants[f"{p}_block_shape"] = np.array([0, 0, n_blocks, block_size], dtype=np.int64)
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())
    n = lambda op, inputs, output, **attrs: helper.make_node(
        op, inputs, [output], name=f"{p}_{output[len(p) :]}", **attrs
    )
    nodes = [n("Gather", [packed, ids], f"{p}_bytes", axis=0)]  # (B, T, n_blocks, blob) uint8
    values = f"{p}_bytes"  # 8 bits: one byte a value, blob == block
    if bits == 4:
        values = f"{p}_nibbles"
        nodes += [
            n("Cast", [f"{p}_bytes"], f"{p}_ints", to=onnx.TensorProto.INT32),
            n("Mod", [f"{p}_ints", f"{p}_sixteen"], f"{p}_low"),
            n("Div", [f"{p}_ints", f"{p}_sixteen"], f"{p}_high"),
            n("Unsqueeze", [f"{p}_low", f"{p}_last"], f"{p}_low5"),
            n("Unsqueeze", [f"{p}_high", f"{p}_last"], f"{p}_high5"),
            n("Concat", [f"{p}_low5", f"{p}_high5"], f"{p}_pairs", axis=-1),  # (B, T, n_blocks, blob, 2)
            n("Reshape", [f"{p}_pairs", f"{p}_block_shape"], values),  # (B, T, n_blocks, block)
        ]
    nodes += [
        n("Cast", [values], f"{p}_float", to=onnx.TensorProto.FLOAT),
        n("Sub", [f"{p}_float", f"{p}_zero_point"], f"{p}_centered"),
        n("Gather", [scales, ids], f"{p}_scales", axis=0),  # (B, T, n_blocks)
        n("Unsqueeze", [f"{p}_scales", f"{p}_last"], f"{p}_scales4"),
        n("Mul", [f"{p}_centered", f"{p}_scales4"], f"{p}_blocks"),
        helper.make_node("Reshape", [f"{p}_blocks", f"{p}_row_shape"], [rows_out], name=f"{p}_rows"),
    ]
    graph.node.remove(transpose)
    graph.node.remove(gather)
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    used |= {o.name for o in model.graph.output}
    for init in [i for i in model.graph.initializer if i.name not in used]:
        model.graph.initializer.remove(init)


def _share_int8_embedding(model: onnx.ModelProto, weight_names: dict) -> None:
    """After int8 quantization of the LM head: point the tied Gather at the int8 copy.

    Dynamic quantization leaves the Gather reading the fp32 table and names the int8 copy after it
    (weight_names: table -> (quantized, scale, zero point)); QDQ rewires the Gather to the table's
    DequantizeLinear, which would dequantize the whole (n_embd, vocab) matrix on every step."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    for gather in _column_gathers(model):
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
        _gather_from_int8(model, gather, quantized, scale, zp)
    _drop_unused_initializers(model)


def _dynamic_int8(model: onnx.ModelProto | Path, dst: Path, *, nodes: list[str], per_channel: bool) -> None:
    """int8 weights, activations quantized at run time, for the named MatMuls (the dynamic recipe;
    static int8 uses it for the LM head)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        model if isinstance(model, onnx.ModelProto) else str(model),
        str(dst),
        per_channel=per_channel,
        reduce_range=True,  # 7-bit weights: see REDUCE_RANGE above
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul"],
        nodes_to_quantize=nodes,
        extra_options={"MatMulConstBOnly": True},
    )


def quantize_dynamic_int8(src: Path, dst: Path, *, per_channel: bool = True) -> dict:
    model = onnx.load(str(src))
    tied = {g.input[0] for g in _tied_gathers(model)}
    with _QuietRootLogger():
        _dynamic_int8(model, dst, nodes=_linear_matmuls(model), per_channel=per_channel)
    quantized = onnx.load(str(dst))
    _share_int8_embedding(quantized, {t: (f"{t}_quantized", f"{t}_scale", f"{t}_zero_point") for t in tied})
    _save(quantized, dst)
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


def quantize_static_int8(src: Path, dst: Path, *, reader, method: str = "percentile", per_channel: bool = True) -> dict:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    model = onnx.load(str(src))
    tied = {g.input[0] for g in _tied_gathers(model)}
    # The LM head's input is where one 8-bit range for all tokens costs most: on the bundled model,
    # static QDQ of every linear layer agrees with fp32 on 95.2% of next tokens, and 97.4% with the
    # head left out. So the head gets int8 weights with its activations quantized at run time, per
    # call (the dynamic recipe), and the blocks' linear layers are static QDQ.
    head = _lm_head(model)
    blocks = [n for n in _linear_matmuls(model) if n != head]
    # the histogram calibrators print their progress to stdout; our progress bar already says it
    with _QuietRootLogger(), _FlatHistograms(), contextlib.redirect_stdout(io.StringIO()):
        quantize_static(
            str(src),
            str(dst),
            reader,
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=blocks,
            per_channel=per_channel,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=methods[method],
            calibration_providers=["CPUExecutionProvider"],
            extra_options={
                "MatMulConstBOnly": True,
                "WeightSymmetric": True,
                "ActivationSymmetric": False,
                "CalibTensorRangeSymmetric": False,
                "CalibPercentile": 99.999,
                "CalibStridedMinMax": None,
                # a linear layer's output goes on in float (bias, GELU, attention, residual): quantizing
                # it would only add a Q/DQ round trip, costing accuracy and a requantizing kernel
                "OpTypesToExcludeOutputQuantization": ["MatMul"],
            },
        )
        if head is not None:
            _dynamic_int8(dst, dst, nodes=[head], per_channel=per_channel)
    quantized = onnx.load(str(dst))
    _share_int8_embedding(quantized, {t: (f"{t}_quantized", f"{t}_scale", f"{t}_zero_point") for t in tied})
    _save(quantized, dst)
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


def quantize_int4(src: Path, dst: Path, *, block_size: int = 32, lm_head: str = "int8", bits: int = 4) -> dict:
    """4-bit blocks for the linear layers; lm_head="int8" keeps the LM head (and the tied embedding that
    reads it) at 8 bits, since its rounding errors are the ones that change the most likely token.
    bits=8 is the int8-weight-only recipe: every linear layer in 8-bit blocks, activations quantized
    per row and block by the kernel, so a row's result does not depend on the other rows of a batch."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two >= 16, got {block_size}")
    if lm_head not in INT4_LM_HEADS:
        raise ValueError(f"unknown int4 LM head precision {lm_head!r}; valid: {', '.join(INT4_LM_HEADS)}")
    model = onnx.load(str(src))
    inits = {i.name: i for i in model.graph.initializer}
    for gather in _tied_gathers(model):
        n_embd = inits[gather.input[0]].dims[0]
        if n_embd % block_size:
            raise ValueError(f"block size {block_size} does not divide the embedding width {n_embd}; use a smaller one")
    head = _lm_head(model)
    assert head is not None or lm_head == "int4", "found no LM head (a MatMul whose output is a graph output)"
    # accuracy_level 4: the kernel quantizes activations to int8 per block and runs integer dot products;
    # level 0/1 (float activations) measured no more accurate on the bundled model, and slower
    nbits = dict(block_size=block_size, is_symmetric=True, accuracy_level=4, op_types_to_quantize=("MatMul",))
    # MatMuls without a constant weight (attention products of the standard graph) are left as they are
    excluded = [head] if lm_head == "int8" and bits == 4 else []
    quantizer = MatMulNBitsQuantizer(model, bits=bits, nodes_to_exclude=excluded, **nbits)
    quantizer.process()
    quantized = quantizer.model.model
    if excluded:
        quantizer = MatMulNBitsQuantizer(quantized, bits=8, **nbits)
        quantizer.process()  # the head is the one MatMul left with a constant weight
        quantized = quantizer.model.model
    # the tied embedding: gather from the LM head's quantized weights instead of keeping an fp32 copy
    packed = {n.input[1]: n for n in quantized.graph.node if n.op_type == "MatMulNBits"}
    for gather in _tied_gathers(quantized):
        table = gather.input[0]
        reader = packed.get(f"{table}_Q8") or packed.get(f"{table}_Q4")
        assert reader is not None and len(reader.input) == 3, f"no symmetric MatMulNBits reads the tied {table}"
        read_bits = next(a.i for a in reader.attribute if a.name == "bits")
        _gather_from_nbits(quantized, gather, reader.input[1], reader.input[2], bits=read_bits, block_size=block_size)
    _drop_unused_initializers(quantized)
    _save(quantized, dst)
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
    _save(converted, dst)
    return {"mode": "fp16", "note": "for GPU execution providers; KV cache and logits in float16"}


def _calibration_ids(path: str | Path | None, tokenizer) -> np.ndarray:
    if path is None:
        raise ValueError("static quantization needs calibration text: pass --calibration-text FILE")
    if tokenizer is None:
        raise PackageError("static calibration reads text, and this package has no tokenizer.json")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration text {path} does not exist")
    ids = np.array(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=np.int64)
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise ValueError(
            f"calibration text {path} is too short: {len(ids)} tokens, need at least {MIN_CALIBRATION_TOKENS}"
        )
    return ids


def quantize_package(
    package: str | Path,
    out_dir: str | Path,
    *,
    mode: str,
    calibration_text: str | Path | None = None,
    calibration_method: str = "percentile",
    calibration_samples: int = 32,
    per_channel: bool | None = None,
    block_size: int = 32,
    int4_lm_head: str = "int8",
    eval_text: str | Path | None = None,
    evaluate: bool = True,
    overwrite: bool = False,
    progress=print,
) -> dict:
    """Read a package, write its quantized copy to out_dir; returns the new manifest."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if calibration_method not in CALIBRATION_METHODS:
        raise ValueError(f"unknown calibration method {calibration_method!r}; valid: {', '.join(CALIBRATION_METHODS)}")
    package, out_dir = Path(package), Path(out_dir)
    staged = StagedOutput(out_dir, inputs=[package, calibration_text, eval_text], overwrite=overwrite)
    spec = read_package(package)  # verifies every file's sha256
    if spec.kind != "edgelm":
        raise PackageError(f"{package} is not an edgelm package (no {MANIFEST_FILE}); export it with edgelm first")
    if spec.precision != "fp32":
        raise PackageError(f"{package} is already quantized ({spec.precision}); quantize the fp32 package instead")
    if spec.manifest.get("export", {}).get("external_data"):
        raise PackageError("quantizing packages with external data (> 2 GB) is not supported yet")
    source = load(package, provider="cpu")
    reader = None
    if mode == "static":
        ids = _calibration_ids(calibration_text, source.tokenizer)
        reader = DecoderCalibrationReader(source, ids, samples=calibration_samples)

    progress(f"quantizing {package} -> {out_dir} ({mode})")
    with staged as staging:
        model_file = spec.model_path.name
        target = staging / model_file
        if mode == "dynamic":
            recipe = quantize_dynamic_int8(
                spec.model_path, target, per_channel=True if per_channel is None else per_channel
            )
        elif mode == "static":
            recipe = quantize_static_int8(
                spec.model_path,
                target,
                reader=reader,
                method=calibration_method,
                per_channel=True if per_channel is None else per_channel,
            )
        elif mode in ("int4", "int8-weight-only"):
            bits, head = (4, int4_lm_head) if mode == "int4" else (8, "int8")
            recipe = quantize_int4(spec.model_path, target, block_size=block_size, lm_head=head, bits=bits)
        else:
            recipe = convert_fp16(spec.model_path, target)
        for name in spec.manifest["files"]:
            if name != model_file and not (staging / name).exists():
                shutil.copyfile(package / name, staging / name)
        manifest = json.loads(json.dumps(spec.manifest))
        precision = {"dynamic": "int8-dynamic", "static": "int8-static", "fp16": "fp16"}.get(mode, mode)
        manifest["precision"] = precision
        manifest["recipe"] = {
            **recipe,
            "tool": f"edgelm {__version__}",
            "source_package": package.name,
            "source_model_sha256": spec.manifest["files"][model_file]["sha256"],
        }
        if mode == "fp16":
            manifest["io"]["kv_dtype"] = "float16"
        manifest.pop("evaluation", None)
        manifest["files"] = list_files(staging)
        write_json(staging / MANIFEST_FILE, manifest)
        if evaluate and eval_text is not None and mode != "fp16":
            progress(f"evaluating on {eval_text} against {package}")
            report = evaluate_package(staging, eval_text, reference=source)
            report["package"] = out_dir.name
            report["reference"] = package.name
            manifest["evaluation"] = report
            write_json(staging / MANIFEST_FILE, manifest)
            progress(
                f"  perplexity x{report['perplexity_ratio']:.4f}, top-1 agreement "
                f"{100 * report['top1_agreement']:.2f}%, KL {report['mean_kl_nats']:.5f}, size "
                f"x{report['size_ratio']:.3f}"
            )
    progress(f"wrote {out_dir} ({sum(f['bytes'] for f in manifest['files'].values()) / 1e6:.2f} MB)")
    return manifest
