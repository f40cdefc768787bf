"""GPT-2 checkpoint folders: Hugging Face's GPT-2 layout, read and written without transformers.

A GPT-2 checkpoint is a folder with `config.json` (GPT-2's config keys) and `model.safetensors` (or a
`pytorch_model.bin`, export/checkpoint.py read_pickle), plus the tokenizer files when there are any. Any
Hugging Face GPT-2-family folder (gpt2, distilgpt2, gpt2-medium, fine-tunes) loads as it is.

Hugging Face's GPT-2 stores its projections as `Conv1D` weights, (in, out); ours are `nn.Linear`,
(out, in). The four names in TRANSPOSED are the whole mapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import (
    CONFIG_FILE,
    PICKLE_FILE,
    SAFETENSORS_FILE,
    CheckpointError,
    config_context_length,
    config_number,
    present,
    read_config,
    read_pickle,
)
from .gpt2 import GPT, GPTConfig, sinusoidal_table
from .limits import MAX_NORM_EPSILON

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some GPT-2 checkpoints carry that are not parameters (the causal mask).
IGNORED_SUFFIXES = ("attn.bias", "attn.masked_bias")
SUPPORTED_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu"}


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


def load_checkpoint(folder: str | Path) -> GPT:
    """Load a GPT-2-layout checkpoint folder into the reference model (eval mode, fp32)."""
    folder = Path(folder)
    return build_gpt(config_from_hf(read_config(folder)), _read_state_dict(folder))


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
