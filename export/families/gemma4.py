"""Gemma 4 (model_type gemma4_text, and the text model inside gemma4's image-audio-and-text checkpoints): how its
folders load into the reference model (export/models/gemma4.py), the Decoder it makes, and its rows.

config.json names a full layer's head size either as `global_head_dim` (and `num_global_key_value_heads`, which
transformers applies only with attention_k_eq_v) or, as transformers 5 saves it, as `per_layer_config` entries
for the full layers; both read the same. The vision and audio towers of a gemma4 checkpoint are left out: the
package is its text model. Mixture-of-experts layers (enable_moe_block) and bidirectional attention are refused
in one line. onnxruntime-genai 0.18's Gemma 4 builder has neither per-layer embeddings nor KV sharing, so no
genai_config.json is written for these packages.

llama.cpp's converter (conversion/gemma.py Gemma4Model) writes the layer pattern, both head sizes, the KV heads and
MLP widths per layer where they differ, the window, the number of shared layers and the per-layer input width as
metadata, its norms as they are (no 1 + w), and the full layers' proportional rotary as rope_freqs.weight: 1 for a
rotated pair, 1e30 (no rotation) for the rest. It writes no key for attention_k_eq_v: a full layer without
attn_v.weight says it. gguf_config reads all of that back into config.json's keys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from ..checkpoint import (
    CheckpointError,
    config_context_length,
    config_errors,
    config_number,
    first_id,
    load_weights,
    read_config,
    read_extras,
    read_safetensors_folder,
    renamed,
    token_ids,
)
from ..decoder import Decoder, Layer, Rotary
from ..gguf_metadata import Entry, GGUFError, context_length, number, with_head
from ..limits import MAX_NORM_EPSILON
from ..mechanisms.per_layer_input import PerLayerInput
from ..models.gemma4 import LAYER_TYPES, Gemma4, Gemma4Config, rope_inv_freq
from . import gemma3, llama
from .family import Blocks, Family, GGUFLayout, array, head_blocks, kept_blocks, linear, norm, packed

FULL_EVERY = 6  # without layer_types, every 6th layer is full (and the last always is: transformers' rule)

DEFAULTS = {  # transformers' Gemma4TextConfig defaults: a gemma4 config's text_config may leave them out
    "vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 512,
    "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 0,
    "global_head_dim": 512,
}  # fmt: skip
ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}

# gemma4's image-audio-and-text checkpoints: the text model is model.language_model.*; the rest is dropped
RENAMES = (("model.language_model.", "model."), ("model.", None))
# a KV-shared layer has no keys, values or their norms; checkpoints that still hold them have them ignored
SHARED_UNUSED = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.")


def _text_config(hf: dict) -> dict:
    """The text model's config: gemma4's text_config, or gemma4_text's own; transformers' defaults filled in;
    what the reference model does not implement refused."""
    if hf.get("model_type") == "gemma4":
        if not isinstance(hf.get("text_config"), dict):
            raise CheckpointError("config.json of model_type 'gemma4' has no text_config")
        tie = hf.get("tie_word_embeddings", True)
        hf = {"tie_word_embeddings": tie, **hf["text_config"], "model_type": "gemma4_text"}
    hf = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in DEFAULTS}}
    for key in ("enable_moe_block", "use_bidirectional_attention", "attention_bias"):
        if hf.get(key):
            raise CheckpointError(
                f"config.json sets {key}={hf[key]!r:.60}, which edgelm does not implement for Gemma 4"
            )
    if hf["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"unsupported hidden_activation {hf['hidden_activation']!r:.60} for Gemma 4")
    return hf


def layer_types(hf: dict, n_layer: int) -> list[str]:
    """config.json's layer_types, else every FULL_EVERY-th layer full; the last layer full either way (transformers
    forces it)."""
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % FULL_EVERY else "full_attention" for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer or not set(types) <= set(LAYER_TYPES):
        raise CheckpointError(f"config.json's layer_types should be {n_layer} of {', '.join(LAYER_TYPES)}")
    return [*types[:-1], "full_attention"]


def _full_layer_shape(hf: dict, types: list[str]) -> tuple[int, int | None]:
    """(a full layer's head size, its KV heads or None for num_key_value_heads): from per_layer_config where the
    config has it (one shape for every full layer, nothing else overridden), else global_head_dim and, with
    attention_k_eq_v, num_global_key_value_heads."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        heads = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
        return config_number(hf, "global_head_dim"), None if heads is None else config_number(
            hf, "num_global_key_value_heads"
        )
    if not isinstance(overrides, dict):
        raise CheckpointError("config.json's per_layer_config must be an object of layer -> overrides")
    shapes = set()
    for key, entry in overrides.items():
        if not str(key).isdigit() or int(key) >= len(types) or not isinstance(entry, dict):
            raise CheckpointError(f"config.json's per_layer_config has an entry {key!r:.40} that is not a layer's")
        if types[int(key)] != "full_attention" or set(entry) - {"head_dim", "num_key_value_heads"}:
            raise CheckpointError(
                f"config.json's per_layer_config overrides layer {key} beyond a full layer's head_dim and "
                "num_key_value_heads, which edgelm does not implement"
            )
        shapes.add((entry.get("head_dim", hf["head_dim"]), entry.get("num_key_value_heads")))
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    if len(shapes) > 1 or (shapes and sorted(int(k) for k in overrides) != full):
        raise CheckpointError("config.json's per_layer_config gives full layers different shapes")
    head_dim, heads = shapes.pop() if shapes else (hf["head_dim"], None)
    return config_number({"head_dim": head_dim}, "head_dim"), None if heads is None else config_number(
        {"num_key_value_heads": heads}, "num_key_value_heads"
    )


def _rope(hf: dict) -> dict:
    """Gemma4Config's rotary fields from rope_parameters (per layer type): proportional or default rotary on the
    full layers, default on the sliding ones."""
    params = hf.get("rope_parameters") or ROPE_DEFAULTS
    if not isinstance(params, dict) or not all(isinstance(params.get(k, {}), dict) for k in LAYER_TYPES):
        raise CheckpointError("config.json's rope_parameters must hold a full_attention and a sliding_attention object")
    full = params.get("full_attention") or ROPE_DEFAULTS["full_attention"]
    local = params.get("sliding_attention") or ROPE_DEFAULTS["sliding_attention"]
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise CheckpointError(f"full-layer rope_type {full.get('rope_type')!r:.60} is not supported for Gemma 4")
    if local.get("rope_type", "default") != "default":
        raise CheckpointError(f"sliding-layer rope_type {local.get('rope_type')!r:.60} is not supported for Gemma 4")
    proportional = full.get("rope_type") == "proportional"
    return {
        "rope_theta": config_number(full, "rope_theta", kind=float, what="rope_parameters.full_attention.rope_theta"),
        "partial_rotary_factor": config_number(full, "partial_rotary_factor", 1.0, kind=float) if proportional else 1.0,
        "rope_factor": config_number(full, "factor", 1.0, kind=float, positive=True) if proportional else 1.0,
        "rope_local_theta": config_number(
            local, "rope_theta", kind=float, what="rope_parameters.sliding_attention.rope_theta"
        ),
    }


def config_from_hf(hf: dict) -> Gemma4Config:
    """Map a Gemma 4 config.json (gemma4_text, or gemma4's text_config) onto Gemma4Config."""
    hf = _text_config(hf)
    with config_errors():
        n_layer = config_number(hf, "num_hidden_layers")
        types = layer_types(hf, n_layer)
        global_head_dim, global_kv_head = _full_layer_shape(hf, types)
        per_layer_dim = config_number(hf, "hidden_size_per_layer_input", 0, positive=False)
        return Gemma4Config(
            vocab_size=config_number(hf, "vocab_size"),
            n_positions=config_context_length(config_number(hf, "max_position_embeddings"), "max_position_embeddings"),
            n_embd=config_number(hf, "hidden_size"),
            n_layer=n_layer,
            n_head=config_number(hf, "num_attention_heads"),
            n_kv_head=config_number(hf, "num_key_value_heads"),
            head_dim=config_number(hf, "head_dim"),
            global_head_dim=global_head_dim,
            global_kv_head=global_kv_head,
            n_inner=config_number(hf, "intermediate_size"),
            double_wide_mlp=bool(hf.get("use_double_wide_mlp")),
            rms_norm_eps=config_number(hf, "rms_norm_eps", kind=float, below=MAX_NORM_EPSILON),
            layer_types=types,
            sliding_window=config_number(hf, "sliding_window"),
            attention_k_eq_v=bool(hf.get("attention_k_eq_v")),
            num_kv_shared_layers=config_number(hf, "num_kv_shared_layers", 0, positive=False),
            per_layer_dim=per_layer_dim,
            per_layer_vocab=config_number(hf, "vocab_size_per_layer_input") if per_layer_dim else 0,
            final_logit_softcapping=None
            if hf.get("final_logit_softcapping") is None
            else config_number(hf, "final_logit_softcapping", kind=float, positive=True),
            tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            bos_token_id=first_id(hf.get("bos_token_id"), "bos_token_id"),
            eos_token_ids=token_ids(hf.get("eos_token_id"), "eos_token_id"),
            **_rope(hf),
        )


def build(config: Gemma4Config, state: dict) -> Gemma4:
    """A Gemma4 holding `state` (transformers' names), every shape checked; a KV-shared layer's unused key and
    value tensors, where a checkpoint holds them, are left out as transformers leaves them."""
    shared = [f"model.layers.{i}.{name}" for i, s in enumerate(config.kv_source) if s != i for name in SHARED_UNUSED]
    state = {k: v for k, v in state.items() if not k.startswith(tuple(shared))}
    model = load_weights(
        lambda: Gemma4(config), state, prefix="model.", embedding="model.embed_tokens.weight",
        tied=config.tie_word_embeddings, what=config.model_type,
    )  # fmt: skip
    model.inv_freq = rope_inv_freq(config, full=True)  # buffers: built on meta, not in the state dict
    model.inv_freq_local = rope_inv_freq(config, full=False)
    if not (torch.isfinite(model.inv_freq).all() and torch.isfinite(model.inv_freq_local).all()):
        raise CheckpointError("rotary frequencies are not finite (rope_parameters' rope_theta)")
    return model.eval()


def load(folder: str | Path, *, renames: tuple = ()) -> Gemma4:
    """A Hugging Face gemma4_text folder (renames: gemma4's, its text model taken) as the reference model."""
    folder = Path(folder)
    config = config_from_hf(read_config(folder))
    extras = read_extras(folder)
    config = dataclasses.replace(config, bos_token_id=extras["bos_token_id"], eos_token_ids=extras["eos_token_ids"])
    return build(config, renamed(read_safetensors_folder(folder, lazy=True), renames))


def _build_from_config(hf: dict, state: dict) -> Gemma4:
    return build(config_from_hf(hf), state)


def _layer(block: torch.nn.Module, c: Gemma4Config, i: int, blocks: Blocks | None) -> Layer:
    a, mlp = block.self_attn, block.mlp

    def kept(*names: str):
        return kept_blocks(blocks, [f"model.layers.{i}.{name}.weight" for name in names])

    if a.shared:  # Q alone; keys and values are kv_source's
        qkv = linear(a.q_proj, kept("self_attn.q_proj"))
    else:
        parts = ["q_proj", "k_proj"] + ([] if a.k_eq_v else ["v_proj"])
        qkv = packed([getattr(a, p) for p in parts], kept(*(f"self_attn.{p}" for p in parts)))
    per_layer = None
    if c.per_layer_dim:
        per_layer = PerLayerInput(
            gate=linear(block.per_layer_input_gate, kept("per_layer_input_gate")),
            projection=linear(block.per_layer_projection, kept("per_layer_projection")),
            norm=norm(block.post_per_layer_input_norm),
        )
    scalar = float(array(block.layer_scalar)[0])
    return Layer(
        attention_norm=norm(block.input_layernorm),
        qkv=qkv,
        attention_out=linear(a.o_proj, kept("self_attn.o_proj")),
        mlp_norm=norm(block.pre_feedforward_layernorm),
        up=packed([mlp.gate_proj, mlp.up_proj], kept("mlp.gate_proj", "mlp.up_proj")),
        down=linear(mlp.down_proj, kept("mlp.down_proj")),
        q_norm=norm(a.q_norm),
        k_norm=None if a.shared else norm(a.k_norm),
        attention_post_norm=norm(block.post_attention_layernorm),
        mlp_post_norm=norm(block.post_feedforward_layernorm),
        sliding_window=c.sliding_window if block.sliding else None,
        head_dim=c.head_size(i),
        n_kv_head=c.kv_heads(i),
        inner_dim=c.inner(i),
        kv_source=c.kv_source[i] if a.shared else None,
        value_is_key=a.k_eq_v,
        v_norm=True,
        per_layer=per_layer,
        output_scale=None if scalar == 1.0 else scalar,  # times 1 is exact: no node
    )


def decoder(model: Gemma4, *, blocks: Blocks | None = None) -> Decoder:
    """The fused graph's Decoder. GroupQueryAttention rotates by tables whose width is a multiple of 8 (ONNX Runtime
    1.32's rule), so both head sizes must be multiples of 16."""
    c, m = model.config, model.model
    for name, size in (("head_dim", c.head_dim), ("global_head_dim", c.global_head_dim)):
        if size % 16:
            raise CheckpointError(f"{name} {size} is not a multiple of 16, which the fused graph's rotary needs")
    tied = c.tie_word_embeddings
    # the per-layer table (n_layer * D values a token: the largest tensor of E2B) gathered from the file's blocks
    per_layer_nbits = kept_blocks(blocks, ["model.embed_tokens_per_layer.weight"]) if c.per_layer_dim else None
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
        activation="gelu_new",
        gated_mlp=True,
        embedding=array(m.embed_tokens.weight),
        layers=[_layer(block, c, i, blocks) for i, block in enumerate(m.layers)],
        final_norm=norm(m.norm),
        lm_head=None if tied else array(model.lm_head.weight).T,
        head_nbits=head_blocks(blocks, tied, "model.embed_tokens.weight"),
        embedding_nbits=None if tied else kept_blocks(blocks, ["model.embed_tokens.weight"]),
        rotary=Rotary(array(model.inv_freq)),  # (global_head_dim / 2,), proportional: 0 past the rotated pairs
        rotary_local=Rotary(array(model.inv_freq_local)),  # (head_dim / 2,)
        embedding_scale=float(np.float32(c.n_embd**0.5)),
        attention_scale=1.0,  # the Q and K norms set the scores' size
        per_layer_embedding=None
        if per_layer_nbits is not None or not c.per_layer_dim
        else array(m.embed_tokens_per_layer.weight),
        per_layer_embedding_nbits=per_layer_nbits,
        per_layer_projection=linear(
            m.per_layer_model_projection, kept_blocks(blocks, ["model.per_layer_model_projection.weight"])
        )
        if c.per_layer_dim
        else None,
        per_layer_norm=norm(m.per_layer_projection_norm) if c.per_layer_dim else None,
        logits_softcap=c.final_logit_softcapping,
    )


def details(model: Gemma4) -> dict:
    c = model.config
    return {
        "n_embd": c.n_embd,
        "n_inner": c.n_inner,
        "layer_types": c.layer_types,
        "sliding_window": c.sliding_window,
        "global_head_dim": c.global_head_dim,
        "rope_theta": c.rope_theta,
        "partial_rotary_factor": c.partial_rotary_factor,
        "rope_local_theta": c.rope_local_theta,
        "num_kv_shared_layers": c.num_kv_shared_layers,
        "hidden_size_per_layer_input": c.per_layer_dim,
        "attention_k_eq_v": c.attention_k_eq_v,
        "use_double_wide_mlp": c.double_wide_mlp,
        "final_logit_softcapping": c.final_logit_softcapping,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "parameters": model.num_parameters(),
    }


ROPE_FREQS = "rope_freqs.weight"  # the full layers' rotated pairs (1) and unrotated ones (1e30)


def _per_layer(meta: dict, key: str, n_layer: int) -> list[int]:
    """A metadata number llama.cpp writes once, or once per layer where layers differ."""
    value = meta.get(key)
    if isinstance(value, list):
        if len(value) != n_layer:
            raise GGUFError(f"metadata {key} should be one number or {n_layer}")
        return [number({key: v}, key) for v in value]
    return [number(meta, key)] * n_layer


def _of_kind(values: list[int], types: list[str], kind: str, key: str) -> int | None:
    """The one value of `kind`'s layers; None when no layer is of that kind (a pattern all full or all sliding)."""
    found = {v for v, t in zip(values, types, strict=True) if t == kind}
    if len(found) > 1:
        raise GGUFError(f"metadata {key} differs between {kind} layers, which Gemma 4's config cannot say")
    return found.pop() if found else None


def _rotated_share(stored: dict, head_dim: int) -> float:
    """partial_rotary_factor from rope_freqs.weight: its head_dim / 2 factors, 1 for each rotated pair first."""
    tensor = stored.get(ROPE_FREQS)
    if tensor is None:
        return 1.0
    factors = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)
    rotated = int((factors == 1.0).sum())
    if (
        factors.shape != (head_dim // 2,)
        or not (factors[:rotated] == 1.0).all()
        or not (factors[rotated:] >= 1e29).all()
    ):
        raise GGUFError(f"tensor {ROPE_FREQS} is not proportional rotary's factors (1s then 1e30s, {head_dim // 2})")
    return 2 * rotated / head_dim


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a Gemma 4 file (llama.cpp's keys, read back as its converter wrote them)."""
    arch = "gemma4"
    n_layer = number(meta, f"{arch}.block_count")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_layer or not all(isinstance(p, bool) for p in pattern):
        raise GGUFError(f"metadata {arch}.attention.sliding_window_pattern should be {n_layer} booleans")
    types = ["sliding_attention" if p else "full_attention" for p in pattern]
    shared = number(meta, f"{arch}.attention.shared_kv_layers", 0, positive=False)
    kv_heads = _per_layer(meta, f"{arch}.attention.head_count_kv", n_layer)
    inner = _per_layer(meta, f"{arch}.feed_forward_length", n_layer)
    first_shared = n_layer - shared
    base, wide = inner[0], inner[first_shared:]
    if (
        any(i != base for i in inner[:first_shared])
        or any(i not in (base, 2 * base) for i in wide)
        or len(set(wide)) > 1
    ):
        raise GGUFError(f"metadata {arch}.feed_forward_length is not one width (double on the shared layers)")
    global_head_dim = number(meta, f"{arch}.attention.key_length")
    k_eq_v = any(
        f"blk.{i}.attn_v.weight" not in stored for i, t in enumerate(types[:first_shared]) if t == "full_attention"
    )
    sliding_kv = _of_kind(kv_heads, types, "sliding_attention", "head_count_kv")
    full_kv = _of_kind(kv_heads, types, "full_attention", "head_count_kv")
    # every layer full, or every layer sliding: the one kind's heads stand for both (the other names no layer)
    sliding_kv, full_kv = (
        sliding_kv if sliding_kv is not None else full_kv,
        full_kv if full_kv is not None else sliding_kv,
    )
    if full_kv != sliding_kv and not k_eq_v:
        raise GGUFError("full layers with their own KV heads but values of their own: transformers' Gemma 4 has none")
    cap = meta.get(f"{arch}.final_logit_softcapping")
    per_layer_dim = number(meta, f"{arch}.embedding_length_per_layer_input", 0, positive=False)
    ple = stored.get("per_layer_token_embd.weight")
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": vocab,
        "hidden_size": number(meta, f"{arch}.embedding_length"),
        "intermediate_size": base,
        "use_double_wide_mlp": bool(wide) and wide[0] == 2 * base,
        "num_hidden_layers": n_layer,
        "num_attention_heads": number(meta, f"{arch}.attention.head_count"),
        "num_key_value_heads": sliding_kv,
        "head_dim": number(meta, f"{arch}.attention.key_length_swa"),
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": full_kv if k_eq_v else None,
        "attention_k_eq_v": k_eq_v,
        "max_position_embeddings": context_length(meta, f"{arch}.context_length"),
        "rms_norm_eps": number(meta, f"{arch}.attention.layer_norm_rms_epsilon", kind=float, below=MAX_NORM_EPSILON),
        "layer_types": types,
        "sliding_window": number(meta, f"{arch}.attention.sliding_window"),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": per_layer_dim,
        "vocab_size_per_layer_input": int(ple.shape[-1]) if per_layer_dim and ple is not None else vocab,
        "final_logit_softcapping": None if not cap else number(meta, f"{arch}.final_logit_softcapping", kind=float),
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": number(meta, f"{arch}.rope.freq_base", kind=float),
                "partial_rotary_factor": _rotated_share(stored, global_head_dim),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": number(meta, f"{arch}.rope.freq_base_swa", 10_000.0, kind=float),
            },
        },
        "tie_word_embeddings": "output.weight" not in stored,
    }


# GGUF block tensor -> HF name (`model.layers.N.` + this)
GGUF_BLOCK = gemma3.GGUF_BLOCK | {  # Gemma 3's block, and the per-layer input and the layer scalar
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "layer_output_scale.weight": "layer_scalar",
}
KV_PARTS = ("attn_k.", "attn_v.", "attn_k_norm.")  # what a KV-shared layer lacks
PER_LAYER_PARTS = ("inp_gate.", "proj.", "post_norm.")


def gguf_tensors(config: dict) -> dict[str, Entry]:
    """HF name -> where and how the file stores it (no 1 + w norms, no permuted rows: Gemma's converter)."""
    c = config_from_hf(config)
    hidden, dim = c.n_embd, c.per_layer_dim
    entries = {"model.embed_tokens.weight": Entry("token_embd.weight", (c.vocab_size, hidden))}
    if dim:
        entries["model.embed_tokens_per_layer.weight"] = Entry(
            "per_layer_token_embd.weight", (c.per_layer_vocab, c.n_layer * dim)
        )
        entries["model.per_layer_model_projection.weight"] = Entry(
            "per_layer_model_proj.weight", (c.n_layer * dim, hidden)
        )
        entries["model.per_layer_projection_norm.weight"] = Entry("per_layer_proj_norm.weight", (dim,))
    for i in range(c.n_layer):
        heads, kv, head_dim, inner = c.n_head, c.kv_heads(i), c.head_size(i), c.inner(i)
        shapes = {
            "attn_q": (heads * head_dim, hidden), "attn_k": (kv * head_dim, hidden), "attn_v": (kv * head_dim, hidden),
            "attn_output": (hidden, heads * head_dim), "attn_q_norm": (head_dim,), "attn_k_norm": (head_dim,),
            "ffn_gate": (inner, hidden), "ffn_up": (inner, hidden), "ffn_down": (hidden, inner),
            "inp_gate": (dim, hidden), "proj": (hidden, dim), "layer_output_scale": (1,),
        }  # fmt: skip
        for gguf_suffix, hf_suffix in GGUF_BLOCK.items():
            shared = c.kv_source[i] != i
            if (shared and gguf_suffix.startswith(KV_PARTS)) or (not dim and gguf_suffix.startswith(PER_LAYER_PARTS)):
                continue
            if gguf_suffix.startswith("attn_v.") and c.attention_k_eq_v and c.full(i):
                continue
            shape = shapes.get(gguf_suffix.split(".")[0], (hidden,))
            entries[f"model.layers.{i}.{hf_suffix}"] = Entry(f"blk.{i}.{gguf_suffix}", shape)
    entries["model.norm.weight"] = Entry("output_norm.weight", (hidden,))
    return with_head(entries, config, c.vocab_size, hidden)


# LoRA: a KV-shared layer has no k_proj or v_proj (nor a full layer's v_proj with attention_k_eq_v), so its qkv slot
# is Q's alone; export/lora.py gives layers whose parts or widths differ (head sizes, double-wide MLPs) their own
# slots. The model's per_layer_model_projection, outside the layers, has no slot (merged at export, it works).
LORA_LINEARS = (
    *llama.LORA_LINEARS,
    ("model.layers.%d.per_layer_input_gate", "per_layer.gate"),
    ("model.layers.%d.per_layer_projection", "per_layer.projection"),
)


def _row(model_type: str, renames: tuple, note: dict, gguf: GGUFLayout | None = None) -> Family:
    return Family(
        model_type=model_type,
        name="gemma4_text",  # gemma4's package is its text model
        label="Gemma 4",
        genai_type=None,  # onnxruntime-genai 0.18 builds neither per-layer embeddings nor KV sharing
        load=lambda folder: load(folder, renames=renames),
        build=_build_from_config,
        decoder=decoder,
        details=lambda model: details(model) | GENAI | note,
        tokens=llama.tokens,
        gguf=gguf,
        lazy_weights=True,
        lora_linears=LORA_LINEARS,
    )


# onnxruntime-genai 0.18 cannot run these packages: the manifest says so where genai_config.json would be
GENAI = {"genai_config": "not written: onnxruntime-genai 0.18 builds neither per-layer embeddings nor KV sharing"}
ROWS = (
    _row(
        "gemma4_text",
        (),
        {},
        GGUFLayout(architecture="gemma4", config=gguf_config, tensors=gguf_tensors, also_read=(ROPE_FREQS,)),
    ),  # fmt: skip
    _row("gemma4", RENAMES, {"skipped": "the vision and audio towers: the package is the text model"}),
)
