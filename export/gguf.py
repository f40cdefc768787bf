"""Read a GGUF file (llama.cpp's model format) as a Hugging Face checkpoint: config, tokenizer.json, tensors.

The header is read by export/gguf_header.py (bounded, checked), the tensor data memory-mapped, and the
quantized tensors dequantized with llama.cpp's own Python package (`gguf`), one tensor at a time, on demand.
Three things differ from a Hugging Face checkpoint:
- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight` (the map is below);
- Llama/Mistral Q and K rows: llama.cpp's converter reorders each head's rows from HF's "first half, second
  half" rotary layout to interleaved pairs (its `LlamaModel.permute`); `_unpermute_rows` puts them back. Qwen2's
  weights are written unpermuted;
- GPT-2's Conv1D weights are stored (out, in); Hugging Face keeps them (in, out).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from .gguf_blocks import Runs, by_rows, to_runs
from .gguf_header import HeaderError, read_header
from .gguf_tokenizer import build_tokenizer_json
from .limits import MAX_NORM_EPSILON, checked_number, context_length_problem

Q = GGMLQuantizationType
SUPPORTED_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
TOKEN_IDS = ("bos", "eos", "eot", "padding", "unknown")  # the tokenizer.ggml.{name}_token_id keys export reads
# codebook types: read (dequantized by gguf-py), but no exact MatMulNBits form (export/gguf_blocks.py)
SUPPORTED_TYPES |= {kind for kind in Q if kind.name.startswith(("IQ", "TQ"))}

# GGUF block tensor -> HF name, for the Llama family (`model.layers.N.` + this)
LLAMA_BLOCK = {
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
# ... and for Gemma 3, whose norms come before and after attention and the MLP
GEMMA3_BLOCK = {
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
GEMMA3_FULL_EVERY = 6  # llama.cpp's loader: without a pattern key, layers 5, 11, ... are full attention
# ... and for GPT-2 (`transformer.h.N.` + this)
GPT2_BLOCK = {
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    "attn_qkv.weight": "attn.c_attn.weight",
    "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight",
    "attn_output.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight",
    "ffn_norm.bias": "ln_2.bias",
    "ffn_up.weight": "mlp.c_fc.weight",
    "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight",
    "ffn_down.bias": "mlp.c_proj.bias",
}


class GGUFError(ValueError):
    """A GGUF file that cannot be read: one line saying what is wrong with which file."""


class _Stored(NamedTuple):
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length
    data: np.ndarray  # uint8 (rows, bytes per row), memory-mapped: what gguf.quants.dequantize takes


@dataclass(frozen=True)
class _Entry:
    gguf_name: str
    shape: tuple[int, ...]  # numpy shape as stored: (out, in) for a linear weight
    transpose: bool = False  # GPT-2 Conv1D: Hugging Face keeps (in, out)
    heads: int = 0  # > 0: undo llama.cpp's rotary row permutation over this many heads
    shift: float = 0.0  # added on reading: -1 for Gemma's norms, which llama.cpp stores as 1 + w


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """GGUF rows per head (hd/2, 2) interleaved -> HF (2, hd/2) halves; works on any trailing dimensions."""
    head_dim = rows.shape[0] // heads
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass
class GGUFModel:
    path: Path
    architecture: str  # general.architecture: one of export/families.py's gguf_architecture
    hf_config: dict  # what a Hugging Face config.json for this model would say
    tokenizer_json: str  # tokenizer.json text built from tokenizer.ggml.*
    chat_template: str | None  # tokenizer.chat_template
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    tensor_names: list[str]  # Hugging Face names, in file order
    _entries: dict[str, _Entry] = field(repr=False, default_factory=dict)
    _stored: dict[str, _Stored] = field(repr=False, default_factory=dict)  # GGUF name -> its memory-mapped data

    def _lookup(self, name: str):
        if name not in self._entries:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        entry = self._entries[name]
        return entry, self._stored[entry.gguf_name]

    def quant_type(self, name: str) -> str:
        """The GGUF tensor type of `name`: "F32", "F16", "Q8_0", "Q4_0", "Q4_1", ..."""
        return self._lookup(name)[1].tensor_type.name

    def tensor(self, name: str) -> np.ndarray:
        """`name` dequantized to a new float32 array in Hugging Face orientation."""
        entry, stored = self._lookup(name)
        weight = np.array(dequantize(stored.data, stored.tensor_type), dtype=np.float32).reshape(entry.shape)
        if entry.heads:
            weight = _unpermute_rows(weight, entry.heads)
        if entry.shift:
            weight += np.float32(entry.shift)
        return np.ascontiguousarray(weight.T) if entry.transpose else weight

    def matmul_nbits(self, name: str) -> Runs | None:
        """Linear weight `name` (N = out features, K = in features) as MatMulNBits runs, from its own quantized
        blocks without requantizing (export/gguf_blocks.py); None for float types and those with no such form."""
        entry, stored = self._lookup(name)
        if len(entry.shape) != 2:
            return None
        runs = to_runs(stored.tensor_type, stored.data, entry.shape[1])
        if runs is None or not entry.heads:
            return runs
        return by_rows(runs, lambda a: _unpermute_rows(a, entry.heads))


def _number(
    meta: dict, key: str, default: Any = None, *, kind: type = int, positive: bool = True, below: float | None = None
) -> Any:
    """Metadata `key` (`default` when absent) as one number of `kind` in range (export/limits.py checked_number)."""
    value = meta.get(key, default)
    if value is None:
        raise GGUFError(f"metadata {key} is missing")
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        with np.errstate(over="ignore"):  # a float64 past float32's range becomes inf, refused below
            value = float(str(np.float32(value)))  # f32 1e-5 -> 1e-05, not 9.99e-06
    try:
        return checked_number(value, f"metadata {key}", kind=kind, positive=positive, below=below)
    except ValueError as error:
        raise GGUFError(str(error)) from None


def _context_length(meta: dict, key: str) -> int:
    length = _number(meta, key)
    problem = context_length_problem(length)
    if problem:
        raise GGUFError(f"metadata {key} = {problem}")
    return length


def _token_id(meta: dict, key: str, vocab: int) -> int | None:
    """Token id `key`, absent or one integer inside the tokenizer's `vocab` tokens (1.5 is not read as 1)."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"metadata {key} should be one integer token id, not {value!r:.60}")
    if not 0 <= value < vocab:
        raise GGUFError(f"metadata {key} = {value} is outside the tokenizer's {vocab} tokens")
    return value


def _llama3_scaling(factors: np.ndarray, *, theta: float, head_dim: int) -> dict:
    """Recover Llama 3 rope_scaling from the per-frequency divisors llama.cpp stores as rope_freqs.weight."""
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 8192  # every Llama 3.x release uses these three
    wavelength = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
    expected = np.where(
        wavelength < 8192 / 4.0,
        1.0,
        np.where(wavelength > 8192, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)),
    )
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3):
        raise GGUFError("rope_freqs.weight does not match Llama 3 rope scaling with the usual parameters")
    return scaling


def llama_config(meta: dict, stored: dict, vocab: int, *, arch: str, hf_class: str) -> dict:
    """config.json of a Llama-family file (`arch` the file's general.architecture)."""
    heads = _number(meta, f"{arch}.attention.head_count")
    hidden = _number(meta, f"{arch}.embedding_length")
    kv_heads = _number(meta, f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise GGUFError(f"head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    if f"{arch}.attention.key_length" not in meta and f"{arch}.rope.dimension_count" not in meta and hidden % heads:
        raise GGUFError(f"embedding_length {hidden} is not a multiple of head_count {heads} (and no key_length)")
    rotary_key = f"{arch}.rope.dimension_count"
    head_dim = _number(
        meta, f"{arch}.attention.key_length", _number(meta, rotary_key) if rotary_key in meta else hidden // heads
    )
    rotary_dim = _number(meta, rotary_key, head_dim)
    if rotary_dim != head_dim or head_dim % 2:
        raise GGUFError(f"rope.dimension_count {rotary_dim} with heads of {head_dim}: edgelm rotates whole, even heads")
    theta = _number(meta, f"{arch}.rope.freq_base", 10000.0, kind=float)
    # llama.cpp reads a factor without a type (or under its older key) as linear scaling: so does this
    factor_key = next((k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear") if k in meta), None)
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "linear" if factor_key else "none")
    rope_scaling = None
    if scaling_type == "linear":
        factor = _number(meta, factor_key or f"{arch}.rope.scaling.factor", kind=float)
        rope_scaling = {"rope_type": "linear", "factor": factor}
    elif scaling_type != "none":
        raise GGUFError(f"rope scaling {scaling_type!r:.60} is not supported ('linear' and Llama 3's are)")
    if "rope_freqs.weight" in stored:
        factors = np.asarray(dequantize(stored["rope_freqs.weight"].data, stored["rope_freqs.weight"].tensor_type))
        rope_scaling = _llama3_scaling(factors.reshape(-1), theta=theta, head_dim=head_dim)
    return {
        "architectures": [hf_class],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _number(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _number(meta, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _context_length(meta, f"{arch}.context_length"),
        "rms_norm_eps": _number(meta, f"{arch}.attention.layer_norm_rms_epsilon", kind=float, below=MAX_NORM_EPSILON),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in stored,
        "attention_bias": "blk.0.attn_q.bias" in stored,
        "hidden_act": "silu",
    }


def gpt2_config(meta: dict, stored: dict, vocab: int) -> dict:
    hidden, heads = _number(meta, "gpt2.embedding_length"), _number(meta, "gpt2.attention.head_count")
    if hidden % heads:
        raise GGUFError(f"embedding_length {hidden} is not a multiple of head_count {heads}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_embd": hidden,
        "n_inner": _number(meta, "gpt2.feed_forward_length"),
        "n_layer": _number(meta, "gpt2.block_count"),
        "n_head": heads,
        "n_positions": _context_length(meta, "gpt2.context_length"),
        "layer_norm_epsilon": _number(meta, "gpt2.attention.layer_norm_epsilon", kind=float, below=MAX_NORM_EPSILON),
        "tie_word_embeddings": "output.weight" not in stored,
    }


def gemma3_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a Gemma 3 file. llama.cpp's converter writes the window but no layer pattern, sliding-layer
    rotary base or attention scale: its loader fixes them (every 6th layer full, base 10000, head_dim ** -0.5 but
    for the 27B's 62 layers); keys that newer writers add for them are read when present."""
    config = llama_config(meta, stored, vocab, arch="gemma3", hf_class="Gemma3ForCausalLM")
    n_layer, head_dim = config["num_hidden_layers"], config["head_dim"]
    for key in ("gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"):
        if meta.get(key):
            raise GGUFError(f"metadata {key} is set: logit softcapping is not supported")
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if pattern is None:
        pattern = [(i + 1) % GEMMA3_FULL_EVERY != 0 for i in range(n_layer)]
    elif not isinstance(pattern, list) or len(pattern) != n_layer or not all(isinstance(p, bool) for p in pattern):
        raise GGUFError(f"metadata gemma3.attention.sliding_window_pattern should be {n_layer} booleans")
    scalar = config["hidden_size"] // config["num_attention_heads"] if n_layer == 62 else head_dim
    del config["hidden_act"]
    return config | {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
        "sliding_window": _number(meta, "gemma3.attention.sliding_window"),
        "rope_local_base_freq": _number(meta, "gemma3.rope.freq_base_swa", 10000.0, kind=float),
        "query_pre_attn_scalar": scalar,
    }


def gemma3_tensors(config: dict) -> dict[str, _Entry]:
    return llama_tensors(config, qk_norm=True, block=GEMMA3_BLOCK, norm_shift=-1.0)


def _with_head(entries: dict[str, _Entry], config: dict, vocab: int, hidden: int) -> dict[str, _Entry]:
    if not config["tie_word_embeddings"]:
        entries["lm_head.weight"] = _Entry("output.weight", (vocab, hidden))
    return entries


def gpt2_tensors(config: dict) -> dict[str, _Entry]:
    """HF name -> where and how it is stored, for every tensor of a GPT-2 file."""
    hidden, inner, vocab = config["n_embd"], config["n_inner"], config["vocab_size"]
    entries = {"transformer.wte.weight": _Entry("token_embd.weight", (vocab, hidden))}
    entries["transformer.wpe.weight"] = _Entry("position_embd.weight", (config["n_positions"], hidden))
    shapes = {"attn_qkv": (3 * hidden, hidden), "attn_output": (hidden, hidden)}
    shapes |= {"ffn_up": (inner, hidden), "ffn_down": (hidden, inner)}
    for layer in range(config["n_layer"]):
        for gguf_suffix, hf_suffix in GPT2_BLOCK.items():
            stem, kind = gguf_suffix.split(".")
            weight = shapes.get(stem, (hidden,))
            shape = weight if kind == "weight" else weight[:1]
            entries[f"transformer.h.{layer}.{hf_suffix}"] = _Entry(f"blk.{layer}.{gguf_suffix}", shape, len(shape) == 2)
    entries["transformer.ln_f.weight"] = _Entry("output_norm.weight", (hidden,))
    entries["transformer.ln_f.bias"] = _Entry("output_norm.bias", (hidden,))
    return _with_head(entries, config, vocab, hidden)


def llama_tensors(
    config: dict, *, permuted: bool = False, qk_norm: bool = False, block: dict = LLAMA_BLOCK, norm_shift: float = 0.0
) -> dict[str, _Entry]:
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
    entries = {"model.embed_tokens.weight": _Entry("token_embd.weight", (vocab, hidden))}
    for layer in range(config["num_hidden_layers"]):
        for gguf_suffix, hf_suffix in block.items():
            stem, kind = gguf_suffix.split(".")
            if (kind == "bias" and not config["attention_bias"]) or (stem in QK_NORMS and not qk_norm):
                continue
            weight = shapes.get(stem, (hidden,))
            shape = weight if kind == "weight" else weight[:1]
            shift = norm_shift if stem.endswith("norm") else 0.0
            entry = _Entry(f"blk.{layer}.{gguf_suffix}", shape, heads=rotary_heads.get(stem, 0), shift=shift)
            entries[f"model.layers.{layer}.{hf_suffix}"] = entry
    entries["model.norm.weight"] = _Entry("output_norm.weight", (hidden,), shift=norm_shift)
    return _with_head(entries, config, vocab, hidden)


def _one_line(path: Path, error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__  # a hostile name may hold newlines
    return f"{path.name}: {text[:300]}"


def read_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file of an architecture export/families.py names; GGUFError (one line) when it cannot be used."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        header = read_header(path)
    except (HeaderError, UnicodeDecodeError) as error:
        raise GGUFError(_one_line(path, error)) from None
    file = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))  # a plain view: np.memmap slices cost per call
    stored = {}
    for t in header.tensors:
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        rows = file[t.start : t.start + t.nbytes].reshape(-1, t.dims[0] // block * type_size)
        stored[t.name] = _Stored(t.tensor_type, t.dims, rows)
    try:
        return _build(path, stored, header.metadata)
    except GGUFError as error:
        raise GGUFError(_one_line(path, error)) from None


def _build(path: Path, stored: dict[str, _Stored], meta: dict) -> GGUFModel:
    from .families import gguf_family  # the families' rows name these readers

    arch = meta.get("general.architecture")
    family = gguf_family(arch)
    for name, t in stored.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise GGUFError(f"tensor {name} has type {t.tensor_type.name}, not supported")
    if "token_embd.weight" not in stored:
        raise GGUFError("tensor token_embd.weight is missing")
    vocab = int(stored["token_embd.weight"].shape[1])
    config = family.gguf_config(meta, stored, vocab)
    if config.get("num_hidden_layers", config.get("n_layer")) > len(stored):
        raise GGUFError(f"{len(stored)} tensors cannot hold the {meta[f'{arch}.block_count']} blocks it claims")
    entries = family.gguf_tensors(config)
    _check_tensors(stored, entries, arch)
    ids, tokenizer_json = _tokenizer(meta, vocab)
    bos, pad = ids["bos"], ids["padding"]
    eos_ids = list(dict.fromkeys(i for i in (ids["eos"], ids["eot"]) if i is not None))
    # GPT2Config keeps one EOS id, which a GGUF export does not use: the package's are the file's (eos_token_ids)
    one_eos = eos_ids[0] if eos_ids else None
    config |= {"bos_token_id": bos, "eos_token_id": one_eos if arch == "gpt2" or len(eos_ids) == 1 else eos_ids}
    chat_template = meta.get("tokenizer.chat_template")
    return GGUFModel(
        path=path,
        architecture=arch,
        hf_config=config,
        tokenizer_json=tokenizer_json,
        chat_template=chat_template if isinstance(chat_template, str) else None,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        tensor_names=list(entries),
        _entries=entries,
        _stored=stored,
    )


def _check_tensors(stored: dict[str, _Stored], entries: dict, arch: str) -> None:
    """Every tensor the family expects is there with its shape, and no other (but llama.cpp's rope_freqs)."""
    for hf_name, entry in entries.items():
        if entry.gguf_name not in stored:
            raise GGUFError(f"tensor {entry.gguf_name} ({hf_name}) is missing")
        shape = tuple(reversed(stored[entry.gguf_name].shape))
        if shape != entry.shape:
            raise GGUFError(f"tensor {entry.gguf_name} has shape {shape}, expected {entry.shape}")
    extra = set(stored) - {e.gguf_name for e in entries.values()} - {"rope_freqs.weight"}
    if extra:
        raise GGUFError(f"unexpected tensor {sorted(extra)[0]} for architecture {arch}")


def _tokenizer(meta: dict, vocab: int) -> tuple[dict[str, int | None], str]:
    """The special token ids (TOKEN_IDS -> id or None) and tokenizer.json built from the tokenizer metadata."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError("tokenizer.ggml.tokens is missing or not a list of tokens")
    if len(tokens) > vocab:  # fewer is normal: padding rows
        raise GGUFError(f"the tokenizer has {len(tokens)} tokens but token_embd.weight only {vocab} rows to embed them")
    ids = {name: _token_id(meta, f"tokenizer.ggml.{name}_token_id", len(tokens)) for name in TOKEN_IDS}
    try:
        tokenizer_json = build_tokenizer_json(meta)
    except Exception as error:  # `tokenizers` raises its own plain Exception on a bad vocabulary
        raise GGUFError(f"tokenizer: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    return ids, tokenizer_json
