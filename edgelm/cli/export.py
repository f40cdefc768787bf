"""`edgelm export`: a Hugging Face folder or a GGUF file -> an ONNX model package (export/onnx_export.py)."""

from __future__ import annotations

import argparse

from edgelm.export import defaults  # export's defaults, importable without torch
from edgelm.quantize.modes import EXPORTED, LM_HEADS  # the modes, importable without onnx

from .options import add_command, add_overwrite, finite_at_least, int_in

OPSETS = (14, 21)  # opsets export is tested with (the fused graph's com.microsoft ops need >= 14)


def describe() -> str:
    """The command's description, naming the sources from the family table and the kept GGUF block types from
    the block-type table (export/families/, export/gguf_blocks.py: both need edgelm[export])."""
    try:
        from edgelm.export.families import supported_sources
        from edgelm.export.gguf_blocks import KEPT_TYPE_NAMES
    except ModuleNotFoundError:
        sources = "a Hugging Face folder or a GGUF file of a supported family (install edgelm[export] to list them)"
        kept = "the types with an exact MatMulNBits form"
    else:
        sources, kept = supported_sources(), ", ".join(KEPT_TYPE_NAMES)
    return (
        "Export a model to a new package folder: an ONNX graph with KV-cache I/O, its weights, genai_config.json, "
        "tokenizer.json and tokenizer_config.json, the chat template and edgelm.json (the sha256 of every package "
        f"file and of every source file read). Sources: {sources}. A folder holds model.safetensors, sharded "
        "safetensors with their index, or pytorch_model.bin, and tokenizer.json, generation_config.json and a chat "
        "template where it has them; a GGUF file's tokenizer.json is built from its metadata. A quantized GGUF file "
        f"keeps its own blocks as MatMulNBits ({kept}) by default; --dequantize gives an fp32 package. Export then "
        "runs ONNX Runtime against PyTorch (prompt + decode steps) and fails above the tolerance or on any NaN/inf. "
        "The package is written beside out_dir and moved into place at the end; out_dir must not exist, or be an "
        "edgelm package (or empty folder) and --overwrite given."
    )


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "export",
        help="Hugging Face folder or GGUF file -> ONNX model package (needs edgelm[export])",
        description=describe,
        example="edgelm export models/SmolLM2-135M-Instruct out/smol-fp32",
    )
    p.add_argument(
        "checkpoint",
        help="a Hugging Face model folder or a .gguf file of a family the description names",
    )
    p.add_argument("out_dir", help="package folder to write (must not be, contain or lie inside the checkpoint)")
    p.add_argument(
        "--opset",
        type=int_in(*OPSETS),
        default=defaults.DEFAULT_OPSET,
        help=f"ONNX opset, {OPSETS[0]} to {OPSETS[1]} (default {defaults.DEFAULT_OPSET})",
    )
    p.add_argument(
        "--attention",
        choices=defaults.ATTENTION_KINDS,
        default="fused",
        help="fused (default): ONNX Runtime's GroupQueryAttention with a KV buffer updated in place, the fast "
        "graph; standard: standard ONNX ops only, for other ONNX runtimes",
    )
    p.add_argument(
        "--last-token-logits",
        action="store_true",
        help="standard graph only: emit logits for the last position only (faster prompts; eval then needs "
        "full logits). The fused graph picks per call",
    )
    p.add_argument("--untied", action="store_true", help="store the LM head separately from the token embedding")
    p.add_argument(
        "--quantize",
        choices=EXPORTED,
        default=None,
        help="write a weight-only quantized (or half-precision) package directly, tensor by tensor, with no fp32 "
        f"package in between: the recipe of `edgelm quantize --mode {' / '.join(EXPORTED)}`",
    )
    p.add_argument("--block-size", type=int, default=32, help="--quantize: weights per scale (default 32)")
    p.add_argument(
        "--int4-lm-head",
        choices=LM_HEADS,
        default="int8",
        help="--quantize int4: precision of the LM head and the tied embedding (default int8)",
    )
    _add_gguf_options(p)
    _add_lora_options(p)
    p.add_argument(
        "--tolerance",
        type=finite_at_least(0.0),
        default=None,
        help=f"max |logit difference| allowed against PyTorch (default {defaults.PARITY_TOLERANCE:g}; "
        f"{defaults.KEPT_FLOAT_TOLERANCE:g} for GGUF blocks or int4/int8 weights, whose int8-activation graph is "
        "checked through its float twin, then by KL: "
        f"mean {defaults.INT8_MEAN_KL:g} and max {defaults.INT8_MAX_KL:g} nats)",
    )
    add_overwrite(p)
    p.set_defaults(run=run)


def _add_gguf_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="GGUF files: dequantize every weight to fp32 (a package about 4x the file). By default a GGUF "
        "file's quantized weights of the types the description names stay in their own blocks as MatMulNBits, "
        "exactly",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=(0, 4),
        default=4,
        help="kept GGUF blocks: MatMulNBits' accuracy_level, 4 (default) int8 activations, 0 float",
    )
    storage = p.add_mutually_exclusive_group()
    storage.add_argument(
        "--compact-blocks",
        action="store_true",
        help="kept GGUF blocks as small on disk as the file holds them: 5- and 6-bit values as bit planes, scales "
        "as the file's own numbers, which ONNX Runtime unpacks at every load. Loading then takes several times "
        "longer and a memory peak of several copies of the weights (a 1B model: 4.4 GB against 1.9 GB; "
        "docs/benchmarks.md)",
    )
    storage.add_argument(
        "--plain-blocks",
        action="store_true",
        help="kept GGUF blocks as MatMulNBits' own 4- and 8-bit arrays and float32 scales (the default)",
    )
    storage.add_argument(
        "--packed-blocks",
        action="store_true",
        help="kept GGUF blocks as the file stores them (the package is the file's size), run by edgelm's native "
        "kernels (built with gcc on first use), with a MatMulNBits fallback graph where they cannot run",
    )


def _add_lora_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="ADAPTER_DIR[:SCALE]",
        help="merge a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into the weights, times "
        "SCALE (default 1); repeat for several, merged in order. A kept-blocks GGUF base writes the linears it "
        "changes as fp32",
    )
    p.add_argument(
        "--lora-slots",
        action="append",
        default=[],
        metavar="MODULES:MAX_RANK",
        help="add run-time LoRA slots (e.g. q_proj,k_proj,v_proj,o_proj:16, or all:8), or the slots a PEFT adapter "
        "folder needs; repeat to join them. Adapters for them: `edgelm adapter convert`",
    )


def run(args: argparse.Namespace) -> int:
    from edgelm.export.lora import merge_slot_specs, parse_slot_argument
    from edgelm.export.onnx_export import export_package
    from edgelm.export.peft_adapter import parse_lora_argument

    export_package(
        args.checkpoint,
        args.out_dir,
        opset=args.opset,
        attention=args.attention,
        last_token_logits=args.last_token_logits,
        untie=args.untied,
        dequantize=args.dequantize,
        accuracy_level=args.accuracy_level,
        tolerance=args.tolerance,
        overwrite=args.overwrite,
        compact_blocks=args.compact_blocks,
        packed_blocks=args.packed_blocks,
        lora=[parse_lora_argument(text) for text in args.lora],
        lora_slots=merge_slot_specs([parse_slot_argument(text) for text in args.lora_slots]),
        quantize=args.quantize,
        block_size=args.block_size,
        int4_lm_head=args.int4_lm_head,
    )
    return 0
