"""SmolLM3 (model_type smollm3): a Llama whose every fourth layer takes no positions (NoPE: Q and K are not
rotated). How its folders and GGUF files load into the reference model (export/models/llama.py's Llama with a
SmolLM3Config), and its row; the Decoder is the Llama family's, whose layers say which rotate.

config.json names the layers by `no_rope_layers` (1: rotary, 0: NoPE), else by `no_rope_layer_interval` (every
interval-th layer NoPE, transformers' rule). llama.cpp's converter writes neither: its loader fixes the interval
at 4, and so does gguf_config. Its Q/K rows are permuted as Llama's (the converter is Llama's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..checkpoint import CheckpointError, config_errors, config_number, renamed
from ..gguf_metadata import Entry
from ..models.llama import Llama, LlamaConfig
from . import llama
from .family import Family, GGUFLayout

INTERVAL = 4  # transformers' default no_rope_layer_interval, and llama.cpp's fixed one
DEFAULT_THETA = 2_000_000.0  # transformers' SmolLM3Config.default_theta, where a config names no rope_theta
VARIANT = llama.Variant("SmolLM3", gguf_class="SmolLM3ForCausalLM", permuted=True)


@dataclass
class SmolLM3Config(LlamaConfig):
    """SmolLM3: Llama with layers that take no positions (LlamaConfig's comment says what the field does)."""

    model_type: str = "smollm3"
    rotary_layers: list[bool] | None = None


def rotary_layers(hf: dict, n_layer: int) -> list[bool]:
    """Whether each layer rotates: config.json's no_rope_layers (at least n_layer 0s and 1s), else every
    no_rope_layer_interval-th layer does not."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = config_number(hf, "no_rope_layer_interval", INTERVAL)
        return [(i + 1) % interval != 0 for i in range(n_layer)]
    if not isinstance(flags, list) or len(flags) < n_layer or any(f not in (0, 1) or f is True for f in flags):
        raise CheckpointError(f"config.json's no_rope_layers should be {n_layer} or more 0s and 1s")
    return [bool(f) for f in flags[:n_layer]]


def config_from_hf(hf: dict) -> SmolLM3Config:
    fields = llama.config_fields({"rope_theta": DEFAULT_THETA, **hf}, VARIANT)
    with config_errors():
        return SmolLM3Config(**fields, rotary_layers=rotary_layers(hf, fields["n_layer"]))


def _build(hf: dict, state: dict) -> Llama:
    return llama.build_llama(config_from_hf(hf), renamed(state, ()))


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a SmolLM3 file: Llama's keys, and llama.cpp's fixed NoPE interval."""
    config = llama.gguf_config(meta, stored, vocab, arch="smollm3", hf_class=VARIANT.gguf_class)
    return config | {"no_rope_layer_interval": INTERVAL}


def gguf_tensors(config: dict) -> dict[str, Entry]:
    return llama.gguf_tensors(config, permuted=True)


ROWS = (
    Family(
        model_type="smollm3",
        name="smollm3",
        label=VARIANT.label,
        genai_type="smollm3",
        load=partial(llama.load_llama, config_from_hf=config_from_hf),
        build=_build,
        decoder=llama.decoder,
        details=lambda model: llama.details(model) | {"rotary_layers": model.config.rotary_layers},
        tokens=llama.tokens,
        gguf=GGUFLayout(architecture="smollm3", config=gguf_config, tensors=gguf_tensors),
        lora_linears=llama.LORA_LINEARS,
        lazy_weights=True,
    ),
)
