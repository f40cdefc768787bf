"""Phi-3 and Phi-4-mini (model_type phi3): a Llama whose Q, K and V come from one packed projection
(qkv_proj) and gate and up from another (gate_up_proj), split here into the reference model's parts (the
Decoder packs them again, in the same order), with partial rotary (the first int(head_dim *
partial_rotary_factor) values of each head rotate) and LongRoPE. How its folders and GGUF files load into the
reference model (export/models/llama.py's Llama with a Phi3Config), and its row.

LongRoPE (transformers' `longrope`, which also reads 4.x's `su` and `yarn` as it): frequencies divided by
per-frequency short factors, or long ones once the sequence is longer than original_max_position_embeddings,
and cos and sin times an attention factor (sqrt(1 + ln(factor) / ln(original)) unless given, factor being
max_position_embeddings / original unless given). transformers chooses per forward call from the largest
position; the reference model and the graphs choose per row from its length, which is the same for a sequence
alone and keeps each row of a padded batch what it is alone. Keys already cached keep the rotation they had.

config.json keeps original_max_position_embeddings at its top level, which transformers reads before
rope_parameters' own (4096 where absent). A sliding window caps the context (Mistral's rule, exact). llama.cpp's
converter writes the packed tensors as attn_qkv and ffn_up, unpermuted, the factors as the tensors
rope_factors_short/long.weight, the attention factor, the original context and the rotary width as metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from ..checkpoint import (
    CheckpointError,
    config_errors,
    config_number,
)
from ..gguf_metadata import Entry, GGUFError, context_length, number, with_head
from ..limits import MAX_NORM_EPSILON, context_length_problem
from ..models.llama import Llama, LlamaConfig
from . import llama
from .family import Family, GGUFLayout

VARIANT = llama.Variant("Phi-3/Phi-4-mini", window_always=True, gguf_class="Phi3ForCausalLM")
ORIGINAL_CONTEXT = 4096  # transformers' Phi3Config default original_max_position_embeddings
PARTS = {"qkv": ("self_attn.qkv_proj",), "up": ("mlp.gate_up_proj",)}  # the packed tensors, as stored
# LoRA: PEFT adapts the packed linears as they are stored; the Decoder packs them again in the same row order
LORA_PACKED = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)
LORA_LINEARS = tuple(
    (f"model.layers.%d.{path}", target)
    for path, target in (
        ("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", "attention_out"), ("mlp.gate_up_proj", "up"),
        ("mlp.down_proj", "down"),
    )
)  # fmt: skip
FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # llama.cpp's LongRoPE factor tensors


@dataclass
class Phi3Config(LlamaConfig):
    """Phi-3: Llama with partial rotary and LongRoPE (rope_scaling {"rope_type": "longrope", ...})."""

    model_type: str = "phi3"
    tie_word_embeddings: bool = False
    partial_rotary_factor: float = 1.0


def _longrope(hf: dict, scaling: dict, rotary_dim: int) -> dict:
    """LongRoPE's rope_scaling as transformers' _compute_longrope_parameters reads it."""
    original = config_number(hf, "original_max_position_embeddings", ORIGINAL_CONTEXT)
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        ok = isinstance(values, list) and len(values) == rotary_dim // 2
        if not ok or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            raise CheckpointError(f"config.json's rope {key} should be {rotary_dim // 2} positive numbers")
        factors[key] = [float(v) for v in values]
    factor = scaling.get("factor")
    factor = config_number(hf, "max_position_embeddings") / original if factor is None else factor
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    checked = config_number({"attention_factor": attention_factor}, "attention_factor", kind=float)
    return {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": original,
        "attention_factor": checked,
    }


def config_from_hf(hf: dict) -> Phi3Config:
    """Map a Phi-3 config.json onto Phi3Config; refuse what the reference model does not implement."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise CheckpointError("config.json's rope_parameters and rope_scaling must be objects")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type  # Phi3Config's renaming
    if rope_type not in ("default", "longrope"):
        raise CheckpointError(f"rope type {rope_type!r:.60} is not Phi-3's ('default' or 'longrope')")
    with config_errors():
        fields = llama.config_fields({k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
                                     | {"rope_theta": params.get("rope_theta", hf.get("rope_theta", 10000.0))},
                                     VARIANT)  # fmt: skip
        partial_factor = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        partial_factor = config_number({"partial_rotary_factor": partial_factor}, "partial_rotary_factor", kind=float)
        if partial_factor > 1.0:
            raise CheckpointError(f"config.json's partial_rotary_factor {partial_factor} is above 1")
        head_dim = fields["head_dim"] or fields["n_embd"] // fields["n_head"]
        if rope_type == "longrope":
            fields["rope_scaling"] = _longrope(hf, scaling, int(head_dim * partial_factor))
        tied = bool(hf.get("tie_word_embeddings", False))  # Phi3Config's default
        return Phi3Config(**fields | {"tie_word_embeddings": tied}, partial_rotary_factor=partial_factor)


def split_packed(state: dict[str, torch.Tensor], config: Phi3Config) -> dict[str, torch.Tensor]:
    """`state` with each layer's qkv_proj split into q_proj, k_proj, v_proj and gate_up_proj into gate_proj and
    up_proj (views, no copies; of TensorLoaders, loaders of the parts, nothing read), every packed shape checked."""
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    out = {}
    for name, tensor in state.items():
        for packed, parts, sizes in (
            ("self_attn.qkv_proj.weight", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), [q, kv, kv]),
            ("mlp.gate_up_proj.weight", ("mlp.gate_proj", "mlp.up_proj"), [config.n_inner] * 2),
        ):
            if name.endswith(packed):
                if tensor.ndim != 2 or tensor.shape[0] != sum(sizes):
                    raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, not {sum(sizes)} rows")
                stem = name.removesuffix(packed)
                out |= {f"{stem}{part}.weight": t for part, t in zip(parts, tensor.split(sizes), strict=True)}
                break
        else:
            out[name] = tensor
    return out


def load(folder: str | Path) -> Llama:
    """A Hugging Face phi3 folder as the reference model (eval, fp32); BOS/EOS ids as read_extras reads them."""
    return llama.load_llama(folder, config_from_hf=config_from_hf, transform=split_packed)


def _build(hf: dict, state: dict) -> Llama:
    config = config_from_hf(hf)
    return llama.build_llama(config, split_packed(state, config))


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a phi3 file (llama.cpp's Phi3MiniModel converter)."""
    heads, hidden = number(meta, "phi3.attention.head_count"), number(meta, "phi3.embedding_length")
    kv_heads = number(meta, "phi3.attention.head_count_kv", heads)
    if hidden % heads or heads % kv_heads:
        raise GGUFError(f"embedding_length {hidden}, head_count {heads}, head_count_kv {kv_heads} do not divide")
    head_dim = hidden // heads
    rotary_dim = number(meta, "phi3.rope.dimension_count", head_dim)
    if rotary_dim > head_dim or rotary_dim % 2 or int(head_dim * (rotary_dim / head_dim)) != rotary_dim:
        raise GGUFError(f"rope.dimension_count {rotary_dim} does not fit heads of {head_dim}")
    positions = context_length(meta, "phi3.context_length")
    window = number(meta, "phi3.attention.sliding_window", 0, positive=False)  # 0: none (Phi-4)
    problem = context_length_problem(window) if 0 < window < positions else None  # a window caps the context
    if problem:
        raise GGUFError(
            f"metadata phi3.attention.sliding_window = {problem} (a window shorter than the context caps it)"
        )
    config = {
        "architectures": [VARIANT.gguf_class],
        "model_type": "phi3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": number(meta, "phi3.feed_forward_length"),
        "num_hidden_layers": number(meta, "phi3.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": positions,
        "original_max_position_embeddings": number(meta, "phi3.rope.scaling.original_context_length", positions),
        "rms_norm_eps": number(meta, "phi3.attention.layer_norm_rms_epsilon", kind=float, below=MAX_NORM_EPSILON),
        "rope_theta": number(meta, "phi3.rope.freq_base", 10000.0, kind=float),
        "partial_rotary_factor": rotary_dim / head_dim,
        "sliding_window": window or None,
        "tie_word_embeddings": "output.weight" not in stored,
        "hidden_act": "silu",
    }
    if all(name in stored for name in FACTORS):
        short, long = (np.asarray(dequantize(stored[n].data, stored[n].tensor_type)).reshape(-1) for n in FACTORS)
        attention_factor = number(meta, "phi3.rope.scaling.attn_factor", kind=float)
        config["rope_scaling"] = {"rope_type": "longrope", "short_factor": short.tolist(),
                                  "long_factor": long.tolist(), "attention_factor": attention_factor}  # fmt: skip
    elif any(name in stored for name in FACTORS):
        raise GGUFError(f"the file has one of {FACTORS[0]} and {FACTORS[1]} but not the other")
    return config


def gguf_tensors(config: dict) -> dict[str, Entry]:
    """HF name -> where and how it is stored: the packed tensors as they are (unpermuted)."""
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    entries = {"model.embed_tokens.weight": Entry("token_embd.weight", (vocab, hidden))}
    for i in range(config["num_hidden_layers"]):
        for gguf_name, hf_name, shape in (
            ("attn_norm.weight", "input_layernorm.weight", (hidden,)),
            ("attn_qkv.weight", "self_attn.qkv_proj.weight", ((heads + 2 * kv_heads) * head_dim, hidden)),
            ("attn_output.weight", "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            ("ffn_norm.weight", "post_attention_layernorm.weight", (hidden,)),
            ("ffn_up.weight", "mlp.gate_up_proj.weight", (2 * inner, hidden)),
            ("ffn_down.weight", "mlp.down_proj.weight", (hidden, inner)),
        ):
            entries[f"model.layers.{i}.{hf_name}"] = Entry(f"blk.{i}.{gguf_name}", shape)
    entries["model.norm.weight"] = Entry("output_norm.weight", (hidden,))
    return with_head(entries, config, vocab, hidden)


def details(model: Llama) -> dict:
    return llama.details(model) | {"partial_rotary_factor": model.config.partial_rotary_factor}


ROWS = (
    Family(
        model_type="phi3",
        name="phi3",
        label=VARIANT.label,
        genai_type="phi3",
        load=load,
        build=_build,
        decoder=partial(llama.decoder, parts=PARTS),
        details=details,
        tokens=llama.tokens,
        gguf=GGUFLayout(architecture="phi3", config=gguf_config, tensors=gguf_tensors, also_read=FACTORS),
        lora_linears=LORA_LINEARS,
        lora_packed=LORA_PACKED,
        lazy_weights=True,
    ),
)
