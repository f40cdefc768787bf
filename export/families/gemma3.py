"""Gemma 3 (model_type gemma3_text, and gemma3's text part): how its folders and GGUF files load into the
reference model (export/models/llama.py's Llama with a Gemma3Config), and its rows. The Decoder is the Llama
family's (export/families/llama.py), which reads the parts Gemma3Config turns on.

Gemma 3 interleaves sliding-window layers with full-attention ones: every FULL_EVERY-th layer is full where
a config (or a GGUF file) gives no explicit pattern (`layer_types`). llama.cpp stores its RMSNorm weights as
1 + w (read back as w) and writes no layer pattern, sliding-layer rotary base or attention scale: its loader
fixes them, and so does gguf_config.
"""

from __future__ import annotations

from functools import partial

from ..checkpoint import (
    CheckpointError,
    config_context_length,
    config_errors,
    config_number,
    first_id,
    renamed,
    token_ids,
)
from ..gguf_metadata import Entry, GGUFError, number
from ..limits import MAX_NORM_EPSILON
from ..models.llama import Gemma3Config, Llama
from . import llama
from .family import Family, GGUFLayout

FULL_EVERY = 6  # without a pattern, layers FULL_EVERY - 1, 2 FULL_EVERY - 1, ... are full attention

DEFAULTS = {  # transformers' Gemma3TextConfig defaults: a gemma3 config's text_config may leave them out
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True,
}  # fmt: skip

# Gemma 3's image-and-text checkpoints (model_type gemma3) keep the text model under another prefix
# (transformers 5: model.language_model.*; 4.x: language_model.model.*) beside the vision tower, left out here.
RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", None),
    ("vision_tower.", None),
    ("model.multi_modal_projector.", None),
    ("multi_modal_projector.", None),
)


def layer_types(n_layer: int, full_every: int = FULL_EVERY) -> list[str]:
    """Each layer's attention when nothing names it: every `full_every`-th layer full, the others sliding."""
    return ["sliding_attention" if (i + 1) % full_every else "full_attention" for i in range(n_layer)]


def _text_config(hf: dict) -> dict:
    """The text model's config: gemma3's text_config, or gemma3_text's own; transformers' defaults filled in;
    the options the reference model does not implement refused."""
    if hf.get("model_type") == "gemma3":
        if not isinstance(hf.get("text_config"), dict):
            raise CheckpointError("config.json of model_type 'gemma3' has no text_config")
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
    hf = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in DEFAULTS}}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # transformers: null is off (0 divides by 0)
        if hf.get(key) is not None:
            raise CheckpointError(
                f"config.json sets {key}={hf[key]!r:.60}, which edgelm does not implement (null: off)"
            )
    for key in ("use_bidirectional_attention", "attention_bias"):
        if hf.get(key):
            raise CheckpointError(f"config.json sets {key}={hf[key]!r:.60}, which edgelm does not implement")
    if hf["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"unsupported hidden_activation {hf['hidden_activation']!r} for Gemma 3")
    return hf


def _rope_entry(params: dict, layer_type: str) -> dict:
    entry = params.get(layer_type)
    if entry is not None and not isinstance(entry, dict):
        raise CheckpointError(f"config.json's rope_parameters.{layer_type} must be an object, not {entry!r:.60}")
    return dict(entry or {})


def _full_attention(hf: dict, params: dict) -> dict:
    """The full layers' rotary entry: rope_parameters' own, a rope_scaling beside it (4.x's key) merged in as
    transformers merges it, its base rope_theta where the entry names none."""
    full = _rope_entry(params, "full_attention")
    legacy = hf.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise CheckpointError(f"config.json's rope_scaling must be an object, not {legacy!r:.60}")
    if legacy and "rope_type" not in legacy:  # transformers keeps full_attention's own (default) type: no scaling
        raise CheckpointError(
            "config.json's rope_scaling names no rope_type, so transformers reads it as no scaling for Gemma 3 "
            "(4.x's key 'type' is not read there); name it rope_type"
        )
    full |= legacy or {}
    key = "rope_parameters.full_attention.rope_theta" if "rope_theta" in full else "rope_theta"
    full["rope_theta"] = config_number(full if "rope_theta" in full else hf, "rope_theta", kind=float, what=key)
    return full


def _local_theta(hf: dict, params: dict) -> float:
    """The sliding layers' rotary base (they take no scaling): rope_parameters' own, else rope_local_base_freq."""
    local = _rope_entry(params, "sliding_attention")
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise CheckpointError(f"sliding-layer rope_type {local_type!r:.60} is not supported")
    if "rope_theta" in local:
        return config_number(local, "rope_theta", kind=float, what="rope_parameters.sliding_attention.rope_theta")
    return config_number(hf, "rope_local_base_freq", kind=float)


def _rope(hf: dict, n_positions: int) -> tuple[float, dict | None, float]:
    """(the full layers' rotary base, their scaling, the sliding layers' base) as transformers' Gemma3TextConfig
    reads them: rope_parameters per layer type (transformers 5), or 4.x's rope_theta, rope_scaling and
    rope_local_base_freq."""
    params = {} if hf.get("rope_parameters") is None else hf["rope_parameters"]
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json's rope_parameters must be an object, not {params!r:.60}")
    other = sorted(set(params) - {"full_attention", "sliding_attention"})
    if other:  # transformers would ignore them: a flat rope_parameters is not Gemma 3's
        raise CheckpointError(
            f"config.json's rope_parameters holds {other[0]!r:.60}: Gemma 3's has a full_attention and a "
            "sliding_attention entry"
        )
    theta, scaling = llama.rope_from_hf({"rope_parameters": _full_attention(hf, params)}, n_positions)
    return theta, scaling, _local_theta(hf, params)


def config_from_hf(hf: dict) -> Gemma3Config:
    """Map a Gemma 3 config.json onto Gemma3Config: gemma3_text, or gemma3 (image and text), whose text part
    (`text_config`) is exported; refuse what the reference model does not implement."""
    hf = _text_config(hf)
    with config_errors():
        n_positions = config_context_length(config_number(hf, "max_position_embeddings"), "max_position_embeddings")
        n_layer = config_number(hf, "num_hidden_layers")
        theta, scaling, local_theta = _rope(hf, n_positions)
        pattern = config_number(hf, "sliding_window_pattern", FULL_EVERY)  # the older key
        types = hf.get("layer_types") or layer_types(n_layer, pattern)
        n_head = config_number(hf, "num_attention_heads")
        return Gemma3Config(
            vocab_size=config_number(hf, "vocab_size"),
            n_positions=n_positions,
            n_embd=config_number(hf, "hidden_size"),
            n_layer=n_layer,
            n_head=n_head,
            n_kv_head=config_number(hf, "num_key_value_heads", n_head),
            head_dim=config_number(hf, "head_dim"),
            n_inner=config_number(hf, "intermediate_size"),
            rms_norm_eps=config_number(hf, "rms_norm_eps", kind=float, below=MAX_NORM_EPSILON),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            bos_token_id=first_id(hf.get("bos_token_id"), "bos_token_id"),
            eos_token_ids=token_ids(hf.get("eos_token_id"), "eos_token_id"),
            query_pre_attn_scalar=config_number(hf, "query_pre_attn_scalar", kind=float),
            layer_types=list(types),
            sliding_window=config_number(hf, "sliding_window") if "sliding_attention" in types else None,
            rope_local_theta=local_theta,
        )


def _build(hf: dict, state: dict) -> Llama:
    return llama.build_llama(config_from_hf(hf), renamed(state, RENAMES))


# Gemma's turns (llama.cpp's built-in "gemma" template): user and model turns between <start_of_turn> and
# <end_of_turn>, a system message folded into the first user turn, the model's turn opened for the reply.
TURNS = (
    "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ prefix if loop.first else '' }}{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a Gemma 3 file. llama.cpp's converter writes the window but no layer pattern, sliding-layer
    rotary base or attention scale: its loader fixes them (every FULL_EVERY-th layer full, base 10000,
    head_dim ** -0.5 but for the 27B's 62 layers); keys that newer writers add for them are read when present."""
    config = llama.gguf_config(meta, stored, vocab, arch="gemma3", hf_class="Gemma3ForCausalLM")
    n_layer, head_dim = config["num_hidden_layers"], config["head_dim"]
    for key in ("gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"):
        if meta.get(key):
            raise GGUFError(f"metadata {key} is set: logit softcapping is not supported")
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if pattern is None:
        types = layer_types(n_layer)
    elif not isinstance(pattern, list) or len(pattern) != n_layer or not all(isinstance(p, bool) for p in pattern):
        raise GGUFError(f"metadata gemma3.attention.sliding_window_pattern should be {n_layer} booleans")
    else:
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    scalar = config["hidden_size"] // config["num_attention_heads"] if n_layer == 62 else head_dim
    del config["hidden_act"]
    return config | {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": number(meta, "gemma3.attention.sliding_window"),
        "rope_local_base_freq": number(meta, "gemma3.rope.freq_base_swa", 10000.0, kind=float),
        "query_pre_attn_scalar": scalar,
    }


# GGUF block tensor -> HF name (`model.layers.N.` + this): norms before and after attention and the MLP
GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_tensors(config: dict) -> dict[str, Entry]:
    return llama.gguf_tensors(config, qk_norm=True, block=GGUF_BLOCK, norm_shift=-1.0)


def _row(model_type: str, gguf: GGUFLayout | None) -> Family:
    return Family(
        model_type=model_type,
        name="gemma3_text",  # the image-and-text gemma3's package is its text part
        label="Gemma 3",
        genai_type="gemma3_text",
        load=partial(llama.load_llama, config_from_hf=config_from_hf, renames=RENAMES),
        build=_build,
        decoder=llama.decoder,
        details=llama.details,
        tokens=llama.tokens,
        gguf=gguf,
        lora_linears=llama.LORA_LINEARS,
        lazy_weights=True,
    )


# llama.cpp writes Gemma 3's text model as architecture gemma3, whose config.json is gemma3_text's
ROWS = (
    _row(
        "gemma3_text",
        # no rope_freqs.weight; base models' files (Gemma 3 270M) carry no chat template
        GGUFLayout(architecture="gemma3", config=gguf_config, tensors=gguf_tensors, chat_template=TURNS),
    ),
    _row("gemma3", None),
)
