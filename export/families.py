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

from .checkpoint import CheckpointError, load_checkpoint
from .decoder import Decoder, Layer, Linear, Norm
from .model import GPT


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).cpu().numpy()


def _linear(layer: torch.nn.Linear) -> Linear:
    return Linear(_array(layer.weight).T, None if layer.bias is None else _array(layer.bias))


def _norm(norm: torch.nn.Module) -> Norm:
    return Norm(_array(norm.weight), None if getattr(norm, "bias", None) is None else _array(norm.bias))


def gpt2_decoder(model: GPT) -> Decoder:
    c, t = model.config, model.transformer
    layers = [
        Layer(
            attention_norm=_norm(block.ln_1),
            qkv=_linear(block.attn.c_attn),
            attention_out=_linear(block.attn.c_proj),
            mlp_norm=_norm(block.ln_2),
            up=_linear(block.mlp.c_fc),
            down=_linear(block.mlp.c_proj),
        )
        for block in t.h
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
        position_table=_array(positions),
    )


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
    for name, value in (("eos_token_id", eos), ("bos_token_id", bos), ("pad_token_id", pad)):
        if not 0 <= value < config.vocab_size:
            raise CheckpointError(f"{name} {value} is outside the vocabulary (size {config.vocab_size})")
    return {"bos_token_id": bos, "eos_token_ids": [eos], "pad_token_id": pad}


@dataclass(frozen=True)
class Family:
    name: str  # the manifest's architecture.type
    load: Callable[[Path], torch.nn.Module]  # a Hugging Face-layout folder -> reference model (eval, fp32)
    decoder: Callable[[torch.nn.Module], Decoder]  # reference model -> what the fused graph is built from
    details: Callable[[torch.nn.Module], dict]  # facts for people, kept in the manifest
    tokens: Callable[[Path, torch.nn.Module], dict]  # folder -> bos_token_id, eos_token_ids, pad_token_id


FAMILIES: dict[str, Family] = {
    "gpt2": Family("gpt2", load_checkpoint, gpt2_decoder, gpt2_details, gpt2_tokens),
}


def family_for(model_type: object) -> Family:
    """The family of a Hugging Face config.json's model_type."""
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}: edgelm exports {', '.join(sorted(FAMILIES))} models"
        )
    return FAMILIES[model_type]
