"""The quantization modes, one row each, and the other names the CLI offers (LM head precisions, calibration
methods): the one table that `edgelm quantize`, `edgelm export --quantize`, quantize/recipes.py's `RECIPES` and
export's block quantizer read, so the supported set and its help text are derived, never copied (gguf-py's
`GGML_QUANT_SIZES` the same way). Imports nothing, so `--help` reads it without numpy, onnx or torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    precision: str  # the new package's precision (edgelm.json)
    summary: str  # what it is, in a phrase of the CLI's help
    bits: int | None = None  # weight-only: the linears' MatMulNBits bits (quantize/weight_only.py)
    exported: bool = False  # `export --quantize` writes it straight from the checkpoint, with no fp32 package


MODES: dict[str, Mode] = {
    "dynamic": Mode(
        "int8-dynamic",
        "int8, activations scaled per call (fast; a row's output can depend on the rest of its batch)",
    ),
    "static": Mode("int8-static", "int8 calibrated QDQ (needs --calibration-text)"),
    "int4": Mode("int4", "4-bit blocks", bits=4, exported=True),
    "int8-weight-only": Mode("int8-weight-only", "8-bit blocks, batch-invariant", bits=8, exported=True),
    "fp16": Mode("fp16", "for GPUs", exported=True),
}
WEIGHT_ONLY = tuple(name for name, mode in MODES.items() if mode.bits is not None)
EXPORTED = tuple(name for name, mode in MODES.items() if mode.exported)  # what export --quantize writes
LM_HEADS = ("int8", "int4")  # int4 mode: the precision of the LM head and the embedding
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")  # static mode's range estimate


def mode_summaries(names: tuple[str, ...] = tuple(MODES)) -> str:
    """`mode: what it is; ...`, for a help text."""
    return "; ".join(f"{name}: {MODES[name].summary}" for name in names)
