"""Hugging Face Llama-family folders (model_type llama, mistral, qwen2, qwen3), read without transformers.

A folder holds `config.json`, the weights (`model.safetensors`; or shards `model-0000N-of-0000M.safetensors`
listed in `model.safetensors.index.json`; or `pytorch_model.bin`, loaded with `torch.load(weights_only=True)`),
and optionally `generation_config.json`, `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`.
Weights keep Hugging Face's names, which llama.py's Llama uses too; bf16/fp16 tensors are upcast to fp32 one at
a time. The config keys are those transformers writes, in both the 4.x form (`rope_theta`, `rope_scaling`)
and the 5.x form (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..runtime.contract import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
from .checkpoint import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    PICKLE_FILE,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX_FILE,
    CheckpointError,
    config_context_length,
    config_number,
    present,
    read_config,
    read_json,
    read_pickle,
)
from .limits import MAX_NORM_EPSILON
from .llama import MODEL_TYPES, ROPE_SCALING_KEYS, VARIANTS, Llama, LlamaConfig, rope_inv_freq

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints saved; recomputed from the config


def _to_float32(name: str, tensor: torch.Tensor, source: Path) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise CheckpointError(
            f"tensor {name!r} in {source} has dtype {tensor.dtype}; only float weights are supported "
            "(quantized checkpoints are not)"
        )
    return tensor.float()


def _read_safetensors(path: Path, state: dict[str, torch.Tensor]) -> list[str]:
    """Add the tensors of one safetensors file to `state`, upcast to fp32; return their names."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            for name in names:
                if name in state:
                    raise CheckpointError(f"tensor {name!r} appears in more than one weights file ({path.name})")
                state[name] = _to_float32(name, f.get_tensor(name), path)
    except (SafetensorError, OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path} is corrupt or truncated: {e}") from None
    return names


def _read_sharded(folder: Path) -> dict[str, torch.Tensor]:
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
    state: dict[str, torch.Tensor] = {}
    found: dict[str, str] = {}
    for shard in shards:
        for name in _read_safetensors(folder / shard, state):
            found[name] = shard
    for name, shard in weight_map.items():
        if found.get(name) != shard:
            raise CheckpointError(f"tensor {name!r} is listed in {index_path.name} but not found in {shard!r}")
    return state


def read_safetensors_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face folder as fp32 tensors, by their Hugging Face names."""
    folder = Path(folder)
    if present(folder / SAFETENSORS_INDEX_FILE):
        return _read_sharded(folder)
    if present(folder / SAFETENSORS_FILE):
        state: dict[str, torch.Tensor] = {}
        _read_safetensors(folder / SAFETENSORS_FILE, state)
        return state
    if present(folder / PICKLE_FILE):
        path = folder / PICKLE_FILE
        return {name: _to_float32(name, tensor, path) for name, tensor in read_pickle(path).items()}
    raise FileNotFoundError(f"{folder} has no {SAFETENSORS_FILE}, {SAFETENSORS_INDEX_FILE} or {PICKLE_FILE}")


def _rope_from_hf(hf: dict, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config form; rope_scaling keeps rope_type and that type's keys
    (LlamaConfig refuses an unknown type or a missing key)."""
    params = hf.get("rope_parameters") or {}  # transformers 5: theta and scaling in one dict
    scaling = hf.get("rope_scaling") or params  # transformers 4: scaling apart, theta at the top
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise CheckpointError("config.json's rope_parameters and rope_scaling must be objects")
    theta = config_number(params if "rope_theta" in params else hf, "rope_theta", 10000.0, kind=float)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        # transformers falls back to max_position_embeddings when the original context is not given
        scaling = {"original_max_position_embeddings": max_positions, **scaling}
    keys = ROPE_SCALING_KEYS.get(rope_type, ())
    # every scaling value is a positive number: the context an int, the factors floats (a NaN factor, or equal low
    # and high frequency factors, would make the rotary frequencies NaN)
    checked = {
        k: config_number(scaling, k, kind=int if k == "original_max_position_embeddings" else float)
        for k in keys
        if k in scaling
    }
    if {"low_freq_factor", "high_freq_factor"} <= set(checked) and checked["high_freq_factor"] <= checked[
        "low_freq_factor"
    ]:
        raise CheckpointError("config.json's rope scaling high_freq_factor must be above its low_freq_factor")
    return theta, {"rope_type": rope_type, **checked}


def _token_ids(value: object, key: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{key} must be an integer or a list of integers, got {value!r}")
    return list(dict.fromkeys(ids))  # in order, without repeats


def _first_id(value: object, key: str) -> int | None:
    ids = _token_ids(value, key)
    return ids[0] if ids else None


@contextmanager
def _config_errors() -> Iterator[None]:
    """A missing key or a value of the wrong type or range in config.json, as one CheckpointError."""
    try:
        yield
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config.json is invalid: {e}") from None


def llama_config_from_hf(hf: dict) -> LlamaConfig:
    """Map a Hugging Face config.json (llama, mistral, qwen2, qwen3) onto LlamaConfig; refuse what Llama does not
    implement."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"unsupported hidden_act {hf['hidden_act']!r}: Llama-family models use 'silu'")
    variant = VARIANTS[model_type]
    if not variant.qkv_bias and hf.get("attention_bias"):
        raise CheckpointError(
            "config.json sets attention_bias=true (an o_proj bias too), which edgelm does not implement"
        )
    if hf.get("mlp_bias"):
        raise CheckpointError("config.json sets mlp_bias=true, which edgelm does not implement")
    with _config_errors():
        n_positions = config_number(hf, "max_position_embeddings")
        theta, scaling = _rope_from_hf(hf, n_positions)
        # A sliding window only changes attention once the context exceeds it; capping the context length at the
        # window means it never applies, so plain causal attention is exact (Mistral; Qwen2 when enabled).
        window = hf.get("sliding_window") if variant.window_always or hf.get("use_sliding_window") else None
        capped = window is not None and config_number(hf, "sliding_window") < n_positions
        n_positions = config_context_length(
            window if capped else n_positions, "sliding_window" if capped else "max_position_embeddings"
        )
        n_head = config_number(hf, "num_attention_heads")
        return LlamaConfig(
            vocab_size=config_number(hf, "vocab_size"),
            n_positions=n_positions,
            n_embd=config_number(hf, "hidden_size"),
            n_layer=config_number(hf, "num_hidden_layers"),
            n_head=n_head,
            n_kv_head=config_number(hf, "num_key_value_heads", n_head),
            head_dim=config_number(hf, "head_dim") if hf.get("head_dim") is not None else None,
            n_inner=config_number(hf, "intermediate_size"),
            rms_norm_eps=config_number(hf, "rms_norm_eps", 1e-6, kind=float, below=MAX_NORM_EPSILON),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=variant.qkv_bias,  # Qwen2's config has no key for its Q/K/V biases
            qk_norm=variant.qk_norm,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),  # transformers' default for all three
            bos_token_id=_first_id(hf.get("bos_token_id"), "bos_token_id"),
            eos_token_ids=_token_ids(hf.get("eos_token_id"), "eos_token_id"),
            model_type=model_type,
        )


GEMMA3_DEFAULTS = {  # transformers' Gemma3TextConfig defaults: a gemma3 config's text_config may leave them out
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True,
}  # fmt: skip


def _gemma3_text_config(hf: dict) -> dict:
    """The text model's config: gemma3's text_config, or gemma3_text's own; transformers' defaults filled in;
    the options the reference model does not implement refused."""
    if hf.get("model_type") == "gemma3":
        if not isinstance(hf.get("text_config"), dict):
            raise CheckpointError("config.json of model_type 'gemma3' has no text_config")
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
    hf = {**GEMMA3_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in GEMMA3_DEFAULTS}}
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
        if hf.get(key):
            raise CheckpointError(f"config.json sets {key}={hf[key]!r}, which edgelm does not implement")
    if hf["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"unsupported hidden_activation {hf['hidden_activation']!r} for Gemma 3")
    return hf


def gemma3_config_from_hf(hf: dict) -> LlamaConfig:
    """Map a Gemma 3 config.json onto LlamaConfig: gemma3_text, or gemma3 (image and text), whose text part
    (`text_config`) is exported; refuse what the reference model does not implement."""
    hf = _gemma3_text_config(hf)
    with _config_errors():
        n_positions = config_context_length(config_number(hf, "max_position_embeddings"), "max_position_embeddings")
        n_layer = config_number(hf, "num_hidden_layers")
        # transformers 5: per layer type {"full_attention": {...}, "sliding_attention": {...}}; 4.x: flat keys
        params = hf.get("rope_parameters") or {}
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, scaling = _rope_from_hf({"rope_parameters": full} if full else hf, n_positions)
        if local.get("rope_type", "default") != "default":
            raise CheckpointError(f"sliding-layer rope_type {local['rope_type']!r} is not supported")
        pattern = config_number(hf, "sliding_window_pattern", 6)  # the older key: every pattern-th layer is full
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)
        ]
        n_head = config_number(hf, "num_attention_heads")
        return LlamaConfig(
            vocab_size=config_number(hf, "vocab_size"),
            n_positions=n_positions,
            n_embd=config_number(hf, "hidden_size"),
            n_layer=n_layer,
            n_head=n_head,
            n_kv_head=config_number(hf, "num_key_value_heads", n_head),
            head_dim=config_number(hf, "head_dim"),
            n_inner=config_number(hf, "intermediate_size"),
            rms_norm_eps=config_number(hf, "rms_norm_eps", kind=float, below=MAX_NORM_EPSILON),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=True,
            tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            bos_token_id=_first_id(hf.get("bos_token_id"), "bos_token_id"),
            eos_token_ids=_token_ids(hf.get("eos_token_id"), "eos_token_id"),
            model_type="gemma3_text",
            hidden_act="gelu_pytorch_tanh",
            norm_offset=1.0,
            embedding_scale=True,
            sandwich_norms=True,
            query_pre_attn_scalar=config_number(hf, "query_pre_attn_scalar", kind=float),
            layer_types=list(layer_types),
            sliding_window=config_number(hf, "sliding_window") if "sliding_attention" in layer_types else None,
            rope_local_theta=float(local.get("rope_theta", hf["rope_local_base_freq"])),
        )


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


def build_llama(config: LlamaConfig, state: dict[str, torch.Tensor]) -> Llama:
    """A Llama holding `state` (Hugging Face names, fp32), every shape checked; the tensors become the
    parameters (no second copy). Missing or unexpected tensors raise CheckpointError."""
    with torch.device("meta"):
        model = Llama(config)  # shapes only: no memory, no random init
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    loaded: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = key if key.startswith(("model.", "lm_head.")) else "model." + key
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in expected:
            raise CheckpointError(
                f"unexpected tensor {key!r} in the checkpoint (not part of a {config.model_type} model)"
            )
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(tensor.shape)} but the config expects {expected[name]}"
            )
        loaded[name] = tensor
    if config.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)  # tied: the head is the embedding (some folders store a copy)
    missing = sorted(set(expected) - set(loaded) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), first {missing[0]!r}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)  # the buffers are not in the state dict; they were built on meta
    model.inv_freq_local = rope_inv_freq(config, local=True)
    for freq in (model.inv_freq, model.inv_freq_local):
        if not torch.isfinite(freq).all():
            rope = f"rope_theta {config.rope_theta}, rope_scaling {config.rope_scaling}"
            raise CheckpointError(f"rotary frequencies are not finite ({rope})")
    return model.eval()


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

    # chat_template.jinja takes priority over tokenizer_config.json, as in transformers.
    chat_template = None
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        chat_template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    elif (folder / TOKENIZER_CONFIG_FILE).is_file():
        template = read_json(folder / TOKENIZER_CONFIG_FILE).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next(
                (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
            )
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{folder / TOKENIZER_CONFIG_FILE}'s chat_template is not a string")
        chat_template = template
    return {
        "bos_token_id": _first_id(merged.get("bos_token_id"), "bos_token_id"),
        "eos_token_ids": _token_ids(merged.get("eos_token_id"), "eos_token_id"),
        "pad_token_id": _first_id(merged.get("pad_token_id"), "pad_token_id"),
        "chat_template": chat_template,
    }


def load_llama(
    folder: str | Path, *, config_from_hf=llama_config_from_hf, renames: tuple[tuple[str, str | None], ...] = ()
) -> Llama:
    """Load a Hugging Face llama / mistral / qwen2 / qwen3 folder (or, with the family's config mapping and
    tensor renames, a Gemma 3 one) into the reference model (eval mode, fp32).
    The config's BOS/EOS ids are those of read_extras (generation_config.json first)."""
    folder = Path(folder)
    config = config_from_hf(read_config(folder))
    extras = read_extras(folder)
    config = dataclasses.replace(config, bos_token_id=extras["bos_token_id"], eos_token_ids=extras["eos_token_ids"])
    return build_llama(config, renamed(read_safetensors_folder(folder), renames))
