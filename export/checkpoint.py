"""Checkpoint folders: Hugging Face GPT-2 layout, read and written without transformers.

A checkpoint is a folder with `config.json` (GPT-2's config keys) and `model.safetensors` (or a
`pytorch_model.bin`, loaded with `torch.load(weights_only=True)`, never a full unpickle), plus the
tokenizer files when there are any. Any Hugging Face GPT-2-family folder (gpt2, distilgpt2,
gpt2-medium, fine-tunes) loads as it is.

Hugging Face's GPT-2 stores its projections as `Conv1D` weights, (in, out); ours are `nn.Linear`,
(out, in). The four names in TRANSPOSED are the whole mapping.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
from pathlib import Path

import torch

from ..runtime.contract import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from ..runtime.files import check_file, kind_of, read_text
from .limits import MAX_NORM_EPSILON, checked_number, context_length_problem
from .model import GPT, GPTConfig, sinusoidal_table

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
PICKLE_FILE = "pytorch_model.bin"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "vocab.json", "merges.txt")

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some GPT-2 checkpoints carry that are not parameters (the causal mask).
IGNORED_SUFFIXES = ("attn.bias", "attn.masked_bias")
SUPPORTED_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu"}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: wrong architecture, corrupt weights, shape mismatch."""


def config_number(hf: dict, key: str, default: object = None, *, kind: type = int, **bounds) -> int | float:
    """config.json's `key` (`default` when absent or null) as one number of `kind` in range: `int(1.5)` would read
    a broken config as a working one (export/limits.py checked_number; bounds: positive, below)."""
    value = hf.get(key)
    value = default if value is None else value
    if value is None:
        raise CheckpointError(f"config.json lacks the key {key!r}")
    try:
        return checked_number(value, f"config.json's {key}", kind=kind, **bounds)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def config_context_length(length: int, key: str) -> int:
    problem = context_length_problem(length)
    if problem:
        raise CheckpointError(f"config.json's {key} = {problem}")
    return length


def config_from_hf(hf: dict) -> GPTConfig:
    """Map a Hugging Face GPT-2 config.json onto GPTConfig; refuse what this model does not implement."""
    model_type = hf.get("model_type")
    if model_type != "gpt2":
        raise CheckpointError(f"unsupported model_type {model_type!r}: edgelm exports GPT-2-family models ('gpt2')")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise CheckpointError(
            f"unsupported activation_function {activation!r}; supported: {sorted(SUPPORTED_ACTIVATIONS)}"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise CheckpointError(f"config.json sets {flag}=true, which edgelm's GPT-2 does not implement")
    if hf.get("scale_attn_weights") is False:
        raise CheckpointError("config.json sets scale_attn_weights=false, which edgelm's GPT-2 does not implement")
    positions_key = "n_positions" if hf.get("n_positions") is not None else "n_ctx"
    try:
        return GPTConfig(
            vocab_size=config_number(hf, "vocab_size"),
            n_positions=config_context_length(config_number(hf, positions_key, 1024), positions_key),
            n_embd=config_number(hf, "n_embd"),
            n_layer=config_number(hf, "n_layer"),
            n_head=config_number(hf, "n_head"),
            n_inner=config_number(hf, "n_inner") if hf.get("n_inner") is not None else None,
            positional=hf.get("edgelm_positional", "learned"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            layer_norm_epsilon=config_number(hf, "layer_norm_epsilon", 1e-5, kind=float, below=MAX_NORM_EPSILON),
            activation=SUPPORTED_ACTIVATIONS[activation],
            bos_token_id=config_number(hf, "bos_token_id", 50256, positive=False),
            eos_token_id=config_number(hf, "eos_token_id", 50256, positive=False),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config.json is invalid: {e}") from None


def config_to_hf(config: GPTConfig) -> dict:
    hf = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.n_inner,
        "activation_function": config.activation,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }
    if config.positional != "learned":
        hf["edgelm_positional"] = config.positional  # not a GPT-2 key: transformers ignores it
    return hf


def present(path: Path) -> bool:
    """Whether a checkpoint file is there: True for a regular file, False for nothing; a FIFO, device or folder
    in its place is a CheckpointError saying what it is (never opened: a FIFO would block)."""
    if not os.path.lexists(path):
        return False
    check_file(path, "checkpoint file", error=CheckpointError)
    return True


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    if present(folder / SAFETENSORS_FILE):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = folder / SAFETENSORS_FILE
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path} is corrupt or truncated: {e}") from None
    if present(folder / PICKLE_FILE):
        return read_pickle(folder / PICKLE_FILE)
    raise FileNotFoundError(f"{folder} has no {SAFETENSORS_FILE} or {PICKLE_FILE}")


def read_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin state dict, loaded with weights_only: tensors and plain containers only; a
    pickle that names any other callable is refused instead of executed."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else "refused"
        raise CheckpointError(f"{path} is not a plain weights file (refused to unpickle: {first_line})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated: {e}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return state


def load_checkpoint(folder: str | Path) -> GPT:
    """Load a GPT-2-layout checkpoint folder into the reference model (eval mode, fp32)."""
    folder = Path(folder)
    return build_gpt(config_from_hf(read_config(folder)), _read_state_dict(folder))


def read_config(folder: Path) -> dict:
    """A checkpoint folder's config.json, as a dict; a missing folder or file, or bad JSON, is a clear error."""
    kind = kind_of(folder)
    if kind is None:
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    if kind != "a folder":
        raise CheckpointError(f"checkpoint {folder} is {kind}, not a folder (a checkpoint is a folder or a .gguf file)")
    if not os.path.lexists(folder / CONFIG_FILE):
        raise FileNotFoundError(f"{folder} has no {CONFIG_FILE}")
    return read_json(folder / CONFIG_FILE)


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file (config, index, tokenizer config) as a dict, or a CheckpointError."""
    text = read_text(path, "checkpoint file", error=CheckpointError)
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def tokenizer_files(folder: Path) -> dict[str, Path]:
    """The tokenizer files a checkpoint folder holds (TOKENIZER_FILES), checked to be UTF-8 text and the JSON
    ones JSON objects: export copies them into the package, which would otherwise fail only when loaded."""
    found = {}
    for name in TOKENIZER_FILES:
        path = folder / name
        if not os.path.lexists(path):
            continue
        if name.endswith(".json"):
            read_json(path)
        else:
            read_text(path, "checkpoint file", error=CheckpointError)
        found[name] = path
    return found


def build_gpt(config: GPTConfig, state: dict[str, torch.Tensor]) -> GPT:
    """The reference model from a Hugging Face GPT-2 state dict (Conv1D weights, (in, out)), every shape checked
    before anything is allocated: the config's sizes (a position table of 2**24 rows) are only claims until the
    tensors bear them out; the tensors become the parameters (no second copy)."""
    with torch.device("meta"):
        model = GPT(config)  # shapes only: no memory, no random init
    expected = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        if name.endswith(IGNORED_SUFFIXES) and name not in expected:
            continue
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {key!r} in the checkpoint (not part of a GPT-2 model)")
        if name.endswith(TRANSPOSED):
            tensor = tensor.t()
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(tensor.shape)} but the config expects {tuple(expected[name].shape)}"
            )
        loaded[name] = tensor.float().contiguous()
    if config.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)  # tied: the head is the embedding
        expected_names = set(expected) - {"lm_head.weight"}
    else:
        expected_names = set(expected)
    missing = sorted(expected_names - set(loaded))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), first {missing[0]!r}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    if config.positional != "learned":  # the buffer is not in the state dict; it was built on meta
        model.sinusoid = sinusoidal_table(config.n_positions, config.n_embd)
    model.eval()
    return model


def check_finite(model: torch.nn.Module, source: str) -> None:
    """Refuse NaN or inf in any weight, naming the tensor: such a model can never generate, and an export of
    it would fail only later, with a less useful message (or, before this check, not at all)."""
    for name, tensor in model.named_parameters():
        # a NaN or inf makes the sum non-finite; the sum alone can also overflow, so the mask confirms (the mask
        # first would take about 10x longer: 1.5 s on SmolLM2-135M)
        if math.isfinite(tensor.detach().sum()):
            continue
        bad = tensor.numel() - int(torch.isfinite(tensor).sum())
        if bad:
            raise CheckpointError(
                f"tensor {name!r} in {source} holds {bad} NaN or inf value(s) of {tensor.numel()}; "
                "a model with them cannot generate"
            )


def save_checkpoint(model: GPT, folder: str | Path) -> None:
    """Write config.json + model.safetensors in Hugging Face GPT-2's layout (loads in transformers)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        state[name] = (tensor.t() if name.endswith(TRANSPOSED) else tensor).contiguous()
    save_file(state, str(folder / SAFETENSORS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n", encoding="utf-8")


def source_files(folder: str | Path) -> list[str]:
    """The files of a checkpoint folder that export reads, by name: config.json, generation_config.json, the
    weights as the loaders pick them (the safetensors index and every shard it lists; else model.safetensors;
    else pytorch_model.bin), the tokenizer files and the chat template."""
    from .hf_checkpoint import CHAT_TEMPLATE_FILE, GENERATION_CONFIG_FILE, SAFETENSORS_INDEX_FILE

    folder = Path(folder)
    if (folder / SAFETENSORS_INDEX_FILE).is_file():
        weight_map = read_json(folder / SAFETENSORS_INDEX_FILE).get("weight_map")
        shards = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        weights = [SAFETENSORS_INDEX_FILE, *sorted(s for s in shards if isinstance(s, str) and Path(s).name == s)]
    else:
        weights = [SAFETENSORS_FILE] if (folder / SAFETENSORS_FILE).is_file() else [PICKLE_FILE]
    names = [CONFIG_FILE, GENERATION_CONFIG_FILE, *weights, *TOKENIZER_FILES, CHAT_TEMPLATE_FILE]
    return [name for name in dict.fromkeys(names) if (folder / name).is_file()]


def source_hashes(folder: str | Path) -> dict[str, str]:
    """sha256 of every file export reads from a checkpoint folder (source_files), by name."""
    from ..runtime.package import file_sha256

    folder = Path(folder)
    return {name: file_sha256(folder / name) for name in source_files(folder)}


def combined_hash(hashes: dict[str, str]) -> str:
    """One sha256 for a set of files: over their "name sha256" lines, sorted by name."""
    lines = "".join(f"{name} {digest}\n" for name, digest in sorted(hashes.items()))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def checkpoint_hash(folder: str | Path) -> str:
    """sha256 identifying the source of an export: combined_hash over every file export reads (source_hashes)."""
    return combined_hash(source_hashes(folder))
