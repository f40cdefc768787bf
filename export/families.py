"""Model families: for each, how a checkpoint folder loads into its reference model and how that
model becomes a Decoder (export/decoder.py), the one description the graph builder takes.

A family is a few lines of differences here, not branches elsewhere: export/graph.py, quantize/ and
runtime/ never ask which family they are handling. To add one: a reference model with the shared
forward signature (see export/parity.py), a loader, an adapter to Decoder, and a row in FAMILIES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..runtime.contract import TOKENIZER_FILE
from .checkpoint import CheckpointError, read_json
from .decoder import Decoder, Layer, Linear, NBits, Norm
from .gguf import GGUFError, gemma3_config, gemma3_tensors, gpt2_config, gpt2_tensors, llama_config, llama_tensors
from .gguf_blocks import Runs, widen
from .gpt2 import GPT
from .gpt2_checkpoint import build_gpt, config_from_hf, load_checkpoint
from .hf_checkpoint import build_llama, gemma3_config_from_hf, llama_config_from_hf, load_llama, read_extras, renamed
from .llama import MODEL_TYPES, VARIANTS, Llama, LlamaConfig, rope_cos_sin

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
    return NBits(bits, block_size, [widen(part, bits, block_size) for part in parts])


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
    """The graph's norms scale by their weight: an RMSNorm's offset (Gemma's 1 + w) is folded in, in fp32."""
    weight = _array(norm.weight) + np.float32(getattr(norm, "offset", 0.0))
    return Norm(weight, None if getattr(norm, "bias", None) is None else _array(norm.bias))


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
    if tokenizer_config.is_file() and (checkpoint / TOKENIZER_FILE).is_file():
        names = read_json(tokenizer_config)
        added = read_json(checkpoint / TOKENIZER_FILE).get("added_tokens")
        vocab = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)} if isinstance(added, list) else {}
        pad_name = names.get("pad_token")
        if isinstance(pad_name, str) and pad_name in vocab:
            pad = vocab[pad_name]
    return checked_tokens(config.vocab_size, bos, [eos], pad)


def _llama_layer(block: torch.nn.Module, c: LlamaConfig, blocks: Blocks | None, *, prefix: str) -> Layer:
    """One decoder layer; `prefix` names its tensors in `blocks` ("model.layers.3")."""
    a, mlp = block.self_attn, block.mlp

    def kept(*names: str) -> NBits | None:
        return kept_blocks(blocks, [f"{prefix}.{name}.weight" for name in names])

    sandwich = block.sandwich  # Gemma 3: post_attention_layernorm follows attention, pre_feedforward leads the MLP
    return Layer(
        attention_norm=_norm(block.input_layernorm),
        qkv=_packed([a.q_proj, a.k_proj, a.v_proj], kept("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        attention_out=_linear(a.o_proj, kept("self_attn.o_proj")),
        mlp_norm=_norm(block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm),
        up=_packed([mlp.gate_proj, mlp.up_proj], kept("mlp.gate_proj", "mlp.up_proj")),  # gate first
        down=_linear(mlp.down_proj, kept("mlp.down_proj")),
        q_norm=_norm(a.q_norm) if c.qk_norm else None,
        k_norm=_norm(a.k_norm) if c.qk_norm else None,
        attention_post_norm=_norm(block.post_attention_layernorm) if sandwich else None,
        mlp_post_norm=_norm(block.post_feedforward_layernorm) if sandwich else None,
        sliding_window=c.sliding_window if block.sliding else None,
    )


def llama_decoder(model: Llama, *, blocks: Blocks | None = None) -> Decoder:
    """blocks: keep the checkpoint's own quantized blocks where it has them (a GGUF file's); a packed linear
    keeps them when all its parts have blocks of the same bits."""
    c, m = model.config, model.model
    layers = [_llama_layer(block, c, blocks, prefix=f"model.layers.{i}") for i, block in enumerate(m.layers)]
    cos, sin = rope_cos_sin(c, c.n_positions)  # (P, head_dim / 2): GroupQueryAttention's rotary caches
    local = rope_cos_sin(c, c.n_positions, local=True) if c.sliding_window else None
    return Decoder(
        family=c.model_type,
        vocab_size=c.vocab_size,
        context_length=c.n_positions,
        n_embd=c.n_embd,
        n_head=c.n_head,
        n_kv_head=c.n_kv_head,
        head_dim=c.head_dim,
        inner_dim=c.n_inner,
        norm="rms",
        norm_eps=c.rms_norm_eps,
        activation="gelu_new" if c.hidden_act == "gelu_pytorch_tanh" else "silu",
        gated_mlp=True,
        embedding=_array(m.embed_tokens.weight),
        layers=layers,
        final_norm=_norm(m.norm),
        lm_head=None if c.tie_word_embeddings else _array(model.lm_head.weight).T,
        head_nbits=_head_blocks(blocks, c.tie_word_embeddings, "model.embed_tokens.weight"),
        embedding_nbits=None if c.tie_word_embeddings else kept_blocks(blocks, ["model.embed_tokens.weight"]),
        rotary_cos=_array(cos),
        rotary_sin=_array(sin),
        rotary_cos_local=None if local is None else _array(local[0]),
        rotary_sin_local=None if local is None else _array(local[1]),
        embedding_scale=float(np.float32(c.n_embd**0.5)) if c.embedding_scale else None,
        attention_scale=None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5,
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
        "qk_norm": c.qk_norm,
        **({"layer_types": c.layer_types, "sliding_window": c.sliding_window} if c.layer_types else {}),
        **({"rope_local_theta": c.rope_local_theta} if c.sliding_window else {}),
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
            if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
                raise CheckpointError(f"{name} should be an integer token id, not {token!r:.60}")
            if token is not None and not 0 <= token < vocab_size:
                raise CheckpointError(f"{name} {token} is outside the vocabulary (size {vocab_size})")
    return {"bos_token_id": bos, "eos_token_ids": eos, "pad_token_id": pad}


@dataclass(frozen=True)
class Family:
    name: str  # the manifest's architecture.type: config.json's model_type
    genai_type: str  # onnxruntime-genai's model type, written to genai_config.json
    load: Callable[[Path], torch.nn.Module]  # a Hugging Face-layout folder -> reference model (eval, fp32)
    decoder: Callable[..., Decoder]  # (reference model, *, blocks=None) -> what the fused graph is built from
    details: Callable[[torch.nn.Module], dict]  # facts for people, kept in the manifest
    tokens: Callable[[Path, torch.nn.Module], dict]  # folder -> bos_token_id, eos_token_ids, pad_token_id
    build: Callable[[dict, dict], torch.nn.Module]  # (Hugging Face config.json, state dict) -> model (GGUF files)
    gguf_architecture: str | None = None  # general.architecture of a llama.cpp file of this family
    gguf_config: Callable[[dict, dict, int], dict] | None = None  # (metadata, tensors, vocab) -> config.json
    gguf_tensors: Callable[[dict], dict] | None = None  # config.json -> HF name -> where the file stores it
    # LoRA: (module path with %d for the layer, the Decoder Layer's linear it is packed into), in packed order
    lora_linears: tuple[tuple[str, str], ...] = ()


LLAMA_LORA = tuple(
    (f"model.layers.%d.{path}", linear)
    for path, linear in (
        ("self_attn.q_proj", "qkv"), ("self_attn.k_proj", "qkv"), ("self_attn.v_proj", "qkv"),
        ("self_attn.o_proj", "attention_out"), ("mlp.gate_proj", "up"), ("mlp.up_proj", "up"),
        ("mlp.down_proj", "down"),
    )
)  # fmt: skip
GPT2_LORA = (
    ("transformer.h.%d.attn.c_attn", "qkv"),
    ("transformer.h.%d.attn.c_proj", "attention_out"),
    ("transformer.h.%d.mlp.c_fc", "up"),
    ("transformer.h.%d.mlp.c_proj", "down"),
)


def _llama_build(hf: dict, state: dict) -> Llama:
    return build_llama(llama_config_from_hf(hf), state)


# The Llama-family rows differ in data only: llama.py VARIANTS, and how llama.cpp writes them (Mistral files
# say architecture "llama", so only the converted layout of the other three is read).
LLAMA_GGUF = {  # model_type -> (transformers class, llama.cpp permuted Q/K rows)
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}


def _llama_family(name: str) -> Family:
    hf_class, permuted = LLAMA_GGUF.get(name, (None, False))
    qk_norm = VARIANTS[name].qk_norm
    return Family(
        name,
        name,
        load_llama,
        llama_decoder,
        llama_details,
        llama_tokens,
        _llama_build,
        gguf_architecture=name if hf_class else None,
        gguf_config=partial(llama_config, arch=name, hf_class=hf_class) if hf_class else None,
        gguf_tensors=partial(llama_tensors, permuted=permuted, qk_norm=qk_norm) if hf_class else None,
        lora_linears=LLAMA_LORA,
    )


# Gemma 3's image-and-text checkpoints (model_type gemma3) keep the text model under another prefix
# (transformers 5: model.language_model.*; 4.x: language_model.model.*) beside the vision tower, left out here.
GEMMA3_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", None),
    ("vision_tower.", None),
    ("model.multi_modal_projector.", None),
    ("multi_modal_projector.", None),
)


def _gemma3_family() -> Family:
    return Family(
        "gemma3_text",
        "gemma3_text",
        partial(load_llama, config_from_hf=gemma3_config_from_hf, renames=GEMMA3_RENAMES),
        llama_decoder,
        llama_details,
        llama_tokens,
        lambda hf, state: build_llama(gemma3_config_from_hf(hf), renamed(state, GEMMA3_RENAMES)),
        gguf_architecture="gemma3",
        gguf_config=gemma3_config,
        gguf_tensors=gemma3_tensors,
        lora_linears=LLAMA_LORA,
    )


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        "gpt2",
        "phi",  # genai's decoder-only type; its own "gpt2" expects a legacy combined past_%d cache
        load_checkpoint,
        gpt2_decoder,
        gpt2_details,
        gpt2_tokens,
        lambda hf, state: build_gpt(config_from_hf(hf), state),
        gguf_architecture="gpt2",
        gguf_config=gpt2_config,
        gguf_tensors=gpt2_tensors,
        lora_linears=GPT2_LORA,
    ),
    **{name: _llama_family(name) for name in MODEL_TYPES},
    "gemma3_text": _gemma3_family(),
    "gemma3": _gemma3_family(),  # its text part; the manifest says gemma3_text
}


def family_for(model_type: object) -> Family:
    """The family of a Hugging Face config.json's model_type."""
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}: edgelm exports {', '.join(sorted(FAMILIES))} models"
        )
    return FAMILIES[model_type]


def gguf_family(architecture: object) -> Family:
    """The family of a GGUF file's general.architecture."""
    by_gguf = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture}
    if architecture not in by_gguf:
        raise GGUFError(f"architecture {architecture!r:.60} is not supported ({', '.join(sorted(by_gguf))} are)")
    return by_gguf[architecture]
