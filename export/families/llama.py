"""The Llama family (model_type llama, mistral, qwen2, qwen3: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2/2.5,
Qwen3): how its folders and GGUF files load into the reference model (export/models/llama.py), the Decoder that model
makes, and a row per model_type. The four differ in data only: `VARIANTS`, and how llama.cpp writes them.

Config keys are those transformers writes, in both the 4.x form (`rope_theta`, `rope_scaling`) and the 5.x form
(`rope_parameters`). In a GGUF file `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight` (the map
is GGUF_BLOCK), and llama.cpp's Llama converter reorders each head's Q and K rows from HF's "first half, second
half" rotary layout to interleaved pairs (its `LlamaModel.permute`), which reading undoes (Entry.heads); Qwen's
converters write them unpermuted. Mistral files say architecture "llama", so they read as Llama files. A Llama
file's rope_freqs.weight (Llama 3's rope scaling as llama.cpp's converter stores it) divides the rotary
frequencies as llama.cpp's rope does: the reference model and both graphs take them from LlamaConfig.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
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
from ..models.llama import ROPE_SCALING_KEYS, Llama, LlamaConfig, rope_inv_freq, rotary_factor
from .family import Blocks, Family, GGUFLayout, array, checked_tokens, head_blocks, kept_blocks, linear, norm, packed

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints saved; recomputed from the config


@dataclass(frozen=True)
class Variant:
    """What a model_type fixes that its config.json does not say (config_from_hf maps the rest)."""

    label: str  # for people
    qkv_bias: bool = False  # Q/K/V biases, always (Qwen2); the others refuse config.json's attention_bias
    qk_norm: bool = False  # per-head query/key RMSNorm (Qwen3)
    window_always: bool = False  # config.json's sliding_window applies without use_sliding_window (Mistral)
    gguf_class: str | None = None  # the transformers class a GGUF file of this architecture is; None: not read
    permuted: bool = False  # llama.cpp's converter permuted the Q/K rows


VARIANTS = {
    "llama": Variant("Llama (SmolLM2 among them)", gguf_class="LlamaForCausalLM", permuted=True),
    "mistral": Variant("Mistral", window_always=True),
    "qwen2": Variant("Qwen2/Qwen2.5", qkv_bias=True, gguf_class="Qwen2ForCausalLM"),
    "qwen3": Variant("Qwen3", qk_norm=True, gguf_class="Qwen3ForCausalLM"),
}


def rope_from_hf(hf: dict, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config form; rope_scaling keeps rope_type and that type's keys
    (LlamaConfig refuses an unknown type or a missing key)."""
    params = hf.get("rope_parameters") or {}  # transformers 5: theta and scaling in one dict
    scaling = hf.get("rope_scaling") or params  # transformers 4: scaling apart, theta at the top
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise CheckpointError("config.json's rope_parameters and rope_scaling must be objects")
    theta = config_number(params if "rope_theta" in params else hf, "rope_theta", 10000.0, kind=float)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        # transformers falls back to max_position_embeddings when the original context is not given
        scaling = {"original_max_position_embeddings": max_positions, **scaling}
    keys = ROPE_SCALING_KEYS.get(rope_type, ())
    # every scaling value is a positive number: the context an int, the factors floats (a NaN factor, or equal low
    # and high frequency factors, would make the rotary frequencies NaN)
    checked = {
        k: config_number(scaling, k, kind=int if k == "original_max_position_embeddings" else float)
        for k in keys
        if k in scaling
    }
    if {"low_freq_factor", "high_freq_factor"} <= set(checked) and checked["high_freq_factor"] <= checked[
        "low_freq_factor"
    ]:
        raise CheckpointError("config.json's rope scaling high_freq_factor must be above its low_freq_factor")
    return theta, {"rope_type": rope_type, **checked}


def config_from_hf(hf: dict) -> LlamaConfig:
    """Map a Hugging Face config.json (llama, mistral, qwen2, qwen3) onto LlamaConfig; refuse what Llama does not
    implement."""
    model_type = hf.get("model_type")
    if model_type not in VARIANTS:
        raise CheckpointError(f"unsupported model_type {model_type!r}; supported: {', '.join(VARIANTS)}")
    fields = config_fields(hf, VARIANTS[model_type])
    with config_errors():
        return LlamaConfig(**fields)


def config_fields(hf: dict, variant: Variant) -> dict:
    """LlamaConfig's fields from a Llama-like config.json (the families made of Llama's parts start from them)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"unsupported hidden_act {hf['hidden_act']!r}: Llama-family models use 'silu'")
    if not variant.qkv_bias and hf.get("attention_bias"):
        raise CheckpointError(
            "config.json sets attention_bias=true (an o_proj bias too), which edgelm does not implement"
        )
    if hf.get("mlp_bias"):
        raise CheckpointError("config.json sets mlp_bias=true, which edgelm does not implement")
    with config_errors():
        n_positions = config_number(hf, "max_position_embeddings")
        theta, scaling = rope_from_hf(hf, n_positions)
        # A sliding window only changes attention once the context exceeds it; capping the context length at the
        # window means it never applies, so plain causal attention is exact (Mistral; Qwen2 when enabled).
        window = hf.get("sliding_window") if variant.window_always or hf.get("use_sliding_window") else None
        capped = window is not None and config_number(hf, "sliding_window") < n_positions
        n_positions = config_context_length(
            window if capped else n_positions, "sliding_window" if capped else "max_position_embeddings"
        )
        n_head = config_number(hf, "num_attention_heads")
        return dict(
            vocab_size=config_number(hf, "vocab_size"),
            n_positions=n_positions,
            n_embd=config_number(hf, "hidden_size"),
            n_layer=config_number(hf, "num_hidden_layers"),
            n_head=n_head,
            n_kv_head=config_number(hf, "num_key_value_heads", n_head),
            head_dim=config_number(hf, "head_dim") if hf.get("head_dim") is not None else None,
            n_inner=config_number(hf, "intermediate_size"),
            rms_norm_eps=config_number(hf, "rms_norm_eps", 1e-6, kind=float, below=MAX_NORM_EPSILON),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=variant.qkv_bias,  # Qwen2's config has no key for its Q/K/V biases
            qk_norm=variant.qk_norm,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),  # transformers' default for all four
            bos_token_id=first_id(hf.get("bos_token_id"), "bos_token_id"),
            eos_token_ids=token_ids(hf.get("eos_token_id"), "eos_token_id"),
            model_type=hf["model_type"],
        )


def build_llama(config: LlamaConfig, state: dict[str, torch.Tensor]) -> Llama:
    """A Llama holding `state` (Hugging Face names, fp32), every shape checked; the tensors become the
    parameters (no second copy). Missing or unexpected tensors raise CheckpointError."""
    model = load_weights(
        lambda: Llama(config), state, prefix="model.", embedding="model.embed_tokens.weight",
        tied=config.tie_word_embeddings, what=config.model_type, ignored=IGNORED_SUFFIXES,
    )  # fmt: skip
    model.inv_freq = rope_inv_freq(config)  # the buffers are not in the state dict; they were built on meta
    model.inv_freq_local = rope_inv_freq(config, local=True)
    model.inv_freq_long = rope_inv_freq(config, long=True)
    for freq in (model.inv_freq, model.inv_freq_local, model.inv_freq_long):
        if not torch.isfinite(freq).all():
            rope = f"rope_theta {config.rope_theta}, rope_scaling {config.rope_scaling}"
            raise CheckpointError(f"rotary frequencies are not finite ({rope})")
    return model.eval()


def load_llama(
    folder: str | Path,
    *,
    config_from_hf=config_from_hf,
    renames: tuple[tuple[str, str | None], ...] = (),
    transform: Callable[[dict, LlamaConfig], dict] | None = None,
) -> Llama:
    """Load a Hugging Face llama / mistral / qwen2 / qwen3 folder (or, with the family's config mapping and
    tensor renames, a Gemma 3 one) into the reference model (eval mode), its weights read when used
    (export/lazy_weights.py). transform: a family's own work on the state dict (Phi-3's packed projections
    split, ...), given TensorLoaders, whose shape operations (split, chunk, reshape, ...) read nothing.
    The config's BOS/EOS ids are those of read_extras (generation_config.json first)."""
    folder = Path(folder)
    config = config_from_hf(read_config(folder))
    extras = read_extras(folder)
    config = dataclasses.replace(config, bos_token_id=extras["bos_token_id"], eos_token_ids=extras["eos_token_ids"])
    state = renamed(read_safetensors_folder(folder, lazy=True), renames)
    return build_llama(config, state if transform is None else transform(state, config))


def _gguf_head_dim(meta: dict, arch: str) -> int:
    """Heads' width: key_length, else rope.dimension_count, else embedding_length / head_count."""
    heads, hidden = number(meta, f"{arch}.attention.head_count"), number(meta, f"{arch}.embedding_length")
    rotary_key = f"{arch}.rope.dimension_count"
    if f"{arch}.attention.key_length" not in meta and rotary_key not in meta and hidden % heads:
        raise GGUFError(f"embedding_length {hidden} is not a multiple of head_count {heads} (and no key_length)")
    head_dim = number(
        meta, f"{arch}.attention.key_length", number(meta, rotary_key) if rotary_key in meta else hidden // heads
    )
    rotary_dim = number(meta, rotary_key, head_dim)
    if rotary_dim != head_dim or head_dim % 2:
        raise GGUFError(f"rope.dimension_count {rotary_dim} with heads of {head_dim}: edgelm rotates whole, even heads")
    return head_dim


ROPE_FREQS = ("rope_freqs.weight",)  # llama.cpp's per-frequency divisors: Llama 3's rope scaling
# llama.cpp reads rope_freqs.weight in Llama files only: in a Qwen file it is an unexpected tensor
ROPE_FREQS_ARCHITECTURES = ("llama",)
FREQ_FACTORS = "rope_freq_factors"  # the GGUF config's key for them (not a transformers key: folders never set it)


def _rope_freq_factors(stored: dict, head_dim: int) -> list[float] | None:
    """rope_freqs.weight's head_dim / 2 positive factors, each rotary frequency's divisor (llama.cpp's
    freq_factors, which its converter computes from a Llama 3 rope scaling); None when the file has none."""
    if ROPE_FREQS[0] not in stored:
        return None
    tensor = stored[ROPE_FREQS[0]]
    shape = tuple(reversed(tensor.shape))
    if shape != (head_dim // 2,):
        raise GGUFError(f"tensor {ROPE_FREQS[0]} has shape {shape}, expected ({head_dim // 2},), a factor a frequency")
    factors = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)
    if not (np.isfinite(factors) & (factors > 0)).all():
        raise GGUFError(f"tensor {ROPE_FREQS[0]} holds factors that are not positive finite numbers")
    return factors.tolist()


def _gguf_rope_scaling(meta: dict, arch: str) -> dict | None:
    # llama.cpp reads a factor without a type (or under its older key) as linear scaling: so does this
    factor_key = next((k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear") if k in meta), None)
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "linear" if factor_key else "none")
    rope_scaling = None
    if scaling_type == "linear":
        factor = number(meta, factor_key or f"{arch}.rope.scaling.factor", kind=float)
        rope_scaling = {"rope_type": "linear", "factor": factor}
    elif scaling_type != "none":
        raise GGUFError(
            f"rope scaling {scaling_type!r:.60} is not supported ('linear', and Llama 3's as rope_freqs.weight, are)"
        )
    return rope_scaling


def gguf_config(meta: dict, stored: dict, vocab: int, *, arch: str, hf_class: str) -> dict:
    """config.json of a Llama-family file (`arch` the file's general.architecture)."""
    heads, hidden = number(meta, f"{arch}.attention.head_count"), number(meta, f"{arch}.embedding_length")
    kv_heads = number(meta, f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise GGUFError(f"head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    head_dim = _gguf_head_dim(meta, arch)
    theta = number(meta, f"{arch}.rope.freq_base", 10000.0, kind=float)
    factors = _rope_freq_factors(stored, head_dim) if arch in ROPE_FREQS_ARCHITECTURES else None
    return {
        "architectures": [hf_class],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": number(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": number(meta, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": context_length(meta, f"{arch}.context_length"),
        "rms_norm_eps": number(meta, f"{arch}.attention.layer_norm_rms_epsilon", kind=float, below=MAX_NORM_EPSILON),
        "rope_theta": theta,
        "rope_scaling": _gguf_rope_scaling(meta, arch),
        "tie_word_embeddings": "output.weight" not in stored,
        "attention_bias": "blk.0.attn_q.bias" in stored,
        "hidden_act": "silu",
    } | ({FREQ_FACTORS: factors} if factors is not None else {})


# GGUF block tensor -> HF name (`model.layers.N.` + this)
GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's per-head norms, (head_dim,)
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QK_NORMS = ("attn_q_norm", "attn_k_norm")


def gguf_tensors(
    config: dict, *, permuted: bool = False, qk_norm: bool = False, block: dict = GGUF_BLOCK, norm_shift: float = 0.0
) -> dict[str, Entry]:
    """HF name -> where and how it is stored, for every tensor of a Llama-family file. permuted: llama.cpp
    reordered the Q/K rows (its Llama converter, not Qwen's); qk_norm: per-head norms (Qwen3, Gemma 3);
    block: the layer's names; norm_shift: added to every norm weight read."""
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden)}
    shapes |= {"attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim)}
    shapes |= {"ffn_gate": (inner, hidden), "ffn_up": (inner, hidden), "ffn_down": (hidden, inner)}
    shapes |= {"attn_q_norm": (head_dim,), "attn_k_norm": (head_dim,)}
    rotary_heads = {"attn_q": heads, "attn_k": kv_heads} if permuted else {}
    entries = {"model.embed_tokens.weight": Entry("token_embd.weight", (vocab, hidden))}
    for layer in range(config["num_hidden_layers"]):
        for gguf_suffix, hf_suffix in block.items():
            stem, kind = gguf_suffix.split(".")
            if (kind == "bias" and not config["attention_bias"]) or (stem in QK_NORMS and not qk_norm):
                continue
            weight = shapes.get(stem, (hidden,))
            shape = weight if kind == "weight" else weight[:1]
            shift = norm_shift if stem.endswith("norm") else 0.0
            entry = Entry(f"blk.{layer}.{gguf_suffix}", shape, heads=rotary_heads.get(stem, 0), shift=shift)
            entries[f"model.layers.{layer}.{hf_suffix}"] = entry
    entries["model.norm.weight"] = Entry("output_norm.weight", (hidden,), shift=norm_shift)
    return with_head(entries, config, vocab, hidden)


# the checkpoint tensors (in `model.layers.N.`) the packed linears' GGUF blocks are read from
PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "up": ("mlp.gate_proj", "mlp.up_proj")}


def _layer(block: torch.nn.Module, c: LlamaConfig, blocks: Blocks | None, *, prefix: str, parts: dict) -> Layer:
    """One decoder layer; `prefix` names its tensors in `blocks` ("model.layers.3")."""
    a, mlp = block.self_attn, block.mlp

    def kept(*names: str):
        return kept_blocks(blocks, [f"{prefix}.{name}.weight" for name in names])

    sandwich = block.sandwich  # Gemma 3: post_attention_layernorm follows attention, pre_feedforward leads the MLP
    return Layer(
        attention_norm=norm(block.input_layernorm),
        qkv=packed([a.q_proj, a.k_proj, a.v_proj], kept(*parts["qkv"])),
        attention_out=linear(a.o_proj, kept("self_attn.o_proj")),
        mlp_norm=norm(block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm),
        up=packed([mlp.gate_proj, mlp.up_proj], kept(*parts["up"])),  # gate first
        down=linear(mlp.down_proj, kept("mlp.down_proj")),
        q_norm=norm(a.q_norm) if c.qk_norm else None,
        k_norm=norm(a.k_norm) if c.qk_norm else None,
        attention_post_norm=norm(block.post_attention_layernorm) if sandwich else None,
        mlp_post_norm=norm(block.post_feedforward_layernorm) if sandwich else None,
        sliding_window=c.sliding_window if block.sliding else None,
        rotary=block.rotary,
    )


def decoder(model: Llama, *, blocks: Blocks | None = None, parts: dict = PARTS) -> Decoder:
    """blocks: keep the checkpoint's own quantized blocks where it has them (a GGUF file's); a packed linear
    keeps them when all its parts have blocks of the same bits; parts: the checkpoint tensors they are read
    from (Phi-3's are packed already)."""
    c, m = model.config, model.model
    layers = [_layer(block, c, blocks, prefix=f"model.layers.{i}", parts=parts) for i, block in enumerate(m.layers)]
    longrope = (c.rope_scaling or {}).get("rope_type") == "longrope"
    rotary = Rotary(
        array(model.inv_freq),  # (rotary_dim / 2,): the reference's, from which the graph computes its caches
        factor=rotary_factor(c),
        long_inv_freq=array(model.inv_freq_long) if longrope else None,
        long_after=c.rope_scaling["original_max_position_embeddings"] if longrope else None,
    )
    attention_scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5
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
        embedding=array(m.embed_tokens.weight),
        layers=layers,
        final_norm=norm(m.norm),
        lm_head=None if c.tie_word_embeddings else array(model.lm_head.weight).T,
        head_nbits=head_blocks(blocks, c.tie_word_embeddings, "model.embed_tokens.weight"),
        embedding_nbits=None if c.tie_word_embeddings else kept_blocks(blocks, ["model.embed_tokens.weight"]),
        rotary=rotary,
        rotary_local=Rotary(array(model.inv_freq_local)) if c.sliding_window else None,
        embedding_scale=float(np.float32(c.n_embd**0.5)) if c.embedding_scale else c.embedding_multiplier,
        attention_scale=c.attention_multiplier or attention_scale,
        residual_scale=c.residual_multiplier,
        logits_divisor=c.logits_scaling,
    )


def details(model: Llama) -> dict:
    c = model.config
    return {
        "n_embd": c.n_embd,
        "n_inner": c.n_inner,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        **({"rope_freq_factors": c.rope_freq_factors} if c.rope_freq_factors is not None else {}),
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": c.attention_bias,
        "qk_norm": c.qk_norm,
        **({"layer_types": c.layer_types, "sliding_window": c.sliding_window} if c.layer_types else {}),
        **({"rope_local_theta": c.rope_local_theta} if c.sliding_window else {}),
        "tie_word_embeddings": c.tie_word_embeddings,
        "parameters": model.num_parameters(),
    }


def tokens(folder: Path, model: Llama) -> dict:
    extras = read_extras(folder)
    return checked_tokens(
        model.config.vocab_size, extras["bos_token_id"], extras["eos_token_ids"], extras["pad_token_id"]
    )


LORA_LINEARS = tuple(
    (f"model.layers.%d.{path}", target)
    for path, target in (
        ("self_attn.q_proj", "qkv"), ("self_attn.k_proj", "qkv"), ("self_attn.v_proj", "qkv"),
        ("self_attn.o_proj", "attention_out"), ("mlp.gate_proj", "up"), ("mlp.up_proj", "up"),
        ("mlp.down_proj", "down"),
    )
)  # fmt: skip


def _build(hf: dict, state: dict) -> Llama:
    """The reference model of a GGUF file's config (its rope_freqs.weight factors too)."""
    config = config_from_hf(hf)
    if hf.get(FREQ_FACTORS) is not None:
        config = dataclasses.replace(config, rope_freq_factors=hf[FREQ_FACTORS])
    return build_llama(config, state)


def _gguf(model_type: str, variant: Variant) -> GGUFLayout | None:
    if variant.gguf_class is None:
        return None

    def config(meta: dict, stored: dict, vocab: int) -> dict:
        return gguf_config(meta, stored, vocab, arch=model_type, hf_class=variant.gguf_class)

    def tensors(config: dict) -> dict[str, Entry]:
        return gguf_tensors(config, permuted=variant.permuted, qk_norm=variant.qk_norm)

    also_read = ROPE_FREQS if model_type in ROPE_FREQS_ARCHITECTURES else ()
    return GGUFLayout(architecture=model_type, config=config, tensors=tensors, also_read=also_read)


ROWS = tuple(
    Family(
        model_type=model_type,
        name=model_type,
        label=variant.label,
        genai_type=model_type,
        load=load_llama,
        build=_build,
        decoder=decoder,
        details=details,
        tokens=tokens,
        gguf=_gguf(model_type, variant),
        lora_linears=LORA_LINEARS,
        lazy_weights=True,
    )
    for model_type, variant in VARIANTS.items()
)
