"""Qwen3.5 text (model_type qwen3_5_text): Gated DeltaNet linear-attention layers beside gated full-attention
layers, its folder read into the reference model (export/qwen35.py), and its row.

Like LFM2 (families/lfm2.py) its package's manifest says which layer holds what (architecture.layer_types,
conv_state, recurrent_state) under onnxruntime-genai's names. Both graphs run the recurrence with ONNX Runtime's
com.microsoft GatedDeltaNet: the standard one traced (standard ops besides it), the fused one built from the
Decoder (DeltaNet layers, gated GroupQueryAttention with partial rotary). GGUF files of it are not read yet, and
the multi-token-prediction weights (mtp.*) some checkpoints carry are left out.
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
from ..decoder import Decoder, DeltaNet, Layer, Linear
from ..limits import MAX_NORM_EPSILON
from ..qwen35 import ATTENTION, LINEAR, Qwen35, Qwen35Config, rope_inv_freq
from .family import Blocks, Family, array, checked_tokens, linear, norm, packed


def config_from_hf(hf: dict) -> Qwen35Config:
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"Qwen3.5 with rope scaling {rope!r:.80} is not implemented")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"Qwen3.5 with hidden_act {hf.get('hidden_act')!r:.40} is not implemented")
    with config_errors():
        n_layer = config_number(hf, "num_hidden_layers")
        kinds = hf.get("layer_types")
        if not isinstance(kinds, list) or len(kinds) != n_layer or not set(kinds) <= {ATTENTION, LINEAR}:
            raise CheckpointError(f"config.json's layer_types must list {n_layer} of {ATTENTION!r} and {LINEAR!r}")
        if ATTENTION not in kinds:
            raise CheckpointError("config.json's layer_types has no full_attention layer, which edgelm's Qwen3.5 needs")
        heads = config_number(hf, "num_attention_heads")
        kv_heads = config_number(hf, "num_key_value_heads", heads)
        head_dim = config_number(hf, "head_dim", config_number(hf, "hidden_size") // heads)
        partial = config_number(rope, "partial_rotary_factor", 1.0, kind=float, positive=True)
        rotary_dim = int(head_dim * partial)
        k_heads, v_heads = config_number(hf, "linear_num_key_heads"), config_number(hf, "linear_num_value_heads")
        if heads % kv_heads or v_heads % k_heads or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise CheckpointError(
                f"Qwen3.5 heads do not group: {heads} query over {kv_heads} KV heads, {v_heads} value over {k_heads} "
                f"key heads, rotary dimension {rotary_dim} of {head_dim}"
            )
        return Qwen35Config(
            vocab_size=config_number(hf, "vocab_size"),
            n_embd=config_number(hf, "hidden_size"),
            n_layer=n_layer,
            n_head=heads,
            n_kv_head=kv_heads,
            head_dim=head_dim,
            n_inner=config_number(hf, "intermediate_size"),
            layer_types=kinds,
            rotary_dim=rotary_dim,
            linear_k_heads=k_heads,
            linear_v_heads=v_heads,
            linear_k_dim=config_number(hf, "linear_key_head_dim"),
            linear_v_dim=config_number(hf, "linear_value_head_dim"),
            conv_kernel=config_number(hf, "linear_conv_kernel_dim", 4, below=64),
            n_positions=config_context_length(
                config_number(hf, "max_position_embeddings", 32768), "max_position_embeddings"
            ),
            rms_norm_eps=config_number(hf, "rms_norm_eps", 1e-6, kind=float, below=MAX_NORM_EPSILON),
            rope_theta=config_number(rope, "rope_theta", 1e7, kind=float, positive=True),
            attention_bias=bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


def build(config: Qwen35Config, state: dict[str, torch.Tensor]) -> Qwen35:
    state = {name: tensor for name, tensor in state.items() if not name.startswith("mtp.")}  # the MTP head
    model = load_weights(
        lambda: Qwen35(config), state, prefix="model.", embedding="model.embed_tokens.weight",
        tied=config.tie_word_embeddings, what="Qwen3.5",
    )  # fmt: skip
    model.inv_freq = rope_inv_freq(config)  # a buffer: built on meta, not in the state dict
    return model.eval()


def load(folder: str | Path) -> Qwen35:
    folder = Path(folder)
    return build(config_from_hf(read_config(folder)), read_safetensors_folder(folder))


def _gated_qkv(attn) -> Linear:
    """Q, K, V and the output gate packed as [Q, K, V, gate]: q_proj holds each head's query then its gate."""
    heads, hd = attn.n_head, attn.head_dim
    q_rows = attn.q_proj.weight.detach().view(heads, 2, hd, -1)
    weight = torch.cat([q_rows[:, 0].reshape(heads * hd, -1), attn.k_proj.weight, attn.v_proj.weight,
                        q_rows[:, 1].reshape(heads * hd, -1)])  # fmt: skip
    bias = None
    if attn.q_proj.bias is not None:
        q_bias = attn.q_proj.bias.detach().view(heads, 2, hd)
        bias = array(torch.cat([q_bias[:, 0].flatten(), attn.k_proj.bias, attn.v_proj.bias, q_bias[:, 1].flatten()]))
    return Linear(array(weight).T, bias)


def _delta_net(la, c: Qwen35Config) -> DeltaNet:
    return DeltaNet(
        in_proj=linear(la.in_proj_qkv), z=linear(la.in_proj_z), b=linear(la.in_proj_b), a=linear(la.in_proj_a),
        conv_weight=array(la.conv1d.weight), a_log=array(la.A_log), dt_bias=array(la.dt_bias), norm=norm(la.norm),
        out_proj=linear(la.out_proj), k_heads=c.linear_k_heads, v_heads=c.linear_v_heads, k_dim=c.linear_k_dim,
        v_dim=c.linear_v_dim,
    )  # fmt: skip


def decoder(model: Qwen35, *, blocks: Blocks | None = None) -> Decoder:
    """The fused graph's Decoder: Gated DeltaNet layers (com.microsoft CausalConvWithState and GatedDeltaNet),
    gated attention layers (GroupQueryAttention; the rotary on the first rotary_dim of each head, inside it or,
    where it cannot take that width, before it: export/graph.py). blocks: unused
    (no GGUF files of Qwen3.5 are read yet)."""
    c = model.config
    layers = []
    for block in model.model.layers:
        mlp = block.mlp
        shared = dict(attention_norm=norm(block.input_layernorm), mlp_norm=norm(block.post_attention_layernorm),
                      up=packed([mlp.gate_proj, mlp.up_proj], None), down=linear(mlp.down_proj))  # fmt: skip
        if block.kind == LINEAR:
            layers.append(Layer(qkv=None, attention_out=None, delta_net=_delta_net(block.linear_attn, c), **shared))
        else:
            attn = block.self_attn
            layers.append(Layer(qkv=_gated_qkv(attn), attention_out=linear(attn.o_proj), q_norm=norm(attn.q_norm),
                                k_norm=norm(attn.k_norm), attention_gate=True, **shared))  # fmt: skip
    angles = torch.arange(c.n_positions, dtype=torch.float32).unsqueeze(1) * rope_inv_freq(c)  # (P, rotary / 2)
    return Decoder(
        family="qwen3_5_text", vocab_size=c.vocab_size, context_length=c.n_positions, n_embd=c.n_embd,
        n_head=c.n_head, n_kv_head=c.n_kv_head, head_dim=c.head_dim, inner_dim=c.n_inner, norm="rms",
        norm_eps=c.rms_norm_eps, activation="silu", gated_mlp=True, embedding=array(model.model.embed_tokens.weight),
        layers=layers, final_norm=norm(model.model.norm),
        lm_head=None if c.tie_word_embeddings else array(model.lm_head.weight).T,
        rotary_cos=array(angles.cos()), rotary_sin=array(angles.sin()),
    )  # fmt: skip


def details(model: Qwen35) -> dict:
    c = model.config
    return {
        "n_embd": c.n_embd,
        "n_inner": c.n_inner,
        "rope_theta": c.rope_theta,
        "rotary_dim": c.rotary_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "linear_heads": {"key": c.linear_k_heads, "value": c.linear_v_heads},
        "linear_head_dim": {"key": c.linear_k_dim, "value": c.linear_v_dim},
        "conv_kernel": c.conv_kernel,
        "tie_word_embeddings": c.tie_word_embeddings,
        "parameters": model.num_parameters(),
    }


def tokens(folder: Path, model: Qwen35) -> dict:
    extras = read_extras(folder)
    return checked_tokens(
        model.config.vocab_size, extras["bos_token_id"], extras["eos_token_ids"], extras["pad_token_id"]
    )


# LoRA: the gated attention's, the Gated DeltaNet's and the MLP's linears (slots only in the layers that hold them)
LORA_LINEARS = tuple(
    (f"model.layers.%d.{path}", target)
    for path, target in (
        ("self_attn.q_proj", "qkv"), ("self_attn.k_proj", "qkv"), ("self_attn.v_proj", "qkv"),
        ("self_attn.o_proj", "attention_out"), ("linear_attn.in_proj_qkv", "delta_net.in_proj"),
        ("linear_attn.in_proj_z", "delta_net.z"), ("linear_attn.in_proj_b", "delta_net.b"),
        ("linear_attn.in_proj_a", "delta_net.a"), ("linear_attn.out_proj", "delta_net.out_proj"),
        ("mlp.gate_proj", "up"), ("mlp.up_proj", "up"), ("mlp.down_proj", "down"),
    )
)  # fmt: skip


def lora_columns(model: Qwen35) -> dict[str, list[tuple[int, int]]]:
    """Where q_proj, k_proj and v_proj's outputs sit in the packed [Q, K, V, gate] linear (_gated_qkv): q_proj's
    rows are each head's query then its gate."""
    c = model.config
    q, kv, hd = c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.head_dim
    gate = q + 2 * kv
    heads = [run for h in range(c.n_head) for run in ((h * hd, hd), (gate + h * hd, hd))]
    attn = "model.layers.%d.self_attn."
    return {f"{attn}q_proj": heads, f"{attn}k_proj": [(q, kv)], f"{attn}v_proj": [(q + kv, kv)]}


ROWS = (
    Family(
        model_type="qwen3_5_text",
        name="qwen3_5_text",
        label="Qwen3.5",
        genai_type="qwen3_5_text",
        load=load,
        build=lambda hf, state: build(config_from_hf(hf), state),
        decoder=decoder,
        details=details,
        tokens=tokens,
        lora_linears=LORA_LINEARS,
        lora_columns=lora_columns,
    ),
)
