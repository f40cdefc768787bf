"""Hugging Face checkpoint folders, the readers every family shares: config.json and other JSON files, the
checked config numbers (and one translation of a bad config into CheckpointError), the weights
(`model.safetensors`; shards `model-0000N-of-0000M.safetensors` listed in `model.safetensors.index.json`; or
`pytorch_model.bin`, loaded with `torch.load(weights_only=True)`, never a full unpickle), a reference model
built from a state dict with every shape checked, the token ids and chat template, the tokenizer files, a
finite-weights check, and the hashes that identify what was exported. What differs per family (its config
mapping, its tensor renames) is in the family's module, export/families/.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from ..runtime.contract import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Sampling
from ..runtime.files import check_file, kind_of, read_text
from ..runtime.package import file_sha256
from .lazy_weights import TensorLoader, lazy_parameter, row_slices
from .limits import checked_number, context_length_problem

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"  # a sharded folder's weight map
PICKLE_FILE = "pytorch_model.bin"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "vocab.json", "merges.txt")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: wrong architecture, corrupt weights, shape mismatch."""


def config_number(
    hf: dict, key: str, default: object = None, *, kind: type = int, what: str | None = None, **bounds
) -> int | float:
    """config.json's `key` (`default` when absent or null) as one number of `kind` in range: `int(1.5)` would read
    a broken config as a working one (export/limits.py checked_number; bounds: positive, below). what: the key's
    name in messages, where `hf` is a part of config.json ("rope_parameters.full_attention.rope_theta")."""
    value = hf.get(key)
    value = default if value is None else value
    if value is None:
        raise CheckpointError(f"config.json lacks the key {what or key!r}")
    try:
        return checked_number(value, f"config.json's {what or key}", kind=kind, **bounds)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


@contextmanager
def config_errors() -> Iterator[None]:
    """A missing key or a value of the wrong type or range in config.json, as one CheckpointError."""
    try:
        yield
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config.json is invalid: {e}") from None


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


def check_finite(model: torch.nn.Module, source: str, *, on_tensor: Callable[[], None] | None = None) -> None:
    """Refuse NaN or inf in any weight, naming the tensor: such a model can never generate, and an export of
    it would fail only later, with a less useful message (or, before this check, not at all). Lazy weights
    (export/lazy_weights.py) are read one at a time, and a GGUF file's large ones a slice at a time (row_slices);
    on_tensor is called after each (progress)."""
    for name, parameter in model.named_parameters():
        if on_tensor is not None:
            on_tensor()
        bad = 0
        for part in row_slices(parameter, 4 * math.prod(parameter.shape[1:])):  # float32 rows
            # a NaN or inf makes the sum non-finite; the sum alone can also overflow, so the mask confirms (the
            # mask first would take about 10x longer: 1.5 s on SmolLM2-135M)
            if not math.isfinite(part.sum(dtype=torch.float32)):
                bad += part.numel() - int(torch.isfinite(part).sum())
        if bad:
            raise CheckpointError(
                f"tensor {name!r} in {source} holds {bad} NaN or inf value(s) of {parameter.numel()}; "
                "a model with them cannot generate"
            )


def _to_float32(name: str, tensor: torch.Tensor, source: Path) -> torch.Tensor:
    _check_float(name, tensor.is_floating_point(), tensor.dtype, source)
    return tensor.float()


def _check_float(name: str, floating: bool, dtype: object, source: Path) -> None:
    if not floating:
        raise CheckpointError(
            f"tensor {name!r} in {source} has dtype {dtype}; only float weights are supported "
            "(quantized checkpoints are not)"
        )


SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")


def _load_safetensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors file, in its own dtype (a new tensor: nothing of the file stays mapped)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated: {e}") from None


def _read_safetensors(path: Path, state: dict[str, TensorLoader]) -> list[str]:
    """Add the tensors of one safetensors file to `state` as loaders (export/lazy_weights.py: read when used, in
    their own dtype); return their names. The header is read and checked now."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            for name in names:
                if name in state:
                    raise CheckpointError(f"tensor {name!r} appears in more than one weights file ({path.name})")
                tensor = f.get_slice(name)
                dtype = tensor.get_dtype()
                _check_float(name, dtype in SAFETENSORS_FLOATS, dtype, path)
                state[name] = TensorLoader(tuple(tensor.get_shape()), partial(_load_safetensor, path, name))
    except (SafetensorError, OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path} is corrupt or truncated: {e}") from None
    _check_sizes(path, state, names)
    return names


def _check_sizes(path: Path, state: dict[str, TensorLoader], names: list[str]) -> None:
    """A file shorter than its header says is truncated: refused now, not when a tensor is read."""
    import json as _json
    import struct

    with open(path, "rb") as f:
        (header_length,) = struct.unpack("<Q", f.read(8))
        header = _json.loads(f.read(header_length))
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if path.stat().st_size < 8 + header_length + end:
        raise CheckpointError(f"{path} is corrupt or truncated: the data ends before its last tensor")


def _read_sharded(folder: Path) -> dict[str, TensorLoader]:
    index_path = folder / SAFETENSORS_INDEX_FILE
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no weight_map")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        # A shard is a file beside the index, never a path that leaves the folder.
        if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
            raise CheckpointError(f"{index_path} names an invalid shard file {shard!r}")
        if not present(folder / shard):
            raise CheckpointError(f"{index_path} lists the shard {shard!r}, which is missing from {folder}")
    state: dict[str, TensorLoader] = {}
    found: dict[str, str] = {}
    for shard in shards:
        for name in _read_safetensors(folder / shard, state):
            found[name] = shard
    for name, shard in weight_map.items():
        if found.get(name) != shard:
            raise CheckpointError(f"tensor {name!r} is listed in {index_path.name} but not found in {shard!r}")
    return state


def read_safetensors_folder(folder: str | Path, *, lazy: bool = False) -> dict[str, TensorLoader | torch.Tensor]:
    """The weights of a Hugging Face folder by their Hugging Face names, as fp32 tensors (bf16/fp16 upcast one at a
    time); lazy: safetensors as loaders, read when used in their own dtype (export/lazy_weights.py). A
    pytorch_model.bin's are fp32 tensors either way (a pickle is read whole)."""
    folder = Path(folder)
    if not lazy:
        state = read_safetensors_folder(folder, lazy=True)
        return {n: t if isinstance(t, torch.Tensor) else _to_float32(n, t.load(), folder) for n, t in state.items()}
    if present(folder / SAFETENSORS_INDEX_FILE):
        return _read_sharded(folder)
    if present(folder / SAFETENSORS_FILE):
        state: dict[str, TensorLoader] = {}
        _read_safetensors(folder / SAFETENSORS_FILE, state)
        return state
    if present(folder / PICKLE_FILE):
        path = folder / PICKLE_FILE
        return {name: _to_float32(name, tensor, path) for name, tensor in read_pickle(path).items()}
    raise FileNotFoundError(f"{folder} has no {SAFETENSORS_FILE}, {SAFETENSORS_INDEX_FILE} or {PICKLE_FILE}")


def renamed(state: dict[str, torch.Tensor], renames: tuple[tuple[str, str | None], ...]) -> dict[str, torch.Tensor]:
    """`state` with each name's first matching prefix replaced (None: the tensor is dropped)."""
    out = {}
    for name, tensor in state.items():
        for prefix, replacement in renames:
            if name.startswith(prefix):
                if replacement is not None:
                    out[replacement + name[len(prefix) :]] = tensor
                break
        else:
            out[name] = tensor
    return out


def load_weights(
    make: Callable[[], torch.nn.Module],
    state: dict[str, torch.Tensor | TensorLoader],
    *,
    prefix: str,
    embedding: str,
    tied: bool,
    what: str,
    ignored: tuple[str, ...] = (),
    transposed: tuple[str, ...] = (),
) -> torch.nn.Module:
    """The reference model `make()` builds, holding `state` (Hugging Face names; a name without `prefix` or
    "lm_head." gets `prefix`), every shape checked before anything is allocated: the config's sizes are only
    claims until the tensors bear them out. The tensors become the parameters (no second copy); names ending in
    `transposed` (GPT-2's Conv1D weights) are transposed, those ending in `ignored` (buffers some checkpoints
    saved) skipped; a tied head is the `embedding` parameter. Buffers are the caller's (built on meta here).
    A TensorLoader becomes a lazy parameter (export/lazy_weights.py): on the meta device, read when used."""
    with torch.device("meta"):
        model = make()  # shapes only: no memory, no random init
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    loaded: dict[str, torch.Tensor] = {}
    lazy: dict[str, TensorLoader] = {}
    for key, tensor in state.items():
        name = key if key.startswith((prefix, "lm_head.")) else prefix + key
        if name.endswith(ignored) and name not in expected:
            continue
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {key!r} in the checkpoint (not part of a {what} model)")
        if name.endswith(transposed):
            tensor = tensor.t()
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(tensor.shape)} but the config expects {expected[name]}"
            )
        if isinstance(tensor, TensorLoader):
            lazy[name] = tensor
        else:
            loaded[name] = tensor.float().contiguous()
    if tied:
        loaded.pop("lm_head.weight", None)  # tied: the head is the embedding (some folders store a copy)
        lazy.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(loaded) - set(lazy) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), first {missing[0]!r}")
    model.load_state_dict(loaded, strict=False, assign=True)
    for name, loader in lazy.items():
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = lazy_parameter(loader)
    if tied:
        model.lm_head.weight = model.get_parameter(embedding)
    return model


def token_ids(value: object, key: str) -> list[int]:
    """A config's token id or ids (`key`) as a list, in order, without repeats."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{key} must be an integer or a list of integers, got {value!r}")
    return list(dict.fromkeys(ids))


def first_id(value: object, key: str) -> int | None:
    ids = token_ids(value, key)
    return ids[0] if ids else None


def read_extras(folder: str | Path) -> dict:
    """Token ids and chat template: {"bos_token_id", "eos_token_ids", "pad_token_id", "chat_template"}.
    generation_config.json's ids win over config.json's (they are what transformers' generate uses)."""
    folder = Path(folder)
    merged: dict = {}
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        if present(folder / name):
            data = read_json(folder / name)
            merged.update(
                {k: data[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if data.get(k) is not None}
            )
    return {
        "bos_token_id": first_id(merged.get("bos_token_id"), "bos_token_id"),
        "eos_token_ids": token_ids(merged.get("eos_token_id"), "eos_token_id"),
        "pad_token_id": first_id(merged.get("pad_token_id"), "pad_token_id"),
        "chat_template": _chat_template(folder),
    }


def _chat_template(folder: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (its "default" when named), as in
    transformers."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if not (folder / TOKENIZER_CONFIG_FILE).is_file():
        return None
    template = read_json(folder / TOKENIZER_CONFIG_FILE).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{folder / TOKENIZER_CONFIG_FILE}'s chat_template is not a string")
    return template


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
    folder = Path(folder)
    return {name: file_sha256(folder / name) for name in source_files(folder)}


def combined_hash(hashes: dict[str, str]) -> str:
    """One sha256 for a set of files: over their "name sha256" lines, sorted by name."""
    lines = "".join(f"{name} {digest}\n" for name, digest in sorted(hashes.items()))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()
