"""LFM2 / LFM2.5 (model_type lfm2): short gated convolutions and grouped-query attention layers, its folder read
into the reference model (export/models/lfm2.py), and its row.

Its convolution layers keep a state, not a KV cache, so its package's manifest says which layer holds what
(architecture.layer_types, architecture.conv_state) and names the state `past.%d.conv` / `present.%d.conv` as
onnxruntime-genai's LFM2 builder does. Both graphs are built: the standard one traced (export/traced.py), the
fused one (export/graph.py) with GroupQueryAttention and com.microsoft CausalConvWithState. A GGUF file reads as
llama.cpp's converter (conversion/lfm2.py) writes it: per-layer head_count_kv (0: a convolution layer), the
depthwise kernel squeezed to (C, L), `token_embd_norm` for the final norm.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from ..checkpoint import (
    CheckpointError,
    config_context_length,
    config_errors,
    config_number,
    load_weights,
    read_config,
    read_safetensors_folder,
)
from ..decoder import Decoder, Layer, NBits, Rotary
from ..gguf_metadata import Entry, GGUFError, context_length, number, with_head
from ..limits import MAX_NORM_EPSILON
from ..mechanisms.short_conv import ShortConv
from ..models.lfm2 import ATTENTION, CONV, Lfm2, Lfm2Config, rope_inv_freq
from . import llama
from .family import Blocks, Family, GGUFLayout, array, head_blocks, kept_blocks, linear, norm, packed


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
    return build(config_from_hf(read_config(folder)), read_safetensors_folder(folder, lazy=True))


def decoder(model: Lfm2, *, blocks: Blocks | None = None) -> Decoder:
    """The fused graph's Decoder: convolution layers as ShortConv (ONNX Runtime's CausalConvWithState), attention
    layers as the Llama family's with head norms. blocks: keep a GGUF file's own quantized blocks on the linears."""
    c = model.config
    layers = []
    for i, block in enumerate(model.model.layers):
        kept = partial(_kept, blocks, f"model.layers.{i}.")
        mlp = block.feed_forward
        shared = dict(attention_norm=norm(block.operator_norm), mlp_norm=norm(block.ffn_norm),
                      up=packed([mlp.w1, mlp.w3], kept(["feed_forward.w1", "feed_forward.w3"])),
                      down=linear(mlp.w2, kept(["feed_forward.w2"])))  # fmt: skip
        if block.kind == CONV:
            conv = block.conv
            bias = None if conv.conv.bias is None else array(conv.conv.bias)
            short = ShortConv(linear(conv.in_proj, kept(["conv.in_proj"])), array(conv.conv.weight), bias,
                              linear(conv.out_proj, kept(["conv.out_proj"])))  # fmt: skip
            layers.append(Layer(qkv=None, attention_out=None, conv=short, **shared))
        else:
            attn = block.self_attn
            qkv = packed(
                [attn.q_proj, attn.k_proj, attn.v_proj],
                kept(["self_attn." + n for n in ("q_proj", "k_proj", "v_proj")]),
            )
            layers.append(Layer(qkv=qkv, attention_out=linear(attn.out_proj, kept(["self_attn.out_proj"])),
                                q_norm=norm(attn.q_layernorm), k_norm=norm(attn.k_layernorm), **shared))  # fmt: skip
    return Decoder(
        family="lfm2", vocab_size=c.vocab_size, context_length=c.n_positions, n_embd=c.n_embd, n_head=c.n_head,
        n_kv_head=c.n_kv_head, head_dim=c.head_dim, inner_dim=c.n_inner, norm="rms", norm_eps=c.norm_eps,
        activation="silu", gated_mlp=True, embedding=array(model.model.embed_tokens.weight), layers=layers,
        final_norm=norm(model.model.embedding_norm),
        lm_head=None if c.tie_word_embeddings else array(model.lm_head.weight).T,
        rotary=Rotary(array(model.inv_freq)),
        head_nbits=head_blocks(blocks, c.tie_word_embeddings, "model.embed_tokens.weight"),
        embedding_nbits=None if c.tie_word_embeddings else kept_blocks(blocks, ["model.embed_tokens.weight"]),
    )  # fmt: skip


def _kept(blocks: Blocks | None, prefix: str, names: list[str]) -> NBits | None:
    return kept_blocks(blocks, [f"{prefix}{name}.weight" for name in names])


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


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of an LFM2 file. llama.cpp's converter writes head_count_kv per layer, 0 for a convolution
    layer (its layer types), and the MLP width after block_auto_adjust_ff_dim."""
    n_layer = number(meta, "lfm2.block_count")
    kv_heads = meta.get("lfm2.attention.head_count_kv")
    if not isinstance(kv_heads, list) or len(kv_heads) != n_layer:
        raise GGUFError(f"metadata lfm2.attention.head_count_kv must list {n_layer} layers' KV heads")
    attention = sorted({n for n in kv_heads if n})
    if len(attention) != 1:
        raise GGUFError(f"metadata lfm2.attention.head_count_kv {kv_heads!r:.60} names no one KV head count")
    return {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "vocab_size": vocab,
        "hidden_size": number(meta, "lfm2.embedding_length"),
        "intermediate_size": number(meta, "lfm2.feed_forward_length"),
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": n_layer,
        "num_attention_heads": number(meta, "lfm2.attention.head_count"),
        "num_key_value_heads": attention[0],
        "layer_types": [ATTENTION if n else CONV for n in kv_heads],
        "max_position_embeddings": context_length(meta, "lfm2.context_length"),
        "norm_eps": number(meta, "lfm2.attention.layer_norm_rms_epsilon", kind=float, below=MAX_NORM_EPSILON),
        "rope_parameters": {"rope_type": "default", "rope_theta": number(meta, "lfm2.rope.freq_base", kind=float)},
        "conv_L_cache": number(meta, "lfm2.shortconv.l_cache", below=64),
        "tie_word_embeddings": "output.weight" not in stored,
    }


# llama.cpp's name in a block -> HF's (`model.layers.N.` + it)
GGUF_BLOCK = {
    "attn_norm.weight": "operator_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
GGUF_CONV = {"shortconv.conv.weight": "conv.conv.weight", "shortconv.in_proj.weight": "conv.in_proj.weight",
             "shortconv.out_proj.weight": "conv.out_proj.weight"}  # fmt: skip
GGUF_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.out_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight", "attn_k_norm.weight": "self_attn.k_layernorm.weight",
}  # fmt: skip


def gguf_tensors(config: dict) -> dict[str, Entry]:
    """HF name -> where and how it is stored. The converter squeezes the depthwise kernel (C, 1, L) to (C, L)
    (build puts the axis back) and leaves Q and K rows as they are."""
    c = config_from_hf(config)
    hd, kv = c.head_dim, c.n_kv_head * c.head_dim
    shapes = {"ffn_gate": (c.n_inner, c.n_embd), "ffn_up": (c.n_inner, c.n_embd), "ffn_down": (c.n_embd, c.n_inner),
              "shortconv.conv": (c.n_embd, c.conv_kernel), "shortconv.in_proj": (3 * c.n_embd, c.n_embd),
              "shortconv.out_proj": (c.n_embd, c.n_embd), "attn_q": (c.n_embd, c.n_embd), "attn_k": (kv, c.n_embd),
              "attn_v": (kv, c.n_embd), "attn_output": (c.n_embd, c.n_embd), "attn_q_norm": (hd,),
              "attn_k_norm": (hd,)}  # fmt: skip
    entries = {"model.embed_tokens.weight": Entry("token_embd.weight", (c.vocab_size, c.n_embd))}
    entries["model.embedding_norm.weight"] = Entry("token_embd_norm.weight", (c.n_embd,))
    for i, kind in enumerate(c.layer_types):
        names = GGUF_BLOCK | (GGUF_CONV if kind == CONV else GGUF_ATTENTION)
        for gguf_name, hf_name in names.items():
            shape = shapes.get(gguf_name.removesuffix(".weight"), (c.n_embd,))
            entries[f"model.layers.{i}.{hf_name}"] = Entry(f"blk.{i}.{gguf_name}", shape)
    return with_head(entries, config, c.vocab_size, c.n_embd)


def _build_from_gguf(hf: dict, state: dict) -> Lfm2:
    state = {
        name: t.unsqueeze(1) if name.endswith("conv.conv.weight") and t.dim() == 2 else t for name, t in state.items()
    }
    return build(config_from_hf(hf), state)


# LoRA: the attention and convolution layers' own linears (slots only in the layers that hold them), and the MLP
LORA_LINEARS = tuple(
    (f"model.layers.%d.{path}", target)
    for path, target in (
        ("self_attn.q_proj", "qkv"), ("self_attn.k_proj", "qkv"), ("self_attn.v_proj", "qkv"),
        ("self_attn.out_proj", "attention_out"), ("conv.in_proj", "conv.in_proj"), ("conv.out_proj", "conv.out_proj"),
        ("feed_forward.w1", "up"), ("feed_forward.w3", "up"), ("feed_forward.w2", "down"),
    )
)  # fmt: skip

ROWS = (
    Family(
        model_type="lfm2",
        name="lfm2",
        label="LFM2/LFM2.5",
        genai_type="lfm2",
        load=load,
        build=_build_from_gguf,
        decoder=decoder,
        details=details,
        tokens=llama.tokens,
        gguf=GGUFLayout(architecture="lfm2", config=gguf_config, tensors=gguf_tensors),
        lora_linears=LORA_LINEARS,
        lazy_weights=True,
    ),
)
