"""Checkpoint folders, the readers every family shares: config.json and other JSON files, the checked
config numbers, `pytorch_model.bin` loaded with `torch.load(weights_only=True)` (never a full unpickle), the
tokenizer files, a finite-weights check, and the hashes that identify what was exported. The families' own
loaders are export/gpt2_checkpoint.py (GPT-2) and export/hf_checkpoint.py (the Llama family).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import warnings
from pathlib import Path

import torch

from ..runtime.contract import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Sampling
from ..runtime.files import check_file, kind_of, read_text
from .limits import checked_number, context_length_problem

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"  # a sharded folder's weight map
PICKLE_FILE = "pytorch_model.bin"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "vocab.json", "merges.txt")


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


def present(path: Path) -> bool:
    """Whether a checkpoint file is there: True for a regular file, False for nothing; a FIFO, device or folder
    in its place is a CheckpointError saying what it is (never opened: a FIFO would block)."""
    if not os.path.lexists(path):
        return False
    check_file(path, "checkpoint file", error=CheckpointError)
    return True


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


def read_json(path: Path, what: str = "checkpoint file", *, error: type[Exception] = CheckpointError) -> dict:
    """A checkpoint's JSON file (config, index, tokenizer config, a LoRA adapter's config) as a dict, or `error`."""
    text = read_text(path, what, error=error)
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise error(f"{path} is not valid JSON: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(data, dict):
        raise error(f"{path} is not a JSON object")
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


def read_sampling(folder: Path) -> Sampling | None:
    """The sampling generation_config.json recommends (runtime/contract.py Sampling: do_sample, temperature, top_k,
    top_p, min_p, repetition_penalty), or None when it states none. A value the sampler cannot take is left out,
    with a warning: the recommendation is advice, and the weights export as well without it."""
    path = folder / GENERATION_CONFIG_FILE
    if not present(path):
        return None
    data = read_json(path)
    found = {key: data[key] for key in Sampling.__dataclass_fields__ if data.get(key) is not None}
    for key, value in list(found.items()):
        problem = Sampling.problem({key: value})
        if problem:
            warnings.warn(f"{path}: {problem}; left out of the package's sampling", stacklevel=2)
            del found[key]
    return Sampling(**found) if found else None


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


def source_files(folder: str | Path) -> list[str]:
    """The files of a checkpoint folder that export reads, by name: config.json, generation_config.json, the
    weights as the loaders pick them (the safetensors index and every shard it lists; else model.safetensors;
    else pytorch_model.bin), the tokenizer files and the chat template."""
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
