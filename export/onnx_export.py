"""Export a checkpoint to a model package: reference model -> ONNX graph with KV-cache I/O -> proof
against PyTorch -> package folder (see runtime/contract.py for what the folder holds).

    export_package("models/shakespeare", "out/fp32")   # a Hugging Face-layout folder of a known family

Two graphs: "fused" (export/graph.py: ONNX Runtime's GroupQueryAttention on a shared KV buffer, the
default) and "standard" (export/traced.py: standard ONNX ops only, for other runtimes). After writing,
export proves the graph (export/parity.py) and fails above the tolerance. What export reads (a folder or a
GGUF file) is opened by export/source.py.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from tqdm import tqdm

from edgelm.quantize.modes import EXPORTED, MODES
from edgelm.quantize.weight_only import ACCURACY_LEVEL
from edgelm.writers.onnxfile import save_model, stored_bytes
from edgelm.writers.package_writer import StagedOutput, list_files, write_json
from edgelm.writers.version import __version__

from ..runtime.contract import (
    CHAT_TEMPLATE_FILE,
    GENAI_CONFIG_FILE,
    LOGITS_TO_KEEP,
    MANIFEST_FILE,
    MODEL_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    Architecture,
    IONames,
    Manifest,
    Tokens,
    cache_records,
    genai_config,
)
from ..runtime.errors import PackageError
from ..runtime.model import package_tokenizer
from ..runtime.package import read_package
from ..runtime.packed import FALLBACK_MODEL, uses_packed
from .block_quantize import half_precision, quantize_decoder
from .checkpoint import check_finite
from .decoder import Decoder
from .defaults import (
    ATTENTION_KINDS,
    DEFAULT_OPSET,
    FP16_TOLERANCE,
    INT8_MAX_KL,
    INT8_MEAN_KL,
    KEPT_FLOAT_TOLERANCE,
    LOGIT_PEAK,
    PARITY_TOLERANCE,
    WINDOW_SLACK,
)
from .families import Blocks
from .gguf_blocks import FLOAT_TYPES, KEPT_TYPE_NAMES
from .graph import build_fused_graph
from .lazy_weights import is_lazy, lazy_parameter, materialize
from .lora import SlotSpec, add_slots, apply_lora, finish_lora, lora_record, plan_slots, read_adapters
from .packed_blocks import Fallback
from .parity import check_parity, check_parity_int8, check_parity_shared, check_window, twin_of, window_rows
from .source import Source, open_source
from .tokenizer_config import tokenizer_config
from .traced import state_layout, trace_graph

Progress = Callable[[str], None]


def _bar(total: int, what: str, *, show: bool | None, unit: str = "it") -> tqdm:
    """A progress bar on stderr for a long step (per tensor, layer or byte), under the step's own line; show
    None: when stderr is a terminal (a log, or a caller reading one error line, gets none)."""
    return tqdm(
        total=total, desc=f"      {what}", unit=unit, unit_scale=unit == "B", file=sys.stderr, mininterval=1.0,
        disable=None if show is None else not show, leave=False, dynamic_ncols=True,
    )  # fmt: skip


def _untie(model: torch.nn.Module) -> None:
    """Give the LM head its own copy of the embedding (for runtimes or tools that want two tables)."""
    weight = model.lm_head.weight  # tied: the embedding
    copy = lazy_parameter(weight.loader) if is_lazy(weight) else torch.nn.Parameter(weight.detach().clone())
    model.lm_head.weight = copy
    model.config.tie_word_embeddings = False


FLOAT_TYPE_NAMES = tuple(kind.name for kind in FLOAT_TYPES)


def _group(name: str) -> str:
    """A tensor's group in the manifest: its name without the layer: "self_attn.q_proj", "embed_tokens"."""
    parts = name.removesuffix(".weight").split(".")
    if "layers" in parts or "h" in parts:  # model.layers.N.x / transformer.h.N.x
        return ".".join(parts[parts.index("layers" if "layers" in parts else "h") + 2 :])
    return ".".join(parts[1:] if parts[0] in ("model", "transformer") else parts)


def gguf_types(quant_types: dict[str, str]) -> dict[str, dict[str, int]]:
    """Per tensor group, how many of its tensors each GGUF type holds: {"self_attn.v_proj": {"Q8_0": 15,
    "Q6_K": 15}, ...}; 1-D tensors (norms, biases) left out."""
    groups: dict[str, dict[str, int]] = {}
    for name, kind in quant_types.items():
        if name.endswith(".weight") and "norm" not in name and not name.endswith(("ln_1.weight", "ln_2.weight")):
            counts = groups.setdefault(_group(name), {})
            counts[kind] = counts.get(kind, 0) + 1
    return groups


def kept_recipe(decoder: Decoder, source: Source, *, accuracy_level: int) -> tuple[str, dict]:
    """(precision, recipe) of a package whose linears keep the GGUF file's own blocks where they can."""
    linears = [linear for layer in decoder.layers for linear in layer.linears]
    kept = [linear.nbits for linear in linears if linear.nbits is not None]
    head = decoder.head_nbits
    types: dict[str, int] = {}
    for kind in source.quant_types.values():
        types[kind] = types.get(kind, 0) + 1
    recipe = {
        "mode": "gguf",
        "op": "MatMulNBits",
        "block_sizes": sorted({nbits.block_size for nbits in [*kept, *([head] if head else [])]}),
        "accuracy_level": accuracy_level,
        "types": types,  # GGUF tensor type -> number of tensors, over the whole file
        "gguf_types": gguf_types(source.quant_types),  # per tensor group
        "kept_linears": len(kept),
        "kept_bits": {f"int{b}": sum(n.bits == b for n in kept) for b in sorted({n.bits for n in kept})},
        "float_linears": len(linears) - len(kept),  # a float part (F16, BF16, F32) or a type with no exact blocks
        "lm_head": f"int{head.bits}" if head is not None else "fp32",
    }
    if not decoder.tied:
        table = decoder.embedding_nbits
        recipe["embedding"] = f"int{table.bits}" if table is not None else "fp32"
    if decoder.per_layer_dim:  # Gemma 4's per-layer input table
        table = decoder.per_layer_embedding_nbits
        recipe["per_layer_embedding"] = f"int{table.bits}" if table is not None else "fp32"
    bits = [nbits.bits for nbits in kept]
    tables = head is not None or decoder.embedding_nbits is not None
    precision = "int4" if 4 in bits else "int8" if bits or tables else "fp32"
    return precision, recipe


def dequantized_tensors(source: Source) -> list[str]:
    """Quantized tensors with no exact MatMulNBits form (the IQ and TQ families: codebook values): float."""
    return [
        f"{name} ({kind})"
        for name, kind in source.quant_types.items()
        if kind not in (*FLOAT_TYPE_NAMES, *KEPT_TYPE_NAMES)
    ]


def build_manifest(
    source: Source, *, attention: str, opset: int, last_token_logits: bool, position_ids: bool
) -> Manifest:
    """The fp32 package's manifest, before its files are listed. position_ids: whether the graph takes
    positions (a rotary fused graph derives them from each row's length)."""
    config, fused = source.model.config, attention == "fused"
    io = IONames(
        position_ids=IONames.position_ids if position_ids else None,
        logits_to_keep=LOGITS_TO_KEEP if fused else None,
        kv_cache="shared_buffer" if fused else "concat",
    )
    architecture = Architecture(
        type=source.family.name,
        vocab_size=config.vocab_size,
        context_length=config.n_positions,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_kv_head=config.n_kv_head,
        head_dim=config.head_dim,
        details=source.family.details(source.model),
        genai_type=source.family.genai_type,
        **cache_records(state_layout(source.model)),
    )
    tokens = Tokens(
        file=TOKENIZER_FILE if TOKENIZER_FILE in {*source.files, *source.texts} else None,
        bos_token_id=source.tokens["bos_token_id"],
        eos_token_ids=source.tokens["eos_token_ids"],
        pad_token_id=source.tokens["pad_token_id"],
        chat_template=CHAT_TEMPLATE_FILE if source.chat_template else None,
    )
    return Manifest(
        architecture=architecture,
        io=io,
        tokenizer=tokens,
        model_file=MODEL_FILE,
        export={
            "opset": opset,
            "attention": attention,
            "last_token_logits": last_token_logits,
            "tied_embedding_bytes_saved": 4 * config.vocab_size * config.n_embd if config.tie_word_embeddings else 0,
            "torch": torch.__version__,
            "onnx": onnx.__version__,
        },
        source={"checkpoint": source.name, "sha256": source.sha256, "files": source.hashes},
        created_by=f"edgelm {__version__}",
        sampling=source.sampling,
    )


def export_package(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    attention: str = "fused",
    last_token_logits: bool = False,
    untie: bool = False,
    dequantize: bool = False,
    accuracy_level: int = 4,
    tolerance: float | None = None,
    overwrite: bool = False,
    compact_blocks: bool = False,
    packed_blocks: bool = False,
    lora: list[tuple[str | Path, float]] = (),
    lora_slots: SlotSpec | None = None,
    quantize: str | None = None,
    block_size: int = 32,
    int4_lm_head: str = "int8",
    progress: Progress = print,
    bars: bool | None = None,
) -> dict:
    """Checkpoint folder or GGUF file -> model package folder, staged beside `out_dir` and renamed into place, so a
    failed export leaves nothing half-written; returns the manifest (JSON). attention: "fused" or "standard"
    (last_token_logits is the standard graph's). A GGUF file's quantized blocks are kept (MatMulNBits run at
    `accuracy_level`: 4 int8 activations, 0 float) unless `dequantize` or the standard graph, as MatMulNBits' own
    arrays, or with compact_blocks as bit planes ONNX Runtime unpacks at load (export/compact_blocks.py), or with
    packed_blocks as the file's own rows under edgelm's native ops, with a fallback graph beside (runtime/packed.py).
    tolerance: the largest |logit difference| (None: by precision). lora: PEFT adapters merged, lora_slots:
    run-time slots (export/lora.py). quantize: "int4" or "int8-weight-only", written block by block with no fp32 package
    (export/block_quantize.py; block_size and int4_lm_head as quantize's). bars: progress bars on stderr for
    the long steps (reading, writing and proving, tensor by tensor or layer by layer), beside the `progress`
    lines; None: when stderr is a terminal."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    _check_options(
        attention=attention,
        last_token_logits=last_token_logits,
        accuracy_level=accuracy_level,
        lora_slots=lora_slots,
        quantize=quantize,
    )
    staged = StagedOutput(out_dir, inputs=[checkpoint], overwrite=overwrite)  # refuses unsafe outputs now
    adapters = read_adapters(list(lora))
    source = _load(checkpoint, untie=untie, progress=progress, bars=bars)
    apply_lora(source, adapters, keeps_blocks=attention == "fused" and not dequantize, progress=progress)
    plan = _plan(
        source, attention=attention, opset=opset, last_token_logits=last_token_logits, dequantize=dequantize,
        accuracy_level=accuracy_level, tolerance=tolerance, progress=progress,
        quantize=None if quantize is None else dict(mode=quantize, block_size=block_size, lm_head=int4_lm_head),
    )  # fmt: skip
    packed = packed_blocks and plan.keep and not plan.quantized and plan.fused
    manifest = _add_storage_and_lora(
        plan, source, compact_blocks=compact_blocks, packed=packed, adapters=adapters, slots=lora_slots
    )
    with staged as staging:
        _write_graph(
            plan, source.model, staging / MODEL_FILE, accuracy_level=accuracy_level, compact=compact_blocks,
            packed=packed, progress=progress, bars=bars,
        )  # fmt: skip
        manifest.parity = _prove(plan, source.model, staging / MODEL_FILE, progress=progress, bars=bars)
        progress("[4/4] writing package files")
        _write_files(staging, manifest, source)
        _open_written(staging)
    size = sum(f["bytes"] for f in manifest.files.values())
    progress(f"wrote {out_dir} ({size / 1e6:.1f} MB)")
    return manifest.to_json()


def _add_storage_and_lora(
    plan: _Plan, source: Source, *, compact_blocks: bool, packed: bool, adapters: list, slots: SlotSpec | None
) -> Manifest:
    """The plan's manifest with how kept blocks are stored and the LoRA record; run-time slots join the Decoder."""
    manifest = plan.manifest
    if plan.keep:  # compact: ONNX Runtime computes the blocks at load, by constant folding (export/compact_blocks.py)
        manifest.recipe["storage"] = "compact" if compact_blocks and not plan.quantized else "plain"
        if packed:  # the file's rows under ai.edgelm ops; the fallback graph beside (runtime/packed.py)
            manifest.recipe.update(storage="packed", op="MatMulPacked", fallback=FALLBACK_MODEL)
    planned = plan_slots(source.model, source.family, slots) if slots is not None else None
    if planned is not None:
        add_slots(plan.decoder, planned)
    manifest.lora = lora_record(adapters, planned)
    return manifest


@dataclass
class _Plan:
    """What export settles before it writes anything: the manifest (precision and recipe included), the fused
    graph's Decoder, whether the graph keeps a GGUF file's own blocks, and the parity tolerance."""

    manifest: Manifest
    decoder: Decoder | None  # the fused graph's; None for the standard graph, and once the graph is built
    keep: bool
    tolerance: float
    quantized: bool = False  # export --quantize: blocks of its own rounding, stored plain
    half: bool = False  # export --quantize fp16: the graph converted to float16 as its weights are written

    @property
    def fused(self) -> bool:
        return self.manifest.export["attention"] == "fused"

    @property
    def int8(self) -> bool:
        """Whether the graph's MatMulNBits round activations to int8 (accuracy level 4): the two-part proof."""
        return self.fused and self.keep and (self.quantized or self.manifest.recipe.get("accuracy_level") == 4)


def _plan(
    source: Source,
    *,
    attention: str,
    opset: int,
    last_token_logits: bool,
    dequantize: bool,
    accuracy_level: int,
    tolerance: float | None,
    progress: Progress,
    quantize: dict | None = None,
) -> _Plan:
    """The fused graph's Decoder (with the GGUF blocks it keeps), the manifest and the tolerance (None: the
    default for what the graph keeps)."""
    fused = attention == "fused"
    blocks = source.blocks if fused and not dequantize and quantize is None else None
    decoder = source.family.decoder(source.model, blocks=blocks) if fused else None
    position_ids = not fused or decoder.position_table is not None
    manifest = build_manifest(
        source, attention=attention, opset=opset, last_token_logits=last_token_logits, position_ids=position_ids
    )
    if quantize is not None and quantize["mode"] == "fp16":
        manifest.precision = MODES["fp16"].precision
        progress("      converting to float16 as written (quantize --mode fp16's conversion)")
        tolerance = FP16_TOLERANCE if tolerance is None else tolerance
        return _Plan(manifest=manifest, decoder=decoder, keep=False, tolerance=tolerance, half=True)
    if quantize is not None:
        manifest.recipe = quantize_decoder(decoder, source.model, **quantize)
        manifest.precision = MODES[quantize["mode"]].precision
        progress(f"      quantizing as written: {manifest.recipe['ops']}, blocks of {quantize['block_size']}")
        tolerance = KEPT_FLOAT_TOLERANCE if tolerance is None else tolerance  # the float twin's (export/parity.py)
        return _Plan(manifest=manifest, decoder=decoder, keep=True, tolerance=tolerance, quantized=True)
    keep = _keep_blocks(manifest, decoder, source, blocks=blocks, accuracy_level=accuracy_level, progress=progress)
    if tolerance is None:  # at accuracy level 4, the float twin's (export/parity.py Int8Proof)
        tolerance = KEPT_FLOAT_TOLERANCE if keep else PARITY_TOLERANCE
    return _Plan(manifest=manifest, decoder=decoder, keep=keep, tolerance=tolerance)


def _write_graph(
    plan: _Plan,
    model: torch.nn.Module,
    path: Path,
    *,
    accuracy_level: int,
    compact: bool,
    packed: bool = False,
    progress: Progress,
    bars: bool | None,
) -> None:
    """Step 2: the fused graph built from the plan's Decoder (which it then lets go; compact: its kept blocks as
    bit planes), or the standard graph traced from the model; saved with its weights beside it."""
    manifest = plan.manifest
    opset, last_token_logits = manifest.export["opset"], manifest.export["last_token_logits"]
    progress(
        f"[2/4] exporting ONNX ({manifest.export['attention']} attention, opset {opset}"
        f"{', last-token logits' if last_token_logits else ''})"
    )
    if plan.fused:
        accuracy_level = ACCURACY_LEVEL if plan.quantized else accuracy_level  # the recipe's: int8 activations
        # packed: the fallback graph is built while the Decoder is at hand, saved once model.onnx is
        fallback = Fallback(plan.decoder, manifest.io, opset=opset, accuracy_level=accuracy_level) if packed else None
        graph, weights = build_fused_graph(
            plan.decoder,
            manifest.io,
            opset=opset,
            accuracy_level=accuracy_level,
            compact=compact and not plan.quantized and not packed,
            packed=packed,
        )
        plan.decoder = None  # save_model drops each array once written: its float copies go one by one
        if plan.half:
            manifest.recipe = half_precision(graph, weights)
            manifest.io.kv_dtype = "float16"
        with _bar(stored_bytes(weights), "writing weights", show=bars, unit="B") as bar:
            manifest.export["external_data"] = save_model(graph, path, weights=weights, on_write=bar.update)
        if fallback is not None:
            fallback.save(path)
    else:
        materialize(model)  # tracing runs the whole model in fp32
        graph = trace_graph(model, io=manifest.io, opset=opset, last_token_logits=last_token_logits)
        manifest.export["external_data"] = save_model(graph, path)


def _check_options(
    *,
    attention: str,
    last_token_logits: bool,
    accuracy_level: int,
    lora_slots: SlotSpec | None,
    quantize: str | None = None,
) -> None:
    """ValueError for options that contradict each other or are out of range (export_package's)."""
    if quantize is not None and quantize not in EXPORTED:
        raise ValueError(f"unknown export quantization {quantize!r}; valid: {', '.join(EXPORTED)}")
    if quantize is not None and attention != "fused":
        raise ValueError("--quantize writes the fused graph's MatMulNBits blocks: use --attention fused")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTION_KINDS)}")
    if attention == "fused" and last_token_logits:
        raise ValueError(f"last_token_logits is for the standard graph; the fused graph takes {LOGITS_TO_KEEP}")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise ValueError(f"accuracy_level must be 0, 1, 2, 3 or 4, got {accuracy_level}")
    if lora_slots is not None and attention != "fused":
        raise ValueError("LoRA slots need the fused graph (--attention fused)")


def _load(checkpoint: Path, *, untie: bool, progress: Progress, bars: bool | None) -> Source:
    """Step 1: the checkpoint opened and checked (finite weights, read one tensor at a time), its head untied if
    asked."""
    progress(f"[1/4] loading checkpoint {checkpoint}")
    source = open_source(checkpoint)
    model, config = source.model, source.model.config
    with _bar(len(list(model.parameters())), "checking weights", show=bars, unit="tensor") as bar:
        check_finite(model, source.name, on_tensor=bar.update)
    if untie and config.tie_word_embeddings:
        _untie(model)
    parameters = sum(p.numel() for p in model.parameters())
    progress(
        f"      {source.family.name}: {parameters / 1e6:.1f}M parameters, {config.n_layer} layers, "
        f"context {config.n_positions}"
    )
    return source


def _keep_blocks(
    manifest: Manifest,
    decoder: Decoder | None,
    source: Source,
    *,
    blocks: Blocks | None,
    accuracy_level: int,
    progress: Progress,
) -> bool:
    """Whether the graph keeps a GGUF file's own blocks (MatMulNBits; `blocks`: those the decoder was given);
    if so the manifest's precision and recipe say which. Reports what was dequantized instead."""
    keep = False
    if blocks is not None:
        precision, recipe = kept_recipe(decoder, source, accuracy_level=accuracy_level)
        tables = (decoder.head_nbits, decoder.embedding_nbits)
        keep = recipe["kept_linears"] > 0 or tables != (None, None)  # an F32 / F16 file has nothing to keep
        if keep:
            manifest.precision, manifest.recipe = precision, recipe
            progress(
                f"      kept GGUF blocks: {recipe['kept_linears']} linears as MatMulNBits "
                f"({', '.join(f'{n} {b}' for b, n in recipe['kept_bits'].items()) or 'none'}), "
                f"{recipe['float_linears']} float, LM head {recipe['lm_head']}"
                + (f", embedding {recipe['embedding']}" if "embedding" in recipe else "")
            )
    elif source.blocks is not None and any(kind not in FLOAT_TYPE_NAMES for kind in source.quant_types.values()):
        progress(
            "      GGUF blocks dequantized to fp32 ("
            + ("--dequantize" if decoder is not None else "standard graph")
            + ")"
        )
    unkept = dequantized_tensors(source)
    if unkept:
        progress(f"      dequantized to fp32, no exact MatMulNBits form: {', '.join(unkept)}")
    return keep


def _prove(plan: _Plan, model: torch.nn.Module, onnx_path: Path, *, progress: Progress, bars: bool | None) -> dict:
    """Step 3: ONNX Runtime against PyTorch (export/parity.py); RuntimeError when they disagree. Returns the
    manifest's parity record."""
    progress("[3/4] checking ONNX Runtime against PyTorch (prompt + 5 decode steps)")
    io, tolerance, window = plan.manifest.io, plan.tolerance, None
    if plan.int8:
        return _prove_int8(plan, model, onnx_path, progress=progress, bars=bars)
    if plan.fused:
        steps = 6 + model.config.n_layer  # 6 ONNX Runtime runs, then the reference's one pass layer by layer
        with _bar(steps, "ONNX Runtime, then PyTorch float64", show=bars, unit="step") as bar:
            max_diff = check_parity_shared(model, onnx_path, io=io, prepacking=plan.keep, on_step=bar.update)
        window = _window_check(model, onnx_path, io, tolerance=tolerance, progress=progress)
    else:
        last_token_logits = plan.manifest.export["last_token_logits"]
        max_diff = check_parity(model, onnx_path, io=io, last_token_logits=last_token_logits)
    _refuse_non_finite(max_diff)
    verdict = "passed" if max_diff <= tolerance else "FAILED"
    progress(f"      max |logit difference| = {max_diff:.2e}, allowed {tolerance:.0e}: {verdict}")
    if not max_diff <= tolerance:
        raise RuntimeError(
            f"ONNX Runtime and PyTorch disagree: max |logit difference| {max_diff:.2e} > {tolerance:.0e}; "
            f"if the model is right, {_allow(max_diff)}"
        )
    parity = {"max_abs_logit_diff": max_diff, "tolerance": tolerance, "decode_steps": 5, "batch": 2}
    parity["reference"] = "PyTorch float64" if plan.fused else "PyTorch float32"
    if plan.fused and window is not None:
        parity["window"] = window
    if plan.half:
        parity["activations"] = "float16 (weights, activations, KV cache and logits)"
    return parity


def _prove_int8(plan: _Plan, model: torch.nn.Module, onnx_path: Path, *, progress: Progress, bars: bool | None) -> dict:
    """The int8-activation graph's two-part proof (export/parity.py Int8Proof): its float twin within the float
    tolerance, the graph as shipped within the KL bounds."""
    steps = 12 + model.config.n_layer  # 6 runs of each graph, then the reference's one pass layer by layer
    with _bar(steps, "ONNX Runtime (float twin, int8), then PyTorch float64", show=bars, unit="step") as bar:
        with float_twin(onnx_path) as twin:
            proof = check_parity_int8(model, onnx_path, twin, io=plan.manifest.io, on_step=bar.update)
            _refuse_non_finite(proof.float_max_abs)
            # float32's rounding is relative: the tolerance holds for logits of up to LOGIT_PEAK, and grows past it
            scale = max(1.0, proof.reference_peak / LOGIT_PEAK)
            tolerance = plan.tolerance * scale
            window = _window_check(
                model, twin, plan.manifest.io, tolerance=tolerance, progress=progress, twin_for=onnx_path
            )
    verdict = "passed" if proof.float_max_abs <= tolerance else "FAILED"
    progress(
        f"      float twin (accuracy level 0): max |logit difference| = {proof.float_max_abs:.2e}, allowed "
        f"{tolerance:.1e} (logits up to {proof.reference_peak:.0f}): {verdict}"
    )
    if not proof.float_max_abs <= tolerance:
        raise RuntimeError(
            f"ONNX Runtime and PyTorch disagree: with float activations the graph's max |logit difference| is "
            f"{proof.float_max_abs:.2e} > {tolerance:.1e}, so the graph is not the model; if the model is right, "
            f"{_allow(proof.float_max_abs / scale)}"
        )
    within = proof.mean_kl <= INT8_MEAN_KL and proof.max_kl <= INT8_MAX_KL
    progress(
        f"      int8 activations (accuracy level 4): mean KL {proof.mean_kl:.2e} nats (allowed {INT8_MEAN_KL:g}), "
        f"max {proof.max_kl:.2e} (allowed {INT8_MAX_KL:g}), top-1 agreement {100 * proof.top1_agreement:.0f}%, "
        f"max |logit difference| {proof.int8_max_abs:.2f}: {'passed' if within else 'FAILED'}"
    )
    if not within:
        raise RuntimeError(
            f"int8 activations change this model's next-token distributions too much: KL mean "
            f"{proof.mean_kl:.2e} / max {proof.max_kl:.2e} nats > {INT8_MEAN_KL:g} / {INT8_MAX_KL:g} (the graph "
            "itself is right: its float twin agrees with PyTorch); "
            + (
                "export_package(accuracy_level=0) keeps activations float, at a cost: its 8-bit blocks leave ONNX "
                "Runtime's fast path and decode many times slower (1.35 against 83 tokens/s on Gemma 3 270M)"
                if not plan.quantized
                else "a float package quantized with quantize(mode='int8-weight-only') keeps activations float"
            )
        )
    parity = {"max_abs_logit_diff": proof.float_max_abs, "tolerance": tolerance, "decode_steps": 5, "batch": 2}
    parity["reference"] = "PyTorch float64"
    parity["reference_peak"] = proof.reference_peak
    if window is not None:
        parity["window"] = window
    if plan.quantized:
        parity["reference_weights"] = "what the blocks hold (quantized and dequantized)"
    parity["activations"] = "int8 (MatMulNBits accuracy_level 4)"
    parity["compared"] = "the float twin (accuracy level 0) by max |logit difference|, the graph as shipped by KL"
    parity["int8"] = {
        "max_abs_logit_diff": proof.int8_max_abs,
        "mean_kl": proof.mean_kl,
        "max_kl": proof.max_kl,
        "mean_kl_bound": INT8_MEAN_KL,
        "max_kl_bound": INT8_MAX_KL,
        "top1_agreement": proof.top1_agreement,
        "positions": proof.positions,
    }
    return parity


def _window_check(
    model: torch.nn.Module,
    onnx_path: Path,
    io: IONames,
    *,
    tolerance: float,
    progress: Progress,
    twin_for: Path | None = None,
) -> dict | None:
    """Past the sliding window, where the model has windows short enough to prove (export/parity.py window_rows):
    its record for the manifest, or None; RuntimeError above WINDOW_SLACK times the tolerance (float32 sums over
    hundreds of positions round more than over a dozen). twin_for: the shipped graph `onnx_path` is the float twin
    of."""
    length = window_rows(model)
    if length is None:
        return None
    converted_for = None if twin_for is None else twin_of(twin_for)
    max_diff = check_window(model, onnx_path, io=io, length=length, converted_for=converted_for)
    _refuse_non_finite(max_diff)
    allowed = tolerance * WINDOW_SLACK
    verdict = "passed" if max_diff <= allowed else "FAILED"
    progress(
        f"      past the sliding window ({length} tokens): max |logit difference| = {max_diff:.2e}, allowed "
        f"{allowed:.1e}: {verdict}"
    )
    if not max_diff <= allowed:
        raise RuntimeError(
            f"ONNX Runtime and PyTorch disagree past the sliding window ({length} tokens, float activations): max "
            f"|logit difference| {max_diff:.2e} > {allowed:.1e}, so the graph's window is not the model's; if the "
            f"model is right, {_allow(max_diff / allowed * tolerance)}"
        )
    return {"tokens": length, "max_abs_logit_diff": max_diff, "tolerance": allowed}


def _refuse_non_finite(max_diff: float) -> None:
    if max_diff == float("inf"):  # PyTorch's were finite (parity.py raises otherwise): float32 overflowed
        raise RuntimeError(
            "ONNX Runtime's logits are not finite (NaN or inf) on the export check's prompt while PyTorch's "
            "are: the package could not generate"
        )


def _allow(max_diff: float) -> str:
    """What exports the package anyway, in the API's words (the CLI says them as flags: edgelm/cli/words.py)."""
    return f"export_package(tolerance={float(f'{max_diff * 1.25:.2g}'):g}) allows a difference up to that"


@contextmanager
def float_twin(onnx_path: Path) -> Iterator[Path]:
    """The graph beside `onnx_path` with every MatMulNBits at accuracy level 0 (float activations), reading the same
    weights file; removed afterwards. A packed package's twin is its fallback graph's (runtime/packed.py), whose
    arrays the proof converts from the blocks as the runtime does. Only the graph is rewritten: its external
    weights are not loaded."""
    source = onnx_path.with_name(FALLBACK_MODEL) if uses_packed(onnx_path) else onnx_path
    graph = onnx.load(str(source), load_external_data=False)
    for node in graph.graph.node:
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = 0
    twin = onnx_path.with_name(f".float-twin-{source.name}")
    onnx.save(graph, str(twin))
    try:
        yield twin
    finally:
        twin.unlink(missing_ok=True)


def _open_written(staging: Path) -> None:
    """Open the written package as the runtime will (manifest, every file's hash, the tokenizer against the
    model's vocabulary) before export reports it: one that cannot load is an export error, not a user's. The
    graph itself was opened by the proof."""
    try:
        package_tokenizer(read_package(staging))
    except PackageError as error:
        raise RuntimeError(f"export wrote a package that does not load, so it was not kept: {error}") from error


def _write_files(staging: Path, manifest: Manifest, source: Source) -> None:
    """Step 4: genai_config.json, the tokenizer and chat template, tokenizer_config.json, and last the manifest
    with every file's hash."""
    if manifest.architecture.genai_type is not None:  # a family onnxruntime-genai cannot run has none
        write_json(staging / GENAI_CONFIG_FILE, genai_config(manifest))
    for name, path in source.files.items():
        shutil.copyfile(path, staging / name)
    for name, text in source.texts.items():
        (staging / name).write_text(text, encoding="utf-8")
    if source.chat_template:
        (staging / CHAT_TEMPLATE_FILE).write_text(source.chat_template, encoding="utf-8")
    if manifest.tokenizer.file is not None:  # what onnxruntime-genai's tokenizer needs beside tokenizer.json
        tokenizer_json = (staging / manifest.tokenizer.file).read_text(encoding="utf-8")
        config = tokenizer_config(tokenizer_json, manifest, chat_template=source.chat_template)
        write_json(staging / TOKENIZER_CONFIG_FILE, config)
    manifest.files = list_files(staging)
    finish_lora(manifest)
    write_json(staging / MANIFEST_FILE, manifest.to_json())
