"""Model families: for each, how a checkpoint folder loads into its reference model and how that
model becomes a Decoder (export/decoder.py), the one description the graph builder takes.

A family is a few lines of differences here, not branches elsewhere: export/graph.py, quantize/ and
runtime/ never ask which family they are handling. To add one: a reference model with the shared
forward signature (see export/parity.py), a loader, an adapter to Decoder, and a row in FAMILIES.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint import CheckpointError, build_gpt, config_from_hf, load_checkpoint
from .decoder import Decoder, Layer, Linear, NBits, Norm
from .gguf_blocks import Runs, pack, widen
from .hf_checkpoint import build_llama, llama_config_from_hf, load_llama, read_extras
from .llama import MODEL_TYPES, Llama, rope_cos_sin
from .model import GPT

# checkpoint tensor name -> its MatMulNBits runs (export/gguf_blocks.py), or None where the tensor has none
# (export/gguf.py GGUFModel.matmul_nbits)
Blocks = Callable[[str], Runs | None]


def kept_blocks(blocks: Blocks | None, names: list[str]) -> NBits | None:
    """The MatMulNBits blocks of a linear made of the checkpoint weights `names`, packed along its outputs
    in that order; None (the linear stays float) when a part has no blocks. Parts of different types meet
    in the widest bits and shortest runs (a Q4_K query beside a Q6_K value: 8 bits, runs of 16), exactly."""
    parts = [blocks(name) for name in names] if blocks is not None else [None]
    if any(part is None for part in parts):
        return None
    bits, block_size = max(part.bits for part in parts), min(part.block_size for part in parts)
    parts = [widen(part, bits, block_size) for part in parts]
    values = np.concatenate([part.values for part in parts])  # (N, K)
    offsets = None
    if any(part.offsets is not None for part in parts):  # the others' runs have offset 0
        pieces = [part.offsets if part.offsets is not None else np.zeros_like(part.scales) for part in parts]
        offsets = np.ascontiguousarray(np.concatenate(pieces).T)  # (K / block_size, N)
    scales = np.concatenate([part.scales for part in parts])  # (N, K / block_size)
    return NBits(bits, pack(values, bits, block_size), scales, None, offsets, block_size)


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).cpu().numpy()


def _linear(layer: torch.nn.Linear, nbits: NBits | None = None) -> Linear:
    bias = None if layer.bias is None else _array(layer.bias)
    return Linear(None, bias, nbits) if nbits is not None else Linear(_array(layer.weight).T, bias)


def _packed(layers: list[torch.nn.Linear], nbits: NBits | None) -> Linear:
    """Linears with one input packed along their outputs (Q, K, V; gate, up): one MatMul."""
    biases = [layer.bias for layer in layers]
    bias = None if biases[0] is None else _array(torch.cat(biases))
    if nbits is not None:
        return Linear(None, bias, nbits)
    return Linear(_array(torch.cat([layer.weight for layer in layers])).T, bias)


def _norm(norm: torch.nn.Module) -> Norm:
    return Norm(_array(norm.weight), None if getattr(norm, "bias", None) is None else _array(norm.bias))


def gpt2_decoder(model: GPT, *, blocks: Blocks | None = None) -> Decoder:
    """blocks: keep the checkpoint's own quantized blocks where it has them (a GGUF file's)."""
    c, t = model.config, model.transformer

    def linear(layer: torch.nn.Linear, name: str) -> Linear:
        return _linear(layer, kept_blocks(blocks, [f"{name}.weight"]))

    layers = [
        Layer(
            attention_norm=_norm(block.ln_1),
            qkv=linear(block.attn.c_attn, f"transformer.h.{i}.attn.c_attn"),
            attention_out=linear(block.attn.c_proj, f"transformer.h.{i}.attn.c_proj"),
            mlp_norm=_norm(block.ln_2),
            up=linear(block.mlp.c_fc, f"transformer.h.{i}.mlp.c_fc"),
            down=linear(block.mlp.c_proj, f"transformer.h.{i}.mlp.c_proj"),
        )
        for i, block in enumerate(t.h)
    ]
    positions = t.wpe.weight if c.positional == "learned" else model.sinusoid
    return Decoder(
        family="gpt2",
        genai_type="phi",  # see runtime/contract.py genai_config
        vocab_size=c.vocab_size,
        context_length=c.n_positions,
        n_embd=c.n_embd,
        n_head=c.n_head,
        n_kv_head=c.n_head,
        head_dim=c.head_dim,
        inner_dim=c.inner_dim,
        norm="layer",
        norm_eps=c.layer_norm_epsilon,
        activation=c.activation,
        gated_mlp=False,
        embedding=_array(t.wte.weight),
        layers=layers,
        final_norm=_norm(t.ln_f),
        lm_head=None if c.tie_word_embeddings else _array(model.lm_head.weight).T,
        head_nbits=_head_blocks(blocks, c.tie_word_embeddings, "transformer.wte.weight"),
        embedding_nbits=None if c.tie_word_embeddings else kept_blocks(blocks, ["transformer.wte.weight"]),
        position_table=_array(positions),
    )


def _head_blocks(blocks: Blocks | None, tied: bool, embedding: str) -> NBits | None:
    """The LM head's blocks; a tied embedding gathers its rows from them too (edgelm/nbits_gather.py)."""
    return kept_blocks(blocks, [embedding if tied else "lm_head.weight"])


def gpt2_details(model: GPT) -> dict:
    c = model.config
    return {
        "n_embd": c.n_embd,
        "positional": c.positional,
        "tie_word_embeddings": c.tie_word_embeddings,
        "parameters": model.num_parameters(),
    }


def gpt2_tokens(checkpoint: Path, model: GPT) -> dict:
    """Token ids from config.json, the pad token from tokenizer_config.json when tokenizer.json has it."""
    config = model.config
    eos, bos = config.eos_token_id, config.bos_token_id
    pad = eos
    tokenizer_config = checkpoint / "tokenizer_config.json"
    if tokenizer_config.is_file() and (checkpoint / "tokenizer.json").is_file():
        names = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        vocab = {t["content"]: t["id"] for t in json.loads((checkpoint / "tokenizer.json").read_text())["added_tokens"]}
        pad_name = names.get("pad_token")
        if isinstance(pad_name, str) and pad_name in vocab:
            pad = vocab[pad_name]
    return checked_tokens(config.vocab_size, bos, [eos], pad)


def llama_decoder(model: Llama, *, blocks: Blocks | None = None) -> Decoder:
    """blocks: keep the checkpoint's own quantized blocks where it has them (a GGUF file's); a packed linear
    keeps them when all its parts have blocks of the same bits."""
    c, m = model.config, model.model
    layers = []
    for i, block in enumerate(m.layers):
        a, mlp, p = block.self_attn, block.mlp, f"model.layers.{i}"

        def kept(*names: str) -> NBits | None:
            return kept_blocks(blocks, [f"{p}.{name}.weight" for name in names])  # noqa: B023  (called at once)

        layers.append(
            Layer(
                attention_norm=_norm(block.input_layernorm),
                qkv=_packed(
                    [a.q_proj, a.k_proj, a.v_proj], kept("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
                ),
                attention_out=_linear(a.o_proj, kept("self_attn.o_proj")),
                mlp_norm=_norm(block.post_attention_layernorm),
                up=_packed([mlp.gate_proj, mlp.up_proj], kept("mlp.gate_proj", "mlp.up_proj")),  # gate first
                down=_linear(mlp.down_proj, kept("mlp.down_proj")),
            )
        )
    cos, sin = rope_cos_sin(c, c.n_positions)  # (P, head_dim / 2): GroupQueryAttention's rotary caches
    return Decoder(
        family=c.model_type,
        genai_type=c.model_type,
        vocab_size=c.vocab_size,
        context_length=c.n_positions,
        n_embd=c.n_embd,
        n_head=c.n_head,
        n_kv_head=c.n_kv_head,
        head_dim=c.head_dim,
        inner_dim=c.n_inner,
        norm="rms",
        norm_eps=c.rms_norm_eps,
        activation="silu",
        gated_mlp=True,
        embedding=_array(m.embed_tokens.weight),
        layers=layers,
        final_norm=_norm(m.norm),
        lm_head=None if c.tie_word_embeddings else _array(model.lm_head.weight).T,
        head_nbits=_head_blocks(blocks, c.tie_word_embeddings, "model.embed_tokens.weight"),
        embedding_nbits=None if c.tie_word_embeddings else kept_blocks(blocks, ["model.embed_tokens.weight"]),
        rotary_cos=_array(cos),
        rotary_sin=_array(sin),
    )


def llama_details(model: Llama) -> dict:
    c = model.config
    return {
        "n_embd": c.n_embd,
        "n_inner": c.n_inner,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": c.attention_bias,
        "tie_word_embeddings": c.tie_word_embeddings,
        "parameters": model.num_parameters(),
    }


def llama_tokens(folder: Path, model: Llama) -> dict:
    extras = read_extras(folder)
    return checked_tokens(
        model.config.vocab_size, extras["bos_token_id"], extras["eos_token_ids"], extras["pad_token_id"]
    )


def checked_tokens(vocab_size: int, bos: int | None, eos: list[int], pad: int | None) -> dict:
    """Special token ids as the manifest keeps them; padding falls back to the first EOS."""
    if not eos:
        raise CheckpointError("the checkpoint names no EOS token (config.json / generation_config.json eos_token_id)")
    pad = eos[0] if pad is None else pad
    for name, value in (("eos_token_id", eos), ("bos_token_id", [bos]), ("pad_token_id", [pad])):
        for token in value:
            if token is not None and not 0 <= token < vocab_size:
                raise CheckpointError(f"{name} {token} is outside the vocabulary (size {vocab_size})")
    return {"bos_token_id": bos, "eos_token_ids": eos, "pad_token_id": pad}


@dataclass(frozen=True)
class Family:
    name: str  # the manifest's architecture.type
    load: Callable[[Path], torch.nn.Module]  # a Hugging Face-layout folder -> reference model (eval, fp32)
    decoder: Callable[..., Decoder]  # (reference model, *, blocks=None) -> what the fused graph is built from
    details: Callable[[torch.nn.Module], dict]  # facts for people, kept in the manifest
    tokens: Callable[[Path, torch.nn.Module], dict]  # folder -> bos_token_id, eos_token_ids, pad_token_id
    build: Callable[[dict, dict], torch.nn.Module]  # (Hugging Face config.json, state dict) -> model (GGUF files)


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        "gpt2",
        load_checkpoint,
        gpt2_decoder,
        gpt2_details,
        gpt2_tokens,
        lambda hf, state: build_gpt(config_from_hf(hf), state),
    ),
    **{
        name: Family(
            name,
            load_llama,
            llama_decoder,
            llama_details,
            llama_tokens,
            lambda hf, state: build_llama(llama_config_from_hf(hf), state),
        )
        for name in MODEL_TYPES
    },
}


def family_for(model_type: object) -> Family:
    """The family of a Hugging Face config.json's model_type."""
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}: edgelm exports {', '.join(sorted(FAMILIES))} models"
        )
    return FAMILIES[model_type]
