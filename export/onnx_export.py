"""Export a checkpoint to a model package: reference model -> ONNX graph with KV-cache I/O -> proof
against PyTorch -> package folder (see runtime/contract.py for what the folder holds).

    export_package("models/shakespeare", "out/fp32")   # a Hugging Face-layout folder of a known family

Two graphs: "fused" (export/graph.py: ONNX Runtime's GroupQueryAttention on a shared KV buffer, the
default) and "standard" (export/traced.py: standard ONNX ops only, for other runtimes). After writing,
export proves the graph (export/parity.py) and fails above the tolerance.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from edgelm import __version__
from edgelm.onnxfile import save_model

from ..package_writer import StagedOutput, list_files, write_json
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
    genai_config,
)
from ..runtime.files import check_file, kind_of
from ..runtime.package import file_sha256
from .checkpoint import CheckpointError, check_finite, combined_hash, read_config, source_hashes, tokenizer_files
from .decoder import Decoder
from .families import Blocks, Family, checked_tokens, family_for
from .gguf_blocks import LAYOUT_NAMES as LAYOUT
from .graph import build_fused_graph
from .hf_checkpoint import read_extras
from .parity import check_parity, check_parity_shared
from .tokenizer_config import tokenizer_config
from .traced import trace_graph

PARITY_TOLERANCE = 1e-4
# Kept GGUF blocks with float activations: ONNX Runtime's 4-bit kernel sums in its own order, a few times
# further from float64 than a float MatMul (1.1e-4 on SmolLM2-135M).
KEPT_FLOAT_TOLERANCE = 1e-3
# MatMulNBits at accuracy_level 4 quantizes each block of activations to int8 at run time, which PyTorch does
# not: on SmolLM2-135M (logits up to ~35) that moved logits by up to about 2. The check then
# guards against a wrong graph (a wrong weight scrambles the logits), not against rounding.
INT8_ACTIVATION_TOLERANCE = 4.0
DEFAULT_OPSET = 17
# "fused": ONNX Runtime's GroupQueryAttention and a shared KV buffer (export/graph.py), the fast graph;
# "standard": the traced graph of standard ONNX ops only, for runtimes other than ONNX Runtime.
ATTENTION_KINDS = ("fused", "standard")

Progress = Callable[[str], None]


@dataclass
class Source:
    """What export reads: the reference model and what the package carries beside it."""

    model: torch.nn.Module  # eval mode, fp32, with the shared forward signature (export/parity.py)
    family: Family
    tokens: dict  # bos_token_id, eos_token_ids, pad_token_id
    name: str  # the checkpoint's name, for the manifest
    sha256: str  # identifies what was exported: the file's, or combined_hash over a folder's files
    hashes: dict[str, str]  # sha256 of every file export read, by name in the folder (or the GGUF file's name)
    files: dict[str, Path] = field(default_factory=dict)  # package file name -> file to copy (tokenizer)
    texts: dict[str, str] = field(default_factory=dict)  # package file name -> contents to write
    chat_template: str | None = None
    blocks: Blocks | None = None  # a GGUF file's own MatMulNBits blocks by tensor name (GGUFModel.matmul_nbits)
    quant_types: dict[str, str] = field(default_factory=dict)  # tensor name -> GGUF type ("Q4_1", "F32", ...)


def check_tokenizer_file(path: Path, vocab_size: int) -> None:
    """CheckpointError unless `path` loads as the runtime will load it, with no more tokens than the embedding has
    rows (fewer is normal: padding rows). Either way the package would never load."""
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # `tokenizers` raises its own plain Exception
        reason = str(e).splitlines()[0] if str(e) else repr(e)
        raise CheckpointError(f"{path} does not load as a tokenizer: {reason}") from None
    if size > vocab_size:
        raise CheckpointError(f"{path} has {size} tokens but the model's embedding only {vocab_size} rows")


def open_folder(folder: Path) -> Source:
    """A Hugging Face-layout checkpoint folder: config.json names the family."""
    hf_config = read_config(folder)
    family = family_for(hf_config.get("model_type"))
    model = family.load(folder)
    hashes = source_hashes(folder)
    files = tokenizer_files(folder)  # each one text (UTF-8) or JSON first: the errors name the file's kind
    if TOKENIZER_FILE in files:
        check_tokenizer_file(files[TOKENIZER_FILE], model.config.vocab_size)
    return Source(
        model=model,
        family=family,
        tokens=family.tokens(folder, model),
        name=folder.resolve().name,
        sha256=combined_hash(hashes),
        hashes=hashes,
        # the package writes its own tokenizer_config.json (export/tokenizer_config.py)
        files={n: p for n, p in files.items() if n != TOKENIZER_CONFIG_FILE},
        chat_template=read_extras(folder)["chat_template"],
    )


def open_gguf(path: Path) -> Source:
    """A GGUF file (llama.cpp's format): weights dequantized to fp32, tokenizer.json built from its
    tokenizer metadata, its chat template kept (export/gguf.py)."""
    from .gguf import read_gguf

    gguf = read_gguf(path)
    family = family_for(gguf.hf_config.get("model_type"))
    state = {name: torch.from_numpy(gguf.tensor(name)) for name in gguf.tensor_names}
    model = family.build(gguf.hf_config, state)
    del state
    tokens = checked_tokens(model.config.vocab_size, gguf.bos_token_id, gguf.eos_token_ids, gguf.pad_token_id)
    sha256 = file_sha256(path)
    return Source(
        model=model,
        family=family,
        tokens=tokens,
        name=path.name,
        sha256=sha256,
        hashes={path.name: sha256},
        texts={TOKENIZER_FILE: gguf.tokenizer_json},
        chat_template=gguf.chat_template,
        blocks=gguf.matmul_nbits,
        quant_types={name: gguf.quant_type(name) for name in gguf.tensor_names},
    )


def open_source(path: str | Path) -> Source:
    """A checkpoint folder or a .gguf file."""
    path = Path(path)
    kind = kind_of(path)
    if path.suffix.lower() == ".gguf" and kind != "a folder":
        check_file(path, "GGUF file", error=CheckpointError)  # missing, or a FIFO or device: said so, not opened
    elif kind not in (None, "a folder", "a regular file"):
        raise CheckpointError(f"{path} is {kind}; a checkpoint is a folder or a .gguf file")
    if kind == "a regular file":
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{path} is a file but not a GGUF file; a checkpoint is a folder or a .gguf file")
        return open_gguf(path)
    return open_folder(path)


def _untie(model: torch.nn.Module) -> None:
    """Give the LM head its own copy of the embedding (for runtimes or tools that want two tables)."""
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # tied: the embedding
    model.config.tie_word_embeddings = False


FLOAT_TYPES = ("F32", "F16", "BF16")


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
    linears = [linear for layer in decoder.layers for linear in (layer.qkv, layer.attention_out, layer.up, layer.down)]
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
    bits = [nbits.bits for nbits in kept]
    tables = head is not None or decoder.embedding_nbits is not None
    precision = "int4" if 4 in bits else "int8" if bits or tables else "fp32"
    return precision, recipe


def dequantized_tensors(source: Source) -> list[str]:
    """Quantized tensors with no exact MatMulNBits form (the IQ and TQ families: codebook values): float."""
    return [f"{name} ({kind})" for name, kind in source.quant_types.items() if kind not in (*FLOAT_TYPES, *LAYOUT)]


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
    keep_gguf_quantization: bool = False,
    accuracy_level: int = 4,
    tolerance: float | None = None,
    overwrite: bool = False,
    progress: Progress = print,
) -> dict:
    """Checkpoint folder or GGUF file -> model package folder. Writes to a temporary folder beside `out_dir`
    and renames it into place at the end, so a failed export leaves no half-written package. Returns the
    manifest (as JSON). attention: "fused" (the default) or "standard"; last_token_logits applies to
    "standard" (the fused graph takes the number of positions to keep as an input). A GGUF file's quantized
    weights stay in their own blocks (MatMulNBits nodes, run with `accuracy_level`: 4 quantizes activations
    to int8, 0 keeps them float; export/gguf_blocks.py) unless `dequantize` asks for an fp32 package or the
    graph is "standard"; keep_gguf_quantization (the old opt-in) insists on it. tolerance: the largest |logit
    difference| allowed; None: PARITY_TOLERANCE, or INT8_ACTIVATION_TOLERANCE for kept blocks at
    accuracy_level 4."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTION_KINDS)}")
    if attention == "fused" and last_token_logits:
        raise ValueError(f"last_token_logits is for the standard graph; the fused graph takes {LOGITS_TO_KEEP}")
    fused = attention == "fused"
    if keep_gguf_quantization and dequantize:
        raise ValueError("keep_gguf_quantization and dequantize contradict each other; choose one")
    if keep_gguf_quantization and not fused:
        raise ValueError("keeping a GGUF file's quantization needs the fused graph")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise ValueError(f"accuracy_level must be 0, 1, 2, 3 or 4, got {accuracy_level}")
    staged = StagedOutput(out_dir, inputs=[checkpoint], overwrite=overwrite)  # refuses unsafe outputs now
    progress(f"[1/4] loading checkpoint {checkpoint}")
    source = open_source(checkpoint)
    if keep_gguf_quantization and source.blocks is None:
        raise ValueError(f"{checkpoint} is not a GGUF file: there is no GGUF quantization to keep")
    model, config = source.model, source.model.config
    check_finite(model, source.name)
    if untie and config.tie_word_embeddings:
        _untie(model)
    parameters = sum(p.numel() for p in model.parameters())
    progress(
        f"      {source.family.name}: {parameters / 1e6:.1f}M parameters, {config.n_layer} layers, "
        f"context {config.n_positions}"
    )
    blocks = source.blocks if fused and not dequantize else None
    decoder = source.family.decoder(model, blocks=blocks) if fused else None
    position_ids = not fused or decoder.position_table is not None
    manifest = build_manifest(
        source, attention=attention, opset=opset, last_token_logits=last_token_logits, position_ids=position_ids
    )
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
    elif source.blocks is not None and any(kind not in FLOAT_TYPES for kind in source.quant_types.values()):
        progress("      GGUF blocks dequantized to fp32 (" + ("--dequantize" if fused else "standard graph") + ")")
    unkept = dequantized_tensors(source)
    if unkept:
        progress(f"      dequantized to fp32, no exact MatMulNBits form: {', '.join(unkept)}")
    int8_activations = keep and accuracy_level == 4
    if tolerance is None:
        tolerance = KEPT_FLOAT_TOLERANCE if keep else PARITY_TOLERANCE
        tolerance = INT8_ACTIVATION_TOLERANCE if int8_activations else tolerance

    with staged as staging:
        progress(
            f"[2/4] exporting ONNX ({attention} attention, opset {opset}"
            f"{', last-token logits' if last_token_logits else ''})"
        )
        if fused:
            graph, weights = build_fused_graph(decoder, manifest.io, opset=opset, accuracy_level=accuracy_level)
            del decoder  # save_model drops each array once written: its float copies go one by one
            manifest.export["external_data"] = save_model(graph, staging / MODEL_FILE, weights=weights)
        else:
            graph = trace_graph(model, opset=opset, last_token_logits=last_token_logits)
            manifest.export["external_data"] = save_model(graph, staging / MODEL_FILE)
        del graph
        progress("[3/4] checking ONNX Runtime against PyTorch (prompt + 5 decode steps)")
        if fused:
            max_diff = check_parity_shared(model, staging / MODEL_FILE, prepacking=keep)
        else:
            max_diff = check_parity(model, staging / MODEL_FILE, last_token_logits=last_token_logits)
        if max_diff == float("inf"):  # PyTorch's were finite (parity.py raises otherwise): float32 overflowed
            raise RuntimeError(
                "ONNX Runtime's logits are not finite (NaN or inf) on the export check's prompt while PyTorch's "
                "are: the package could not generate"
            )
        progress(f"      max |logit difference| = {max_diff:.2e} (tolerance {tolerance:.0e})")
        if not max_diff <= tolerance:
            raise RuntimeError(
                f"ONNX Runtime and PyTorch disagree: max |logit difference| {max_diff:.2e} > {tolerance:.0e}"
            )
        manifest.parity = {"max_abs_logit_diff": max_diff, "tolerance": tolerance, "decode_steps": 5, "batch": 2}
        manifest.parity["reference"] = "PyTorch float64" if fused else "PyTorch float32"
        if int8_activations:
            manifest.parity["activations"] = "int8 (MatMulNBits accuracy_level 4)"

        progress("[4/4] writing package files")
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
        write_json(staging / MANIFEST_FILE, manifest.to_json())
    size = sum(f["bytes"] for f in manifest.files.values())
    progress(f"wrote {out_dir} ({size / 1e6:.1f} MB)")
    return manifest.to_json()
