"""Qwen3.5 text (model_type qwen3_5_text): Gated DeltaNet linear-attention layers beside gated full-attention
layers, its folder read into the reference model (export/models/qwen35.py), and its row.

Like LFM2 (families/lfm2.py) its package's manifest says which layer holds what (architecture.layer_types,
conv_state, recurrent_state) under onnxruntime-genai's names. Both graphs run the recurrence with ONNX Runtime's
com.microsoft GatedDeltaNet: the standard one traced (standard ops besides it), the fused one built from the
Decoder (DeltaNet layers, gated GroupQueryAttention with partial rotary). The multi-token-prediction weights
(mtp.*; a GGUF file's block after the last layer) are left out.

A GGUF file reads as llama.cpp's converter (conversion/qwen.py, Qwen3_5TextModel) writes it: the norms but the
gated one stored as 1 + w, A_log as -exp(A_log), dt_bias as ssm_dt.bias, the depthwise kernel squeezed to (C, L),
and the value heads (v rows of in_proj_qkv and the kernel, in_proj_z, in_proj_a / b, A_log, dt_bias, out_proj's
columns) moved from grouped by key head to tiled (`tiled_heads`). All but out_proj's columns are moved back as
they are read; out_proj's kept blocks cannot be (a block spans neighbouring columns), so the graph gathers its
input into the file's order instead (DeltaNet.out_heads).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
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
from ..decoder import Decoder, Layer, Linear, NBits, Rotary
from ..gguf_blocks import LazyRuns, Runs, by_rows
from ..gguf_metadata import Entry, GGUFError, context_length, number, with_head
from ..lazy_weights import LazyArray, read
from ..limits import MAX_NORM_EPSILON
from ..mechanisms.delta_net import DeltaNet
from ..models.qwen35 import ATTENTION, LINEAR, Qwen35, Qwen35Config, rope_inv_freq
from . import llama
from .family import Blocks, Family, GGUFLayout, array, head_blocks, kept_blocks, linear, norm, packed


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
    return build(config_from_hf(read_config(folder)), read_safetensors_folder(folder, lazy=True))


def _rows_of(part: Runs | LazyRuns, rows: np.ndarray) -> Runs | LazyRuns:
    """Some of a kept weight's output rows, in the order of `rows`."""
    take = lambda a: a[rows]  # noqa: E731
    if isinstance(part, LazyRuns):
        shape = (len(rows), part.shape[1])
        return LazyRuns(part.bits, part.block_size, shape, part.has_offsets, lambda: by_rows(part.load(), take))
    return by_rows(part, take)


def _gated_qkv(attn, blocks: Blocks | None, prefix: str) -> Linear:
    """Q, K, V and the output gate packed as [Q, K, V, gate]: q_proj holds each head's query then its gate."""
    heads, hd = attn.n_head, attn.head_dim
    nbits = kept_blocks(blocks, [f"{prefix}{name}.weight" for name in ("q_proj", "k_proj", "v_proj")])
    if nbits is not None:  # the kept blocks' rows split the same way
        rows = np.arange(2 * heads * hd).reshape(heads, 2, hd)
        q, k, v = nbits.sources
        sources = [_rows_of(q, rows[:, 0].ravel()), k, v, _rows_of(q, rows[:, 1].ravel())]
        nbits = NBits(nbits.bits, nbits.block_size, sources)

    def gated(kind: str) -> torch.Tensor:  # read (export/lazy_weights.py) when the graph writes it
        query, k, v = (read(getattr(getattr(attn, name), kind)) for name in ("q_proj", "k_proj", "v_proj"))
        query = query.view(heads, 2, hd, *query.shape[1:])
        rest = k.shape[1:]
        return torch.cat([query[:, 0].reshape(heads * hd, *rest), k, v, query[:, 1].reshape(heads * hd, *rest)])

    bias = None if attn.q_proj.bias is None else gated("bias").to(torch.float32).numpy()
    if nbits is not None:
        return Linear(None, bias, nbits)
    rows = sum(getattr(attn, name).weight.shape[0] for name in ("q_proj", "k_proj", "v_proj"))
    weight = LazyArray((rows, attn.q_proj.weight.shape[1]), lambda: gated("weight").to(torch.float32).numpy())
    return Linear(weight.T, bias)


def tiled_heads(k_heads: int, v_heads: int) -> np.ndarray:
    """llama.cpp's converter order of the value heads (conversion/qwen.py _LinearAttentionVReorderBase): the file's
    head v * k_heads + g is Hugging Face's head g * r + v (r = v_heads / k_heads value heads share key head g), so
    that ggml shares the key heads by tiling them."""
    return np.arange(v_heads).reshape(k_heads, v_heads // k_heads).T.reshape(-1)


def _delta_net(la, c: Qwen35Config, kept) -> DeltaNet:
    out = kept(["out_proj"])
    tiled = out is not None and c.linear_v_heads != c.linear_k_heads  # the kept blocks' columns are the file's
    return DeltaNet(
        in_proj=linear(la.in_proj_qkv, kept(["in_proj_qkv"])), z=linear(la.in_proj_z, kept(["in_proj_z"])),
        b=linear(la.in_proj_b, kept(["in_proj_b"])), a=linear(la.in_proj_a, kept(["in_proj_a"])),
        conv_weight=array(la.conv1d.weight), a_log=read(la.A_log).to(torch.float32).numpy(),
        dt_bias=array(la.dt_bias), norm=norm(la.norm),
        out_proj=linear(la.out_proj, out), k_heads=c.linear_k_heads, v_heads=c.linear_v_heads, k_dim=c.linear_k_dim,
        v_dim=c.linear_v_dim, out_heads=tiled_heads(c.linear_k_heads, c.linear_v_heads) if tiled else None,
    )  # fmt: skip


def _kept(blocks: Blocks | None, prefix: str, names: list[str]) -> NBits | None:
    return kept_blocks(blocks, [f"{prefix}{name}.weight" for name in names])


def decoder(model: Qwen35, *, blocks: Blocks | None = None) -> Decoder:
    """The fused graph's Decoder: Gated DeltaNet layers (com.microsoft CausalConvWithState and GatedDeltaNet),
    gated attention layers (GroupQueryAttention; the rotary on the first rotary_dim of each head, inside it or,
    where it cannot take that width, before it: export/graph.py). blocks: keep a GGUF file's own quantized blocks
    on the linears."""
    c = model.config
    layers = []
    for i, block in enumerate(model.model.layers):
        mlp = block.mlp
        kept = partial(_kept, blocks, f"model.layers.{i}.")
        shared = dict(attention_norm=norm(block.input_layernorm), mlp_norm=norm(block.post_attention_layernorm),
                      up=packed([mlp.gate_proj, mlp.up_proj], kept(["mlp.gate_proj", "mlp.up_proj"])),
                      down=linear(mlp.down_proj, kept(["mlp.down_proj"])))  # fmt: skip
        if block.kind == LINEAR:
            delta = _delta_net(block.linear_attn, c, partial(_kept, blocks, f"model.layers.{i}.linear_attn."))
            layers.append(Layer(qkv=None, attention_out=None, delta_net=delta, **shared))
        else:
            attn = block.self_attn
            layers.append(Layer(qkv=_gated_qkv(attn, blocks, f"model.layers.{i}.self_attn."),
                                attention_out=linear(attn.o_proj, kept(["self_attn.o_proj"])), q_norm=norm(attn.q_norm),
                                k_norm=norm(attn.k_norm), attention_gate=True, **shared))  # fmt: skip
    return Decoder(
        family="qwen3_5_text", vocab_size=c.vocab_size, context_length=c.n_positions, n_embd=c.n_embd,
        n_head=c.n_head, n_kv_head=c.n_kv_head, head_dim=c.head_dim, inner_dim=c.n_inner, norm="rms",
        norm_eps=c.rms_norm_eps, activation="silu", gated_mlp=True, embedding=array(model.model.embed_tokens.weight),
        layers=layers, final_norm=norm(model.model.norm),
        lm_head=None if c.tie_word_embeddings else array(model.lm_head.weight).T,
        rotary=Rotary(array(model.inv_freq)),
        head_nbits=head_blocks(blocks, c.tie_word_embeddings, "model.embed_tokens.weight"),
        embedding_nbits=None if c.tie_word_embeddings else kept_blocks(blocks, ["model.embed_tokens.weight"]),
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


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a qwen35 file. block_count counts the multi-token-prediction block(s) after the layers
    (nextn_predict_layers); attention.recurrent_layers marks the Gated DeltaNet layers (older files: every
    full_attention_interval-th layer is attention); the value heads' width is ssm.inner_size over their count.
    The rotary's dimension_sections (interleaved M-RoPE) give text, whose three positions are equal, the plain
    rotary."""
    if meta.get("qwen35.rope.scaling.type", "none") != "none":
        raise GGUFError(f"Qwen3.5 with rope scaling {meta['qwen35.rope.scaling.type']!r:.40} is not implemented")
    mtp = number(meta, "qwen35.nextn_predict_layers", 0, positive=False)
    n_layer = number(meta, "qwen35.block_count") - mtp
    for i in range(max(n_layer, 0), n_layer + mtp):  # else a layer would be left out as one
        if f"blk.{i}.nextn.eh_proj.weight" not in stored:
            raise GGUFError(f"metadata qwen35.nextn_predict_layers = {mtp} but block {i} has no nextn.eh_proj.weight")
    recurrent = meta.get("qwen35.attention.recurrent_layers")
    if recurrent is None:
        interval = number(meta, "qwen35.full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer + mtp)]
    if not isinstance(recurrent, list) or len(recurrent) != n_layer + mtp:
        raise GGUFError(f"metadata qwen35.attention.recurrent_layers must list {n_layer + mtp} layers")
    heads, head_dim = number(meta, "qwen35.attention.head_count"), number(meta, "qwen35.attention.key_length")
    if number(meta, "qwen35.attention.value_length", head_dim) != head_dim:
        raise GGUFError("metadata qwen35.attention.value_length differs from key_length, which Qwen3.5 does not do")
    v_heads = number(meta, "qwen35.ssm.time_step_rank")
    inner = number(meta, "qwen35.ssm.inner_size")
    if inner % v_heads:
        raise GGUFError(f"metadata qwen35.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {v_heads}")
    rotary = number(meta, "qwen35.rope.dimension_count", head_dim)
    if int(head_dim * (rotary / head_dim)) != rotary:  # config_from_hf's int(head_dim * partial_rotary_factor)
        raise GGUFError(f"metadata qwen35.rope.dimension_count {rotary} of heads of {head_dim} is not implemented")
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": number(meta, "qwen35.embedding_length"),
        "intermediate_size": number(meta, "qwen35.feed_forward_length"),
        "num_hidden_layers": n_layer,
        "num_attention_heads": heads,
        "num_key_value_heads": number(meta, "qwen35.attention.head_count_kv"),
        "head_dim": head_dim,
        "layer_types": [LINEAR if flag else ATTENTION for flag in recurrent[:n_layer]],
        "linear_num_key_heads": number(meta, "qwen35.ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": number(meta, "qwen35.ssm.state_size"),
        "linear_value_head_dim": inner // v_heads,
        "linear_conv_kernel_dim": number(meta, "qwen35.ssm.conv_kernel", below=64),
        "max_position_embeddings": context_length(meta, "qwen35.context_length"),
        "rms_norm_eps": number(meta, "qwen35.attention.layer_norm_rms_epsilon", kind=float, below=MAX_NORM_EPSILON),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": number(meta, "qwen35.rope.freq_base", kind=float),
            "partial_rotary_factor": rotary / head_dim,
        },
        "mtp_num_hidden_layers": mtp,
        "tie_word_embeddings": "output.weight" not in stored,
    }


# llama.cpp's name in a block -> HF's (`model.layers.N.` + it); the norms but ssm_norm are stored as 1 + w
GGUF_BLOCK = {"attn_norm.weight": "input_layernorm.weight",
              "post_attention_norm.weight": "post_attention_layernorm.weight",
              "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
              "ffn_down.weight": "mlp.down_proj.weight"}  # fmt: skip
GGUF_LINEAR = {"attn_qkv.weight": "in_proj_qkv.weight", "attn_gate.weight": "in_proj_z.weight",
               "ssm_beta.weight": "in_proj_b.weight", "ssm_alpha.weight": "in_proj_a.weight", "ssm_a": "A_log",
               "ssm_dt.bias": "dt_bias", "ssm_conv1d.weight": "conv1d.weight", "ssm_norm.weight": "norm.weight",
               "ssm_out.weight": "out_proj.weight"}  # fmt: skip
GGUF_ATTENTION = {"attn_q.weight": "q_proj.weight", "attn_k.weight": "k_proj.weight", "attn_v.weight": "v_proj.weight",
                  "attn_output.weight": "o_proj.weight", "attn_q_norm.weight": "q_norm.weight",
                  "attn_k_norm.weight": "k_norm.weight"}  # fmt: skip


def _linear_entries(c: Qwen35Config, i: int) -> dict[str, Entry]:
    """A Gated DeltaNet layer's tensors, their value heads moved back from llama.cpp's tiled order."""
    file_head = np.argsort(tiled_heads(c.linear_k_heads, c.linear_v_heads))  # HF head h is the file's file_head[h]

    def heads(width: int, before: int = 0) -> tuple[int, ...] | None:
        """The file's rows (or columns) of HF's: `before` rows as they are, then heads of `width`."""
        rows = (file_head[:, None] * width + np.arange(width)).ravel() + before
        return None if c.linear_k_heads == c.linear_v_heads else tuple(range(before)) + tuple(rows.tolist())

    key, value, hidden = c.linear_k_heads * c.linear_k_dim, c.linear_v_heads * c.linear_v_dim, c.n_embd
    v_rows, one = heads(c.linear_v_dim), heads(1)
    layout = {
        "attn_qkv.weight": dict(shape=(c.conv_dim, hidden), rows=heads(c.linear_v_dim, 2 * key)),
        "attn_gate.weight": dict(shape=(value, hidden), rows=v_rows),
        "ssm_beta.weight": dict(shape=(c.linear_v_heads, hidden), rows=one),
        "ssm_alpha.weight": dict(shape=(c.linear_v_heads, hidden), rows=one),
        "ssm_a": dict(shape=(c.linear_v_heads,), rows=one, inverse=_a_log),
        "ssm_dt.bias": dict(shape=(c.linear_v_heads,), rows=one),
        "ssm_conv1d.weight": dict(shape=(c.conv_dim, c.conv_kernel), rows=heads(c.linear_v_dim, 2 * key)),
        "ssm_norm.weight": dict(shape=(c.linear_v_dim,)),
        "ssm_out.weight": dict(shape=(hidden, value), columns=v_rows),
    }
    prefix = f"model.layers.{i}.linear_attn."
    return {prefix + GGUF_LINEAR[name]: Entry(f"blk.{i}.{name}", **fields) for name, fields in layout.items()}


def _a_log(a: np.ndarray) -> np.ndarray:
    """A_log from the file's A = -exp(A_log)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(-a)


def gguf_tensors(config: dict) -> dict[str, Entry]:
    """HF name -> where and how it is stored (see the module's docstring for what the converter changes)."""
    c = config_from_hf(config)
    q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    shapes = {"ffn_gate": (c.n_inner, c.n_embd), "ffn_up": (c.n_inner, c.n_embd), "ffn_down": (c.n_embd, c.n_inner),
              "attn_q": (2 * q, c.n_embd), "attn_k": (kv, c.n_embd), "attn_v": (kv, c.n_embd),
              "attn_output": (c.n_embd, q), "attn_q_norm": (c.head_dim,), "attn_k_norm": (c.head_dim,)}  # fmt: skip
    one_plus = lambda name, shape: Entry(name, shape, shift=-1.0)  # noqa: E731
    entries = {"model.embed_tokens.weight": Entry("token_embd.weight", (c.vocab_size, c.n_embd)),
               "model.norm.weight": one_plus("output_norm.weight", (c.n_embd,))}  # fmt: skip
    for i, kind in enumerate(c.layer_types):
        names = GGUF_BLOCK | (GGUF_ATTENTION if kind == ATTENTION else {})
        for gguf_name, hf_name in names.items():
            stem = gguf_name.removesuffix(".weight")
            shape = shapes.get(stem, (c.n_embd,))
            where = f"blk.{i}.{gguf_name}"
            hf = f"model.layers.{i}.{'self_attn.' if gguf_name in GGUF_ATTENTION else ''}{hf_name}"
            entries[hf] = one_plus(where, shape) if stem.endswith("norm") else Entry(where, shape)
        if kind == LINEAR:
            entries |= _linear_entries(c, i)
    return with_head(entries, config, c.vocab_size, c.n_embd)


def gguf_left_out(config: dict) -> tuple[str, ...]:
    """The multi-token-prediction block(s) after the last layer."""
    first = config["num_hidden_layers"]
    return tuple(f"blk.{i}." for i in range(first, first + config.get("mtp_num_hidden_layers", 0)))


def _build_from_gguf(hf: dict, state: dict) -> Qwen35:
    state = {
        name: t.unsqueeze(1) if name.endswith("conv1d.weight") and t.dim() == 2 else t for name, t in state.items()
    }
    return build(config_from_hf(hf), state)


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
        build=_build_from_gguf,
        decoder=decoder,
        details=details,
        tokens=llama.tokens,
        gguf=GGUFLayout(architecture="qwen35", config=gguf_config, tensors=gguf_tensors, left_out=gguf_left_out),
        lora_linears=LORA_LINEARS,
        lora_columns=lora_columns,
        lazy_weights=True,
    ),
)
