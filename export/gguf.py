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

from .gguf_blocks import Runs, to_runs
from .gguf_header import HeaderError, read_header
from .gguf_tokenizer import build_tokenizer_json

Q = GGMLQuantizationType
SUPPORTED_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
# codebook types: read (dequantized by gguf-py), but no exact MatMulNBits form (export/gguf_blocks.py)
SUPPORTED_TYPES |= {kind for kind in Q if kind.name.startswith(("IQ", "TQ"))}
LLAMA_LIKE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

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
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
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


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """GGUF rows per head (hd/2, 2) interleaved -> HF (2, hd/2) halves; works on any trailing dimensions."""
    head_dim = rows.shape[0] // heads
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass
class GGUFModel:
    path: Path
    architecture: str  # general.architecture: "llama", "qwen2" or "gpt2"
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
        values, scales, offsets = (None if a is None else _unpermute_rows(a, entry.heads) for a in runs[2:])
        return runs._replace(values=values, scales=scales, offsets=offsets)


def _number(meta: dict, key: str, default: Any = None, *, kind: type = int) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise GGUFError(f"metadata {key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise GGUFError(f"metadata {key} should be a single {kind.__name__}, not {value!r:.60}")
    if kind is int and not 0 < value < 1 << 31:
        raise GGUFError(f"metadata {key} = {value} is out of range")
    return float(str(np.float32(value))) if kind is float else int(value)  # f32 1e-5 -> 1e-05, not 9.99e-06


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


def _llama_config(meta: dict, arch: str, stored: dict, vocab: int) -> dict:
    heads = _number(meta, f"{arch}.attention.head_count")
    hidden = _number(meta, f"{arch}.embedding_length")
    head_dim = _number(meta, f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    theta = _number(meta, f"{arch}.rope.freq_base", 10000.0, kind=float)
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _number(meta, f"{arch}.rope.scaling.factor", kind=float)}
    elif scaling_type != "none":
        raise GGUFError(f"rope scaling {scaling_type!r} is not supported ('linear' and Llama 3's are)")
    if "rope_freqs.weight" in stored:
        factors = np.asarray(dequantize(stored["rope_freqs.weight"].data, stored["rope_freqs.weight"].tensor_type))
        rope_scaling = _llama3_scaling(factors.reshape(-1), theta=theta, head_dim=head_dim)
    return {
        "architectures": [LLAMA_LIKE[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _number(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _number(meta, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _number(meta, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": _number(meta, f"{arch}.context_length"),
        "rms_norm_eps": _number(meta, f"{arch}.attention.layer_norm_rms_epsilon", kind=float),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in stored,
        "attention_bias": "blk.0.attn_q.bias" in stored,
        "hidden_act": "silu",
    }


def _gpt2_config(meta: dict, stored: dict, vocab: int) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_embd": _number(meta, "gpt2.embedding_length"),
        "n_inner": _number(meta, "gpt2.feed_forward_length"),
        "n_layer": _number(meta, "gpt2.block_count"),
        "n_head": _number(meta, "gpt2.attention.head_count"),
        "n_positions": _number(meta, "gpt2.context_length"),
        "layer_norm_epsilon": _number(meta, "gpt2.attention.layer_norm_epsilon", kind=float),
        "tie_word_embeddings": "output.weight" not in stored,
    }


def _tensor_map(config: dict) -> dict[str, _Entry]:
    """HF name -> where and how it is stored, for every tensor the config implies."""
    if config["model_type"] == "gpt2":
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
                entries[f"transformer.h.{layer}.{hf_suffix}"] = _Entry(
                    f"blk.{layer}.{gguf_suffix}", shape, len(shape) == 2
                )
        entries["transformer.ln_f.weight"] = _Entry("output_norm.weight", (hidden,))
        entries["transformer.ln_f.bias"] = _Entry("output_norm.bias", (hidden,))
    else:
        hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
        heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        permute = config["model_type"] == "llama"
        shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden)}
        shapes |= {"attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim)}
        shapes |= {"ffn_gate": (inner, hidden), "ffn_up": (inner, hidden), "ffn_down": (hidden, inner)}
        rotary_heads = {"attn_q": heads, "attn_k": kv_heads} if permute else {}
        entries = {"model.embed_tokens.weight": _Entry("token_embd.weight", (vocab, hidden))}
        for layer in range(config["num_hidden_layers"]):
            for gguf_suffix, hf_suffix in LLAMA_BLOCK.items():
                stem, kind = gguf_suffix.split(".")
                if kind == "bias" and not config["attention_bias"]:
                    continue
                weight = shapes.get(stem, (hidden,))
                shape = weight if kind == "weight" else weight[:1]
                entry = _Entry(f"blk.{layer}.{gguf_suffix}", shape, heads=rotary_heads.get(stem, 0))
                entries[f"model.layers.{layer}.{hf_suffix}"] = entry
        entries["model.norm.weight"] = _Entry("output_norm.weight", (hidden,))
    if not config["tie_word_embeddings"]:
        entries["lm_head.weight"] = _Entry("output.weight", (vocab, hidden))
    return entries


def _one_line(path: Path, error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__  # a hostile name may hold newlines
    return f"{path.name}: {text[:300]}"


def read_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file of architecture llama, qwen2 or gpt2; GGUFError (one line) when it cannot be used."""
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
    arch = meta.get("general.architecture")
    if arch not in (*LLAMA_LIKE, "gpt2"):
        raise GGUFError(f"architecture {arch!r:.60} is not supported (llama, qwen2, gpt2 are)")
    for name, t in stored.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise GGUFError(f"tensor {name} has type {t.tensor_type.name}, not supported")
    if "token_embd.weight" not in stored:
        raise GGUFError("tensor token_embd.weight is missing")
    vocab = int(stored["token_embd.weight"].shape[1])
    config = _gpt2_config(meta, stored, vocab) if arch == "gpt2" else _llama_config(meta, arch, stored, vocab)
    if config.get("num_hidden_layers", config.get("n_layer")) > len(stored):
        raise GGUFError(f"{len(stored)} tensors cannot hold the {meta[f'{arch}.block_count']} blocks it claims")
    entries = _tensor_map(config)
    for hf_name, entry in entries.items():
        if entry.gguf_name not in stored:
            raise GGUFError(f"tensor {entry.gguf_name} ({hf_name}) is missing")
        shape = tuple(reversed(stored[entry.gguf_name].shape))
        if shape != entry.shape:
            raise GGUFError(f"tensor {entry.gguf_name} has shape {shape}, expected {entry.shape}")
    extra = set(stored) - {e.gguf_name for e in entries.values()} - {"rope_freqs.weight"}
    if extra:
        raise GGUFError(f"unexpected tensor {sorted(extra)[0]} for architecture {arch}")
    try:
        tokenizer_json = build_tokenizer_json(meta)
    except Exception as error:  # `tokenizers` raises its own plain Exception on a bad vocabulary
        raise GGUFError(f"tokenizer: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    bos, pad = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.padding_token_id")
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    eos_ids = list(dict.fromkeys(int(i) for i in eos_ids))
    config |= {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
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
