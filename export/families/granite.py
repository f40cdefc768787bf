"""Granite dense (model_type granite: Granite 3.x and the dense Granite 4.x built on it): a Llama with four
multipliers, token embeddings times embedding_multiplier, attention scores times attention_multiplier (its
whole scale), attention and MLP outputs times residual_multiplier before each residual Add, and logits
divided by logits_scaling. How its folders and GGUF files load into the reference model (export/llama.py's
Llama with a GraniteConfig), and its row; the Decoder is the Llama family's, which carries the multipliers.

llama.cpp's converter (Llama's, so Q/K rows permuted) writes them as granite.embedding_scale,
granite.attention.scale, granite.residual_scale and granite.logit_scale; its loader reads an absent attention
scale as 1 / sqrt(head_dim) and an absent embedding or residual scale as none, and so does gguf_config.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..checkpoint import config_errors, config_number, renamed
from ..gguf_metadata import Entry, GGUFError, number
from ..llama import Llama, LlamaConfig
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


def config_from_hf(hf: dict) -> GraniteConfig:
    fields = llama.config_fields(hf, VARIANT)
    with config_errors():
        multipliers = {key: config_number(hf, key, 1.0, kind=float) for key in MULTIPLIERS}
        return GraniteConfig(**fields, **multipliers)


def _build(hf: dict, state: dict) -> Llama:
    return llama.build_llama(config_from_hf(hf), renamed(state, ()))


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a Granite file: Llama's keys and the four multipliers, absent ones as llama.cpp reads them."""
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


ROWS = (
    Family(
        model_type="granite",
        name="granite",
        label=VARIANT.label,
        genai_type="granite",
        load=partial(llama.load_llama, config_from_hf=config_from_hf),
        build=_build,
        decoder=llama.decoder,
        details=details,
        tokens=llama.tokens,
        gguf=GGUFLayout(architecture="granite", config=gguf_config, tensors=gguf_tensors),
        lora_linears=llama.LORA_LINEARS,
    ),
)
