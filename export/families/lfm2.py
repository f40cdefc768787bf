"""LFM2 / LFM2.5 (model_type lfm2): short gated convolutions and grouped-query attention layers, its folder read
into the reference model (export/lfm2.py), and its row.

Its convolution layers keep a state, not a KV cache, so its package's manifest says which layer holds what
(architecture.layer_types, architecture.conv_state) and names the state `past.%d.conv` / `present.%d.conv` as
onnxruntime-genai's LFM2 builder does. Both graphs are built: the standard one traced (export/traced.py), the
fused one (export/graph.py) with GroupQueryAttention and com.microsoft CausalConvWithState. GGUF files of it are
not read yet.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import (
    CheckpointError,
    config_context_length,
    config_errors,
    config_number,
    load_weights,
    read_config,
    read_extras,
    read_safetensors_folder,
)
from ..decoder import Decoder, Layer, ShortConv
from ..lfm2 import ATTENTION, CONV, Lfm2, Lfm2Config, rope_inv_freq
from ..limits import MAX_NORM_EPSILON
from .family import Blocks, Family, array, checked_tokens, linear, norm, packed


def intermediate_size(hf: dict) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it (block_auto_adjust_ff_dim: 2/3, the multiplier, then
    up to a multiple of block_multiple_of)."""
    size = config_number(hf, "intermediate_size")
    if hf.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            size = int(config_number(hf, "block_ffn_dim_multiplier", kind=float, positive=True) * size)
            multiple = config_number(hf, "block_multiple_of", 256)
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def layer_types(hf: dict, n_layer: int) -> list[str]:
    """config.json's layer_types, or the older full_attn_idxs (the attention layers' indices)."""
    kinds = hf.get("layer_types")
    if kinds is None and isinstance(hf.get("full_attn_idxs"), list):
        kinds = [ATTENTION if i in hf["full_attn_idxs"] else CONV for i in range(n_layer)]
    if not isinstance(kinds, list) or len(kinds) != n_layer or not set(kinds) <= {ATTENTION, CONV}:
        raise CheckpointError(
            f"config.json's layer_types must list {n_layer} of {ATTENTION!r} and {CONV!r}, got {kinds!r:.80}"
        )
    if ATTENTION not in kinds:
        raise CheckpointError("config.json's layer_types has no full_attention layer, which edgelm's LFM2 needs")
    return kinds


def config_from_hf(hf: dict) -> Lfm2Config:
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"LFM2 with rope scaling {rope or hf.get('rope_scaling')!r:.80} is not implemented")
    with config_errors():
        n_layer = config_number(hf, "num_hidden_layers")
        hidden, heads = config_number(hf, "hidden_size"), config_number(hf, "num_attention_heads")
        if hidden % heads:
            raise CheckpointError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        kv_heads = config_number(hf, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        theta = rope.get("rope_theta", hf.get("rope_theta", 1e6))
        return Lfm2Config(
            vocab_size=config_number(hf, "vocab_size"),
            n_embd=hidden,
            n_layer=n_layer,
            n_head=heads,
            n_kv_head=kv_heads,
            n_inner=intermediate_size(hf),
            layer_types=layer_types(hf, n_layer),
            n_positions=config_context_length(
                config_number(hf, "max_position_embeddings", 128000), "max_position_embeddings"
            ),
            conv_kernel=config_number(hf, "conv_L_cache", 3, below=64),
            conv_bias=bool(hf.get("conv_bias", False)),
            norm_eps=config_number(hf, "norm_eps", 1e-5, kind=float, below=MAX_NORM_EPSILON),
            rope_theta=config_number({"rope_theta": theta}, "rope_theta", kind=float, positive=True),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", True))),
        )


def build(config: Lfm2Config, state: dict[str, torch.Tensor]) -> Lfm2:
    model = load_weights(
        lambda: Lfm2(config), state, prefix="model.", embedding="model.embed_tokens.weight",
        tied=config.tie_word_embeddings, what="LFM2",
    )  # fmt: skip
    model.inv_freq = rope_inv_freq(config)  # a buffer: built on meta, not in the state dict
    return model.eval()


def load(folder: str | Path) -> Lfm2:
    folder = Path(folder)
    return build(config_from_hf(read_config(folder)), read_safetensors_folder(folder))


def decoder(model: Lfm2, *, blocks: Blocks | None = None) -> Decoder:
    """The fused graph's Decoder: convolution layers as ShortConv (ONNX Runtime's CausalConvWithState), attention
    layers as the Llama family's with head norms. blocks: unused (no GGUF files of LFM2 are read yet)."""
    c = model.config
    layers = []
    for block in model.model.layers:
        mlp = block.feed_forward
        shared = dict(attention_norm=norm(block.operator_norm), mlp_norm=norm(block.ffn_norm),
                      up=packed([mlp.w1, mlp.w3], None), down=linear(mlp.w2))  # fmt: skip
        if block.kind == CONV:
            conv = block.conv
            bias = None if conv.conv.bias is None else array(conv.conv.bias)
            short = ShortConv(linear(conv.in_proj), array(conv.conv.weight), bias, linear(conv.out_proj))
            layers.append(Layer(qkv=None, attention_out=None, conv=short, **shared))
        else:
            attn = block.self_attn
            qkv = packed([attn.q_proj, attn.k_proj, attn.v_proj], None)
            layers.append(Layer(qkv=qkv, attention_out=linear(attn.out_proj), q_norm=norm(attn.q_layernorm),
                                k_norm=norm(attn.k_layernorm), **shared))  # fmt: skip
    angles = torch.arange(c.n_positions, dtype=torch.float32).unsqueeze(1) * rope_inv_freq(c)  # (P, hs / 2)
    return Decoder(
        family="lfm2", vocab_size=c.vocab_size, context_length=c.n_positions, n_embd=c.n_embd, n_head=c.n_head,
        n_kv_head=c.n_kv_head, head_dim=c.head_dim, inner_dim=c.n_inner, norm="rms", norm_eps=c.norm_eps,
        activation="silu", gated_mlp=True, embedding=array(model.model.embed_tokens.weight), layers=layers,
        final_norm=norm(model.model.embedding_norm),
        lm_head=None if c.tie_word_embeddings else array(model.lm_head.weight).T,
        rotary_cos=array(angles.cos()), rotary_sin=array(angles.sin()),
    )  # fmt: skip


def details(model: Lfm2) -> dict:
    c = model.config
    return {
        "n_embd": c.n_embd,
        "n_inner": c.n_inner,
        "rope_theta": c.rope_theta,
        "norm_eps": c.norm_eps,
        "conv_kernel": c.conv_kernel,
        "tie_word_embeddings": c.tie_word_embeddings,
        "parameters": model.num_parameters(),
    }


def tokens(folder: Path, model: Lfm2) -> dict:
    extras = read_extras(folder)
    return checked_tokens(
        model.config.vocab_size, extras["bos_token_id"], extras["eos_token_ids"], extras["pad_token_id"]
    )


ROWS = (
    Family(
        model_type="lfm2",
        name="lfm2",
        label="LFM2/LFM2.5",
        genai_type="lfm2",
        load=load,
        build=lambda hf, state: build(config_from_hf(hf), state),
        decoder=decoder,
        details=details,
        tokens=tokens,
    ),
)
