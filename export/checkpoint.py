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
import os
import pickle
from pathlib import Path

import torch

from ..runtime.files import check_file, kind_of, read_text
from .model import GPT, GPTConfig

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
PICKLE_FILE = "pytorch_model.bin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some GPT-2 checkpoints carry that are not parameters (the causal mask).
IGNORED_SUFFIXES = ("attn.bias", "attn.masked_bias")
SUPPORTED_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu"}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: wrong architecture, corrupt weights, shape mismatch."""


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
    try:
        return GPTConfig(
            vocab_size=int(hf["vocab_size"]),
            n_positions=int(hf.get("n_positions", hf.get("n_ctx", 1024))),
            n_embd=int(hf["n_embd"]),
            n_layer=int(hf["n_layer"]),
            n_head=int(hf["n_head"]),
            n_inner=hf.get("n_inner"),
            positional=hf.get("edgelm_positional", "learned"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
            activation=SUPPORTED_ACTIVATIONS[activation],
            bos_token_id=int(hf.get("bos_token_id", 50256)),
            eos_token_id=int(hf.get("eos_token_id", 50256)),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
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
    """The reference model from a Hugging Face GPT-2 state dict (Conv1D weights, (in, out))."""
    model = GPT(config)
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
        loaded[name] = tensor.float()
    if config.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)  # tied: the head is the embedding
        expected_names = set(expected) - {"lm_head.weight"}
    else:
        expected_names = set(expected)
    missing = sorted(expected_names - set(loaded))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), first {missing[0]!r}")
    model.load_state_dict(loaded, strict=False)
    model.eval()
    return model


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


def checkpoint_hash(folder: str | Path) -> str:
    """sha256 over config.json and the weights file: identifies the source of an export."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, SAFETENSORS_FILE, PICKLE_FILE):
        path = folder / name
        if path.is_file():
            digest.update(name.encode())
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()
