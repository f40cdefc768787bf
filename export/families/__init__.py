"""Model families: one module each (gpt2.py; llama.py for Llama, Mistral, Qwen2 and Qwen3; gemma3.py for
Gemma 3; gemma4.py for Gemma 4's text model;
smollm3.py; granite.py; phi3.py; lfm2.py and qwen35.py, the hybrids with layer states), holding how its
Hugging Face folders and GGUF files load into its reference model, the Decoder (export/decoder.py) that model
becomes, and its rows (`Family`, family.py). This table gathers the rows: the one list export, its error messages
and the CLI's help read.

A family is its module, not branches elsewhere: export/graph.py, quantize/ and runtime/ never ask which
family they are handling. Adding one is a module with a ROWS tuple, named in MODULES below.
"""

from __future__ import annotations

from ..checkpoint import CheckpointError
from ..gguf_metadata import GGUFError
from . import gemma3, gemma4, gpt2, granite, lfm2, llama, phi3, qwen35, smollm3
from .family import Blocks, Family, GGUFLayout, checked_tokens, kept_blocks

__all__ = ["FAMILIES", "Blocks", "Family", "GGUFLayout", "checked_tokens", "family_for", "gguf_family", "kept_blocks"]

MODULES = (gpt2, llama, gemma3, gemma4, smollm3, granite, phi3, lfm2, qwen35)
FAMILIES: dict[str, Family] = {row.model_type: row for module in MODULES for row in module.ROWS}
GGUF_FAMILIES: dict[str, Family] = {row.gguf.architecture: row for row in FAMILIES.values() if row.gguf}
# families read and refused, with what is missing (config.json model_type or GGUF architecture -> why)
REFUSED: dict[str, str] = {}
GGUF_REFUSED: dict[str, str] = {}


def family_for(model_type: object) -> Family:
    """The family of a Hugging Face config.json's model_type."""
    if model_type in REFUSED:
        raise CheckpointError(REFUSED[model_type])
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}: edgelm exports {', '.join(sorted(FAMILIES))} models"
        )
    return FAMILIES[model_type]


def gguf_family(architecture: object) -> Family:
    """The family of a GGUF file's general.architecture."""
    if architecture in GGUF_REFUSED:
        raise GGUFError(GGUF_REFUSED[architecture])
    if architecture not in GGUF_FAMILIES:
        raise GGUFError(f"architecture {architecture!r:.60} is not supported ({', '.join(sorted(GGUF_FAMILIES))} are)")
    return GGUF_FAMILIES[architecture]


def supported_sources() -> str:
    """What export reads, in words, from the table (the CLI's help)."""
    labels = list(dict.fromkeys(row.label for row in FAMILIES.values()))
    return (
        f"a Hugging Face folder of {_either(labels)} (config.json's model_type {_either(list(FAMILIES))}), or a "
        f"GGUF file of architecture {_either(list(GGUF_FAMILIES))}"
    )


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
