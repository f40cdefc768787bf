"""Export the reference model to ONNX with KV-cache inputs and outputs, and write a model package.

One graph serves the prompt (past length 0) and every decode step. Its I/O names are those of
Optimum and onnxruntime-genai, so the package interoperates:

    inputs   input_ids (B, T) int64, attention_mask (B, past + T) int64, position_ids (B, T) int64,
             past_key_values.{i}.key / .value (B, n_head, past, head_dim) float32
    outputs  logits (B, T, vocab) float32 [(B, 1, vocab) with last_token_logits],
             present.{i}.key / .value (B, n_head, past + T, head_dim) float32

The package folder (see runtime/package.py for the reader) holds model.onnx (+ model.onnx.data
when the weights pass 2 GB), genai_config.json, the tokenizer files and edgelm.json, the manifest.
After writing, export proves the graph: ONNX Runtime and PyTorch run the same prompt and decode
steps and the largest logit difference must stay under the tolerance.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from edgelm import __version__

from ..runtime.outputs import StagedOutput
from ..runtime.package import MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION, list_files, write_json
from .checkpoint import TOKENIZER_FILES, checkpoint_hash, load_checkpoint
from .fused import LOGITS_TO_KEEP, build_fused_graph, check_parity_shared
from .model import GPT

MODEL_FILE = "model.onnx"
EXTERNAL_DATA_FILE = "model.onnx.data"
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # bytes of initializers above which weights go to model.onnx.data
PARITY_TOLERANCE = 1e-4
DEFAULT_OPSET = 17
# "fused": ONNX Runtime's GroupQueryAttention and a shared KV buffer (export/fused.py), the fast graph;
# "standard": the traced graph of standard ONNX ops only, for runtimes other than ONNX Runtime.
ATTENTION_KINDS = ("fused", "standard")

Progress = Callable[[str], None]


def io_names(n_layer: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    for i in range(n_layer):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


class _FlatDecoder(torch.nn.Module):
    """The model with flat tensor inputs and outputs, in the order of io_names()."""

    def __init__(self, model: GPT, last_token_logits: bool):
        super().__init__()
        self.model = model
        self.last_token_logits = last_token_logits

    def forward(self, input_ids, attention_mask, position_ids, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        logits, present = self.model(
            input_ids, attention_mask, position_ids, past, last_token_logits=self.last_token_logits
        )
        return (logits, *[t for pair in present for t in pair])


def _share_tied_embedding(model: onnx.ModelProto) -> int:
    """Store a tied embedding once. The exporter folds the LM head's Transpose(wte) into a second
    initializer W^T (n_embd, vocab); we keep only W^T and let the embedding gather columns of it:
    Gather(W^T, ids, axis=1) -> (n_embd, B, T), then Transpose -> (B, T, n_embd). Returns the bytes saved."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits]
    matmuls = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    for gather in gathers:
        table = numpy_helper.to_array(inits[gather.input[0]])
        if table.ndim != 2:
            continue
        for matmul in matmuls:
            head = inits[matmul.input[1]]
            if tuple(head.dims) != table.shape[::-1] or not np.array_equal(numpy_helper.to_array(head), table.T):
                continue
            gathered = gather.output[0] + "_columns"
            columns = helper.make_node(
                "Gather", [matmul.input[1], gather.input[1]], [gathered], axis=1, name=gather.name + "_columns"
            )
            transpose = helper.make_node(
                "Transpose", [gathered], [gather.output[0]], perm=[1, 2, 0], name=gather.name + "_rows"
            )
            index = list(graph.node).index(gather)
            graph.node.remove(gather)
            graph.node.insert(index, transpose)
            graph.node.insert(index, columns)
            graph.initializer.remove(inits[gather.input[0]])
            return table.nbytes
    return 0


def export_onnx(
    model: GPT,
    path: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    last_token_logits: bool = False,
) -> dict:
    """Trace the model to ONNX at `path`; returns facts for the manifest."""
    path = Path(path)
    config = model.config
    model = model.eval()
    input_names, output_names = io_names(config.n_layer)
    # Trace with distinct sizes (batch 2, 3 new tokens, 5 past) so no axis is mistaken for another.
    batch, seq, past = 2, 3, 5
    dummy = [
        torch.randint(0, config.vocab_size, (batch, seq)),
        torch.ones(batch, past + seq, dtype=torch.long),
        torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous(),
    ]
    for _ in range(config.n_layer):
        dummy += [torch.zeros(batch, config.n_head, past, config.head_dim) for _ in range(2)]
    dynamic_axes = {
        "input_ids": {0: "batch_size", 1: "sequence_length"},
        "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
        "position_ids": {0: "batch_size", 1: "sequence_length"},
        "logits": {0: "batch_size", 1: "sequence_length"} if not last_token_logits else {0: "batch_size"},
    }
    for name in input_names[3:]:
        dynamic_axes[name] = {0: "batch_size", 2: "past_sequence_length"}
    for name in output_names[1:]:
        dynamic_axes[name] = {0: "batch_size", 2: "total_sequence_length"}

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
        traced_path = Path(tmp) / MODEL_FILE
        torch.onnx.export(
            _FlatDecoder(model, last_token_logits),
            tuple(dummy),
            str(traced_path),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
        onnx_model = onnx.load(str(traced_path))  # loads external data too, if the exporter wrote any

    saved = _share_tied_embedding(onnx_model) if config.tie_word_embeddings else 0
    facts = {"opset": opset, "last_token_logits": last_token_logits, "tied_embedding_bytes_saved": saved}
    return {**facts, **_save(onnx_model, path)}


def export_fused_onnx(model: GPT, path: str | Path, *, opset: int = DEFAULT_OPSET) -> dict:
    """Build the fused graph (export/fused.py) at `path`; returns facts for the manifest."""
    config = model.config
    saved = 4 * config.vocab_size * config.n_embd if config.tie_word_embeddings else 0  # one table, not two
    facts = {"opset": opset, "last_token_logits": False, "tied_embedding_bytes_saved": saved}
    return {**facts, **_save(build_fused_graph(model, opset=opset), path)}


def _save(onnx_model: onnx.ModelProto, path: Path) -> dict:
    """Write the model, its weights in model.onnx.data past the protobuf's 2 GB limit."""
    onnx_model.producer_name = "edgelm"
    onnx_model.producer_version = __version__
    weight_bytes = sum(numpy_helper.to_array(t).nbytes for t in onnx_model.graph.initializer)
    external = weight_bytes > EXTERNAL_DATA_THRESHOLD
    if external:
        onnx.save_model(
            onnx_model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=EXTERNAL_DATA_FILE,
            size_threshold=1024,
        )
    else:
        onnx.save_model(onnx_model, str(path))
    return {"external_data": EXTERNAL_DATA_FILE if external else None, "weight_bytes": weight_bytes}


def check_parity(
    model: GPT, onnx_path: str | Path, *, last_token_logits: bool = False, decode_steps: int = 5, seed: int = 0
) -> float:
    """Max |logit difference| between PyTorch and ONNX Runtime (CPU) over a batch-2, left-padded
    prompt and `decode_steps` one-token steps that feed each side its own cache. last_token_logits
    says how the graph was exported: its logits' second axis is symbolic, so it cannot be read off
    the session."""
    import onnxruntime as ort

    config = model.config
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")  # no second copy of the weights
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(seed)
    prompt_length = min(7, config.n_positions - decode_steps)
    input_ids = torch.randint(0, config.vocab_size, (2, prompt_length), generator=generator)
    attention_mask = torch.ones(2, prompt_length, dtype=torch.long)
    attention_mask[1, :2] = 0  # second row left-padded by two
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    def ort_feed(ids, mask, positions, past):
        feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": positions.numpy()}
        for i in range(config.n_layer):
            feed[f"past_key_values.{i}.key"] = past[2 * i]
            feed[f"past_key_values.{i}.value"] = past[2 * i + 1]
        return feed

    empty = np.zeros((2, config.n_head, 0, config.head_dim), dtype=np.float32)
    ort_past = [empty] * (2 * config.n_layer)
    torch_past = None
    worst = 0.0
    with torch.no_grad():
        for _step in range(decode_steps + 1):
            torch_logits, torch_present = model(
                input_ids, attention_mask, position_ids, torch_past, last_token_logits=last_token_logits
            )
            outputs = session.run(None, ort_feed(input_ids, attention_mask, position_ids, ort_past))
            # compare real (unpadded) positions only: padded query rows are never read
            real = attention_mask[:, -input_ids.shape[1] :].bool().numpy()
            if last_token_logits:
                real = real[:, -1:]
            assert outputs[0].shape == tuple(torch_logits.shape), (
                f"ONNX logits {outputs[0].shape} vs PyTorch {tuple(torch_logits.shape)}: compared without broadcasting"
            )
            diff = np.abs(outputs[0] - torch_logits.numpy())[real]
            worst = max(worst, float(diff.max()))
            torch_past, ort_past = torch_present, outputs[1:]
            next_ids = torch_logits[:, -1, :].argmax(-1, keepdim=True)
            input_ids = next_ids
            attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            position_ids = position_ids[:, -1:] + 1
    return worst


def genai_config(
    config, *, eos_token_id: int, bos_token_id: int, pad_token_id: int, shared_buffer: bool = False
) -> dict:
    """genai_config.json as onnxruntime-genai reads it. Its "gpt2" type expects the legacy combined
    "past_%d" cache of (2, B, nh, past, hs); the generic decoder-only path with separate key/value names
    runs our graph as it is, so we name a decoder-only type of the same family ("phi", GPT-2's
    tokenizer and a learned-free but otherwise identical I/O contract). shared_buffer: the fused graph,
    whose past and present are one buffer (genai's past_present_share_buffer)."""
    return {
        "model": {
            "type": "phi",
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "context_length": config.n_positions,
            "vocab_size": config.vocab_size,
            "decoder": {
                "filename": MODEL_FILE,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "head_size": config.head_dim,
                "hidden_size": config.n_embd,
                "num_attention_heads": config.n_head,
                "num_key_value_heads": config.n_head,
                "num_hidden_layers": config.n_layer,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "max_length": config.n_positions,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": shared_buffer,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "early_stopping": True,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


def _special_tokens(checkpoint: Path, config) -> dict:
    """Token ids from config.json, cross-checked against tokenizer.json when there is one."""
    eos, bos = config.eos_token_id, config.bos_token_id
    pad = eos
    tokenizer_config = checkpoint / "tokenizer_config.json"
    if tokenizer_config.is_file() and (checkpoint / "tokenizer.json").is_file():
        names = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        vocab = {t["content"]: t["id"] for t in json.loads((checkpoint / "tokenizer.json").read_text())["added_tokens"]}
        pad_name = names.get("pad_token")
        if isinstance(pad_name, str) and pad_name in vocab:
            pad = vocab[pad_name]
    for name, value in (("eos_token_id", eos), ("bos_token_id", bos), ("pad_token_id", pad)):
        if not 0 <= value < config.vocab_size:
            raise ValueError(f"{name} {value} is outside the vocabulary (size {config.vocab_size})")
    return {"bos_token_id": bos, "eos_token_ids": [eos], "pad_token_id": pad}


def export_package(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    attention: str = "fused",
    last_token_logits: bool = False,
    untie: bool = False,
    tolerance: float = PARITY_TOLERANCE,
    overwrite: bool = False,
    progress: Progress = print,
) -> dict:
    """Checkpoint folder -> model package folder. Writes to a temporary folder beside `out_dir` and
    renames it into place at the end, so a failed export leaves no half-written package. Returns the
    manifest. attention: "fused" (ONNX Runtime's fused attention, shared KV buffer; the default) or
    "standard" (standard ONNX ops only); last_token_logits applies to "standard" (the fused graph
    takes the number of positions to keep as an input)."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTION_KINDS)}")
    if attention == "fused" and last_token_logits:
        raise ValueError("last_token_logits is for the standard graph; the fused graph takes num_logits_to_keep")
    fused = attention == "fused"
    staged = StagedOutput(out_dir, inputs=[checkpoint], overwrite=overwrite)  # refuses unsafe outputs now
    progress(f"[1/4] loading checkpoint {checkpoint}")
    model = load_checkpoint(checkpoint)
    config = model.config
    if untie and config.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
        config.tie_word_embeddings = False
    tokens = _special_tokens(checkpoint, config)
    progress(
        f"      {model.num_parameters() / 1e6:.1f}M parameters, {config.n_layer} layers, context {config.n_positions}"
    )

    with staged as staging:
        progress(
            f"[2/4] exporting ONNX ({attention} attention, opset {opset}"
            f"{', last-token logits' if last_token_logits else ''})"
        )
        if fused:
            facts = export_fused_onnx(model, staging / MODEL_FILE, opset=opset)
        else:
            facts = export_onnx(model, staging / MODEL_FILE, opset=opset, last_token_logits=last_token_logits)
        progress("[3/4] checking ONNX Runtime against PyTorch (prompt + 5 decode steps)")
        if fused:
            max_diff = check_parity_shared(model, staging / MODEL_FILE)
        else:
            max_diff = check_parity(model, staging / MODEL_FILE, last_token_logits=last_token_logits)
        progress(f"      max |logit difference| = {max_diff:.2e} (tolerance {tolerance:.0e})")
        if not max_diff <= tolerance:
            raise RuntimeError(
                f"ONNX Runtime and PyTorch disagree: max |logit difference| {max_diff:.2e} > {tolerance:.0e}"
            )

        progress("[4/4] writing package files")
        write_json(
            staging / "genai_config.json",
            genai_config(
                config,
                eos_token_id=tokens["eos_token_ids"][0],
                bos_token_id=tokens["bos_token_id"],
                pad_token_id=tokens["pad_token_id"],
                shared_buffer=fused,
            ),
        )
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                shutil.copyfile(checkpoint / name, staging / name)
        input_names, output_names = io_names(config.n_layer)
        if fused:
            input_names.append(LOGITS_TO_KEEP)  # optional: an initializer that is also an input (default 0)
        files = list_files(staging)
        manifest = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "created_by": f"edgelm {__version__}",
            "architecture": {
                "type": "gpt2",
                "vocab_size": config.vocab_size,
                "context_length": config.n_positions,
                "n_layer": config.n_layer,
                "n_head": config.n_head,
                "head_dim": config.head_dim,
                "n_embd": config.n_embd,
                "positional": config.positional,
                "tie_word_embeddings": config.tie_word_embeddings,
                "parameters": model.num_parameters(),
            },
            "model_file": MODEL_FILE,
            "io": {
                "inputs": input_names,
                "outputs": output_names,
                "past_key": "past_key_values.%d.key",
                "past_value": "past_key_values.%d.value",
                "present_key": "present.%d.key",
                "present_value": "present.%d.value",
                "last_token_logits": last_token_logits,
                "kv_dtype": "float32",
                # fused: one (B, n_head, capacity, head_dim) buffer per cache tensor, bound as both past
                # and present; right padding; num_logits_to_keep selects the positions that get logits
                "attention": attention,
                "kv_cache": "shared_buffer" if fused else "concat",
                "padding": "right" if fused else "left",
                "logits_to_keep": LOGITS_TO_KEEP if fused else None,
            },
            "tokenizer": {"file": "tokenizer.json" if "tokenizer.json" in files else None, **tokens},
            "precision": "fp32",
            "recipe": {"mode": "fp32"},
            "export": {
                "opset": opset,
                "attention": attention,
                "torch": torch.__version__,
                "onnx": onnx.__version__,
                "external_data": facts["external_data"],
                "tied_embedding_bytes_saved": facts["tied_embedding_bytes_saved"],
            },
            "source": {"checkpoint": checkpoint.resolve().name, "sha256": checkpoint_hash(checkpoint)},
            "parity": {"max_abs_logit_diff": max_diff, "tolerance": tolerance, "decode_steps": 5, "batch": 2},
            "files": files,
        }
        write_json(staging / MANIFEST_FILE, manifest)
    size = sum(f["bytes"] for f in manifest["files"].values())
    progress(f"wrote {out_dir} ({size / 1e6:.1f} MB)")
    return manifest
