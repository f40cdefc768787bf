"""Granite dense: model_type granite (Granite 3.x), and granitemoehybrid with attention layers only and no
experts (the dense Granite 4.0, granite-4.0-micro among them). A Llama with four multipliers: token embeddings
times embedding_multiplier, attention scores times attention_multiplier (its whole scale), attention and MLP
outputs times residual_multiplier before each residual Add, and logits divided by logits_scaling. How its
folders and GGUF files load into the reference model (export/models/llama.py's Llama with a GraniteConfig), and its
rows; the Decoder is the Llama family's, which carries the multipliers.

llama.cpp's converter (Llama's, so Q/K rows permuted) writes them as granite.embedding_scale,
granite.attention.scale, granite.residual_scale and granite.logit_scale; its loader reads an absent attention
scale as 1 / sqrt(head_dim) and an absent embedding or residual scale as none, and so does gguf_config. It
writes a dense granitemoehybrid as architecture granite (its head_count_kv one number per layer), so those
files read as Granite 3's.

granitemoehybrid keeps the MLP's gate and up packed (shared_mlp.input_linear, gate first) and the down
projection as shared_mlp.output_linear, split and renamed here; its position_embedding_type is "rope" or none
(no layer rotates). Its Mamba layers (Granite 4.0-H) and experts are refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..checkpoint import (
    CheckpointError,
    config_errors,
    config_number,
    renamed,
)
from ..gguf_metadata import Entry, GGUFError, number
from ..models.llama import Llama, LlamaConfig
from . import llama
from .family import Family, GGUFLayout

VARIANT = llama.Variant("Granite", gguf_class="GraniteForCausalLM", permuted=True)
MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


@dataclass
class GraniteConfig(LlamaConfig):
    """Granite: Llama with four multipliers (LlamaConfig's comments say what each does); transformers' defaults."""

    model_type: str = "granite"
    embedding_multiplier: float | None = 1.0
    attention_multiplier: float | None = 1.0
    residual_multiplier: float | None = 1.0
    logits_scaling: float | None = 1.0
    rotary_layers: list[bool] | None = None


def config_from_hf(hf: dict) -> GraniteConfig:
    fields = llama.config_fields(hf, VARIANT)
    with config_errors():
        multipliers = {key: config_number(hf, key, 1.0, kind=float) for key in MULTIPLIERS}
        return GraniteConfig(**fields, **multipliers)


def _build(hf: dict, state: dict) -> Llama:
    return llama.build_llama(config_from_hf(hf), renamed(state, ()))


def hybrid_config_from_hf(hf: dict) -> GraniteConfig:
    """A granitemoehybrid config.json with attention layers only and no experts, as Granite's."""
    kinds = sorted(set(hf.get("layer_types") or ["linear_attention"]) - {"attention", "full_attention"})
    if kinds:
        raise CheckpointError(f"config.json's layer_types has {kinds[0]!r:.40} layers (Granite 4.0-H's Mamba), "
                              "which edgelm does not implement: only attention layers")  # fmt: skip
    if hf.get("num_local_experts"):
        raise CheckpointError("config.json sets num_local_experts (mixture of experts): edgelm does not implement it")
    rope = hf.get("position_embedding_type")
    if rope not in ("rope", None, "nope"):
        raise CheckpointError(f"config.json's position_embedding_type {rope!r:.40} is not 'rope' or none")
    config = config_from_hf(hf | {"intermediate_size": hf.get("shared_intermediate_size", 1024)})
    rotary = None if rope == "rope" else [False] * config.n_layer  # no positions at all
    return dataclasses.replace(config, rotary_layers=rotary)


def hybrid_state(state: dict[str, torch.Tensor], config: GraniteConfig) -> dict[str, torch.Tensor]:
    """shared_mlp.input_linear split into gate_proj and up_proj (gate first, views or loaders of them),
    output_linear as down_proj."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("shared_mlp.input_linear.weight"):
            if tensor.ndim != 2 or tensor.shape[0] != 2 * config.n_inner:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, not {2 * config.n_inner} rows")
            stem = name.removesuffix("shared_mlp.input_linear.weight")
            out[f"{stem}mlp.gate_proj.weight"], out[f"{stem}mlp.up_proj.weight"] = tensor.chunk(2)
        else:
            out[name.replace("shared_mlp.output_linear.", "mlp.down_proj.")] = tensor
    return out


def load_hybrid(folder: str | Path) -> Llama:
    """A Hugging Face granitemoehybrid folder (dense) as the reference model; BOS/EOS as read_extras reads them."""
    return llama.load_llama(folder, config_from_hf=hybrid_config_from_hf, transform=hybrid_state)


def _build_hybrid(hf: dict, state: dict) -> Llama:
    config = hybrid_config_from_hf(hf)
    return llama.build_llama(config, hybrid_state(state, config))


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a Granite file: Llama's keys and the four multipliers, absent ones as llama.cpp reads them."""
    kv_heads = meta.get("granite.attention.head_count_kv")
    if isinstance(kv_heads, list):  # a dense granitemoehybrid's: one number per layer, all the same
        if len(set(kv_heads)) != 1:
            raise GGUFError("metadata granite.attention.head_count_kv differs between layers: not supported")
        meta = meta | {"granite.attention.head_count_kv": kv_heads[0]}
    config = llama.gguf_config(meta, stored, vocab, arch="granite", hf_class=VARIANT.gguf_class)
    if meta.get("granite.rope.scaling.finetuned") is False:  # llama.cpp's switch that turns rotary off
        raise GGUFError("metadata granite.rope.scaling.finetuned is false (no rotary positions): not supported")
    return config | {
        "embedding_multiplier": number(meta, "granite.embedding_scale", 1.0, kind=float),
        "attention_multiplier": number(meta, "granite.attention.scale", config["head_dim"] ** -0.5, kind=float),
        "residual_multiplier": number(meta, "granite.residual_scale", 1.0, kind=float),
        "logits_scaling": number(meta, "granite.logit_scale", kind=float),
    }


def gguf_tensors(config: dict) -> dict[str, Entry]:
    return llama.gguf_tensors(config, permuted=True)


def details(model: Llama) -> dict:
    return llama.details(model) | {key: getattr(model.config, key) for key in MULTIPLIERS}


def _row(model_type: str, load, build, gguf: GGUFLayout | None) -> Family:
    return Family(
        model_type=model_type,
        name=model_type,
        label=VARIANT.label,
        genai_type=model_type,
        load=load,
        build=build,
        decoder=llama.decoder,
        details=details,
        tokens=llama.tokens,
        gguf=gguf,
        lora_linears=llama.LORA_LINEARS,
        lazy_weights=True,
    )


# llama.cpp writes both as architecture granite, whose config.json is granite's
ROWS = (
    _row("granite", partial(llama.load_llama, config_from_hf=config_from_hf), _build,
         GGUFLayout(architecture="granite", config=gguf_config, tensors=gguf_tensors)),
    _row("granitemoehybrid", load_hybrid, _build_hybrid, None),
)  # fmt: skip
