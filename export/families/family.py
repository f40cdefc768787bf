"""A family's row (`Family`, built by keyword) and the pieces every family module builds its rows and its
Decoder from: the reference model's tensors as Decoder parts, a GGUF file's blocks kept on them, the special
token ids the manifest keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import CheckpointError
from ..decoder import Decoder
from ..gguf_blocks import LazyRuns, Runs
from ..gguf_metadata import Entry
from ..lazy_weights import LazyArray, concatenated, float32_array
from ..linear import Linear, NBits, Norm

# checkpoint tensor name -> its MatMulNBits runs (export/gguf_blocks.py), or None where the tensor has none
# (export/gguf.py GGUFModel.matmul_nbits)
Blocks = Callable[[str], Runs | LazyRuns | None]


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp writes a family: its general.architecture, and what export/gguf.py asks of the file."""

    architecture: str  # general.architecture
    config: Callable[[dict, dict, int], dict]  # (metadata, stored tensors, vocabulary rows) -> config.json
    tensors: Callable[[dict], dict[str, Entry]]  # config.json -> HF name -> where and how the file stores it
    also_read: tuple[str, ...] = ()  # tensors `config` reads that are not weights (Llama 3's rope_freqs.weight)
    # config.json -> the name prefixes of tensors the model leaves out (Qwen3.5's multi-token-prediction block)
    left_out: Callable[[dict], tuple[str, ...]] | None = None
    # the chat template of a file that carries none (a base model's): the family's turn format, as llama.cpp's
    # built-in templates give it; None: such a file has no chat
    chat_template: str | None = None


@dataclass(frozen=True)
class Family:
    model_type: str  # the config.json model_type this row reads
    name: str  # the manifest's architecture.type (Gemma 3's image-and-text gemma3 exports as gemma3_text)
    label: str  # for people: help texts and error messages ("Qwen2/Qwen2.5")
    genai_type: str | None  # onnxruntime-genai's model type for genai_config.json; None: genai cannot run it
    load: Callable[[Path], torch.nn.Module]  # a Hugging Face-layout folder -> reference model (eval, fp32)
    build: Callable[[dict, dict], torch.nn.Module]  # (config.json, state dict) -> reference model (GGUF files)
    decoder: Callable[..., Decoder]  # (reference model, *, blocks=None) -> what the fused graph is built from
    details: Callable[[torch.nn.Module], dict]  # facts for people, kept in the manifest
    tokens: Callable[[Path, torch.nn.Module], dict]  # folder -> bos_token_id, eos_token_ids, pad_token_id
    gguf: GGUFLayout | None = None  # None: no GGUF files of this model_type are read
    # LoRA: (module path with %d for the layer, the Decoder Layer's linear it is packed into), in packed order
    lora_linears: tuple[tuple[str, str], ...] = ()
    # checkpoint linears the reference model holds split (Phi-3's qkv_proj): (name, its parts in row order)
    lora_packed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # LoRA: model -> {module path with %d: [(first output column, count), ...]} for the parts whose outputs are not
    # one block in lora_linears' order inside their packed linear (Qwen3.5's q_proj: each head's query and gate)
    lora_columns: Callable[[torch.nn.Module], dict[str, list[tuple[int, int]]]] | None = None
    # its reference model and Decoder read weights through export/lazy_weights.py (meta parameters with loaders:
    # export streams them); False: the model is read whole into memory as fp32 when opened
    lazy_weights: bool = False


def kept_blocks(blocks: Blocks | None, names: list[str]) -> NBits | None:
    """The MatMulNBits blocks of a linear made of the checkpoint weights `names`, packed along its outputs
    in that order; None (the linear stays float) when a part has no blocks. Parts of different types meet
    in the widest bits and shortest runs (a Q4_K query beside a Q6_K value: 8 bits, runs of 16), exactly."""
    parts = [blocks(name) for name in names] if blocks is not None else [None]
    if any(part is None for part in parts):
        return None
    bits, block_size = max(part.bits for part in parts), min(part.block_size for part in parts)
    return NBits(bits, block_size, parts)  # widened when the graph unpacks them (NBits.parts)


def head_blocks(blocks: Blocks | None, tied: bool, embedding: str) -> NBits | None:
    """The LM head's blocks; a tied embedding gathers its rows from them too (writers/nbits_gather.py)."""
    return kept_blocks(blocks, [embedding if tied else "lm_head.weight"])


def array(tensor: torch.Tensor) -> np.ndarray | LazyArray:
    """A parameter as float32; a large lazy one (export/lazy_weights.py) stays unread until the graph writes it."""
    return float32_array(tensor)


def linear(layer: torch.nn.Linear, nbits: NBits | None = None) -> Linear:
    bias = None if layer.bias is None else array(layer.bias)
    return Linear(None, bias, nbits) if nbits is not None else Linear(array(layer.weight).T, bias)


def packed(layers: list[torch.nn.Linear], nbits: NBits | None) -> Linear:
    """Linears with one input packed along their outputs (Q, K, V; gate, up): one MatMul."""
    biases = [layer.bias for layer in layers]
    bias = None if biases[0] is None else concatenated([array(b) for b in biases])
    if nbits is not None:
        return Linear(None, bias, nbits)
    return Linear(concatenated([array(layer.weight) for layer in layers]).T, bias)


def norm(module: torch.nn.Module) -> Norm:
    """The graph's norms scale by their weight: an RMSNorm's offset (Gemma's 1 + w) is folded in, in fp32."""
    weight = array(module.weight) + np.float32(getattr(module, "offset", 0.0))
    return Norm(weight, None if getattr(module, "bias", None) is None else array(module.bias))


def checked_tokens(vocab_size: int, bos: int | None, eos: list[int], pad: int | None) -> dict:
    """Special token ids as the manifest keeps them; padding falls back to the first EOS."""
    if not eos:
        raise CheckpointError("the checkpoint names no EOS token (config.json / generation_config.json eos_token_id)")
    pad = eos[0] if pad is None else pad
    for name, value in (("eos_token_id", eos), ("bos_token_id", [bos]), ("pad_token_id", [pad])):
        for token in value:
            if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
                raise CheckpointError(f"{name} should be an integer token id, not {token!r:.60}")
            if token is not None and not 0 <= token < vocab_size:
                raise CheckpointError(f"{name} {token} is outside the vocabulary (size {vocab_size})")
    return {"bos_token_id": bos, "eos_token_ids": eos, "pad_token_id": pad}
