"""The tiny transformers models every family row is tested on (tests/export/test_families.py), shared by the test
files that need a family's folder, GGUF file or package (tests/export/test_llama_export.py,
tests/export/test_qwen3_gemma3.py):
each made once per session, when first asked for.

A case is a random transformers model of one row's model_type, saved with save_pretrained; where the row reads
GGUF files, the same weights as llama.cpp's converter writes them (its names, Llama's permuted Q/K rows,
GPT-2's Conv1D weights as (out, in), Gemma's norms as 1 + w, a tied head left out)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_greedy, quiet, save_random_model

NEW_TOKENS = 32
EOS = 0
WINDOW = 3  # Gemma 3's sliding window: shorter than every prompt, so the local mask and rotary both count
# hidden 96 over 6 query heads and 2 KV heads: head_dim 16, GQA ratio 3
SMALL = dict(
    vocab_size=2048, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
    intermediate_size=128, max_position_embeddings=128, rope_theta=1e5, rms_norm_eps=1e-5,
    bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS,
    initializer_range=0.15,  # the usual 0.02 gives near-uniform logits and a greedy run of one token
)  # fmt: skip
GPT2 = dict(vocab_size=2048, n_embd=96, n_head=6, n_layer=2, n_positions=128, bos_token_id=EOS, eos_token_id=EOS,
            pad_token_id=EOS, initializer_range=0.15)  # fmt: skip
LFM2 = dict(
    vocab_size=2048, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
    intermediate_size=128, max_position_embeddings=128, layer_types=["conv", "full_attention"] * 2,
    bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS, initializer_range=0.15,
)  # fmt: skip
# 2 key heads shared by 4 value heads, key and value head sizes apart (a swapped axis shows); attention heads of 64,
# a quarter rotated: 16, the least GroupQueryAttention's partial rotary takes
QWEN35 = dict(
    vocab_size=2048, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
    intermediate_size=128, max_position_embeddings=128, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2,
    bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS, initializer_range=0.15,
)  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
PHI3 = SMALL | dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, sliding_window=None,
    rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.05 * i for i in range(12)], "long_factor": [1.0 + 0.5 * i for i in range(12)],
    },
)  # fmt: skip
# Gemma 4: sliding layers of head 16, full layers of head 32 with a quarter of their pairs rotated (proportional),
# a window of 3; per-layer input embeddings of 16 per layer (6 x 16 = 96 a token: whole Q8_0 blocks)
GEMMA4 = SMALL | dict(
    num_hidden_layers=6, head_dim=16, global_head_dim=32, num_key_value_heads=2, sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=2048, final_logit_softcapping=30.0, initializer_range=0.05,
    rope_parameters={
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)  # fmt: skip
PROMPTS = [  # three lengths: the padded batch
    [5, 99, 1200, 7, 640, 33, 1800, 412, 77],
    [300, 12, 2001, 5],
    [9, 8, 1500, 600, 44, 1024, 3, 17, 250, 21, 90],
]


@dataclass(frozen=True)
class Case:
    model_type: str  # the family row it exercises (export/families/ FAMILIES)
    classes: tuple[str, str]  # transformers' config and model classes
    config: dict
    gguf: bool = False  # also exported from a GGUF file of the same weights
    image_text_of: str | None = None  # Gemma 3's image-and-text folder holding this case's text model
    graphs: tuple[str, ...] = ("fused", "standard")  # the graphs its row builds
    # what the feature suites run it for (cases_with): "lora" (tests/export/test_lora_families.py adapts it),
    # "hybrid-state" (convolution or recurrent states beside attention), "kv-sharing" (layers reading another's
    # cache), "per-layer-inputs" (Gemma 4's per-layer input embeddings)
    tags: frozenset[str] = frozenset()


CASES = {
    "gpt2": Case("gpt2", ("GPT2Config", "GPT2LMHeadModel"), GPT2, gguf=True),
    # llama3 scaling with original context 32, not Llama 3's usual 8192: its GGUF holds the scaling as llama.cpp's
    # converter writes it, rope_freqs.weight (more Llama GGUF files: tests/export/test_gguf_export.py)
    "llama-llama3-tied": Case("llama", ("LlamaConfig", "LlamaForCausalLM"), SMALL | dict(rope_scaling=LLAMA3,
                              tie_word_embeddings=True), gguf=True),  # fmt: skip
    "qwen2-biases-untied": Case("qwen2", ("Qwen2Config", "Qwen2ForCausalLM"), SMALL | dict(tie_word_embeddings=False),
                                gguf=True),  # fmt: skip
    "mistral-untied": Case("mistral", ("MistralConfig", "MistralForCausalLM"), SMALL | dict(tie_word_embeddings=False,
                           sliding_window=None)),  # fmt: skip
    # head_dim 32 is not hidden / heads (16)
    "qwen3": Case("qwen3", ("Qwen3Config", "Qwen3ForCausalLM"), SMALL | dict(head_dim=32, tie_word_embeddings=True),
                  gguf=True),  # fmt: skip
    # llama.cpp's Gemma 3 layout: layers 0-4 sliding (local rotary base 10000), layer 5 full, with rope_theta
    # and linear scaling (as the 1B's full layers), query_pre_attn_scalar = head_dim (what llama.cpp assumes)
    "gemma3_text": Case(
        "gemma3_text",
        ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        SMALL | dict(
            head_dim=32, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=32,
            initializer_range=0.05,  # with the sqrt(hidden) embedding scale, 0.15 gives a greedy run of one token
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        gguf=True,
    ),
    # four layers: the fourth takes no positions (NoPE), as llama.cpp's fixed interval says
    "smollm3": Case("smollm3", ("SmolLM3Config", "SmolLM3ForCausalLM"), SMALL | dict(num_hidden_layers=4,
                    tie_word_embeddings=True), gguf=True, tags=frozenset({"lora"})),  # fmt: skip
    # multipliers away from 1 (Granite 3's own values but the attention scale, which is head_dim ** -0.5 there)
    "granite": Case("granite", ("GraniteConfig", "GraniteForCausalLM"), SMALL | dict(tie_word_embeddings=False,
                    embedding_multiplier=12.0, attention_multiplier=0.2, residual_multiplier=0.22,
                    logits_scaling=2.5, initializer_range=0.05), gguf=True, tags=frozenset({"lora"})),  # fmt: skip
    # the dense Granite 4.0's layout: attention layers only, no experts, the MLP as shared_mlp
    "granitemoehybrid": Case(
        "granitemoehybrid",
        ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
        SMALL | dict(
            tie_word_embeddings=False, embedding_multiplier=12.0, attention_multiplier=0.2, residual_multiplier=0.22,
            logits_scaling=2.5, layer_types=["attention"] * 2, num_local_experts=0, num_experts_per_tok=0,
            shared_intermediate_size=128, position_embedding_type="rope", mamba_n_heads=2,
        ),
    ),
    # Phi-4-mini's parts: packed qkv_proj and gate_up_proj, rotary on 3/4 of each head, LongRoPE: an original
    # context of 64 (every test sequence within it: the short factors) or of 3 (every one past it: the long ones);
    # tests/export/test_phi3.py goes past it while generating
    "phi3-longrope-short": Case("phi3", ("Phi3Config", "Phi3ForCausalLM"), PHI3 | dict(
                                original_max_position_embeddings=64), gguf=True, tags=frozenset({"lora"})),  # fmt: skip
    "phi3-longrope-long": Case("phi3", ("Phi3Config", "Phi3ForCausalLM"), PHI3 | dict(
                               original_max_position_embeddings=3), gguf=True),  # fmt: skip
    # model_type gemma3: config.json's text_config and the weights under model.language_model (transformers 5's
    # names for Gemma3ForConditionalGeneration), a vision tower beside them left out
    "gemma3": Case("gemma3", ("Gemma3TextConfig", "Gemma3ForCausalLM"), {}, image_text_of="gemma3_text"),
    # Gemma 4 with its last 2 layers reading layers 3 (sliding) and 2 (full)'s caches, their MLPs double-wide
    "gemma4_text-shared": Case("gemma4_text", ("Gemma4TextConfig", "Gemma4ForCausalLM"), GEMMA4 | dict(
                               num_kv_shared_layers=2, use_double_wide_mlp=True, tie_word_embeddings=True), gguf=True,
                               tags=frozenset({"lora", "kv-sharing", "per-layer-inputs"})),
    # no sharing; full layers taking V from K's projection (attention_k_eq_v) with 1 KV head of their own; untied
    "gemma4_text-k-eq-v": Case("gemma4_text", ("Gemma4TextConfig", "Gemma4ForCausalLM"), GEMMA4 | dict(
                               attention_k_eq_v=True, num_global_key_value_heads=1, tie_word_embeddings=False),
                               gguf=True, tags=frozenset({"per-layer-inputs"})),
    # model_type gemma4: the text model under model.language_model, a vision tower beside it left out
    "gemma4": Case("gemma4", ("Gemma4TextConfig", "Gemma4ForCausalLM"), {}, image_text_of="gemma4_text-shared"),
    # short convolutions (kernel 3: a state of 2 columns) and attention layers
    "lfm2": Case("lfm2", ("Lfm2Config", "Lfm2ForCausalLM"), LFM2, gguf=True, tags=frozenset({"lora", "hybrid-state"})),
    # Gated DeltaNet (conv kernel 4, a recurrent state) and gated attention with partial rotary
    "qwen3_5_text": Case("qwen3_5_text", ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"), QWEN35, gguf=True,
                         tags=frozenset({"lora", "hybrid-state"})),
}  # fmt: skip

# The cases a quick run (pytest -m "not slow") exports in the every-case suites: GPT-2's parts, a Llama-family row
# (per-head norms, its own head size) and a hybrid (a convolution state beside attention); every case runs in the full
# suite.
QUICK = frozenset({"gpt2", "qwen3", "lfm2"})


def cases_with(*tags: str) -> list[str]:
    """The names of the cases that have every one of `tags`, sorted."""
    return sorted(name for name, case in CASES.items() if set(tags) <= case.tags)


def quick_or_slow(case: str, *rest) -> object:
    """pytest.param(case, *rest), marked slow unless the case is one of QUICK."""
    return pytest.param(case, *rest, marks=() if case in QUICK else pytest.mark.slow)


@dataclass
class Families:
    """Each case's transformers model and folder, GGUF file, packages and greedy tokens, made when first asked."""

    root: Path
    _models: dict = field(default_factory=dict)
    _packages: dict = field(default_factory=dict)
    _expected: dict = field(default_factory=dict)

    def model(self, case: str) -> tuple[torch.nn.Module, Path]:
        """(the transformers model, its folder)."""
        if case not in self._models:
            spec = CASES[case]
            if spec.image_text_of:
                hf, text_folder = self.model(spec.image_text_of)
                outer = CASES[spec.image_text_of].model_type.removesuffix("_text")
                self._models[case] = (hf, write_image_text_folder(text_folder, self.root / case, outer))
            else:
                # a deep copy: transformers writes into a config's rope_parameters, which cases may share
                config = copy.deepcopy(spec.config)
                self._models[case] = (save_random_model(self.root / case, spec.classes, config), self.root / case)
        return self._models[case]

    def gguf(self, case: str) -> Path:
        path = self.root / f"{case}.gguf"
        if not path.exists():
            write_gguf(self.model(case)[0], path)
        return path

    def package(self, case: str, source: str) -> Path:
        """The package of `source`: "fused" or "standard" (from the folder) or "gguf" (the fused graph)."""
        from edgelm.export.onnx_export import export_package

        if (case, source) not in self._packages:
            out = self.root / f"{case}-{source}"
            if source == "gguf":
                export_package(self.gguf(case), out, progress=quiet)
            else:
                export_package(self.model(case)[1], out, attention=source, progress=quiet)
            self._packages[case, source] = out
        return self._packages[case, source]

    def expected(self, case: str) -> list[list[int]]:
        """transformers' greedy tokens for each prompt."""
        if case not in self._expected:
            hf = self.model(case)[0]
            self._expected[case] = [hf_greedy(hf, p, NEW_TOKENS, pad_token_id=EOS) for p in PROMPTS]
        return self._expected[case]


def write_image_text_folder(text_folder: Path, folder: Path, model_type: str = "gemma3") -> Path:
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    text = json.loads((text_folder / "config.json").read_text())
    outer = {"model_type": model_type, "text_config": text, "eos_token_id": EOS}
    (folder / "config.json").write_text(json.dumps(outer | {"tie_word_embeddings": text["tie_word_embeddings"]}))
    state = {
        "model.language_model." + k.removeprefix("model."): v
        for k, v in load_file(text_folder / "model.safetensors").items()
    }
    state["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    save_file(state, folder / "model.safetensors")
    (folder / "tokenizer.json").write_bytes((text_folder / "tokenizer.json").read_bytes())
    return folder


# HF name in a layer -> llama.cpp's
LLAMA_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GEMMA_NAMES = LLAMA_NAMES | {  # Gemma's norms around attention and the MLP
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
GEMMA4_NAMES = GEMMA_NAMES | {  # and its per-layer inputs and output scale
    "per_layer_input_gate.weight": "inp_gate.weight", "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight", "layer_scalar": "layer_output_scale.weight",
}  # fmt: skip
PHI3_NAMES = LLAMA_NAMES | {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
GPT2_NAMES = {
    "ln_1.weight": "attn_norm.weight", "ln_1.bias": "attn_norm.bias", "attn.c_attn.weight": "attn_qkv.weight",
    "attn.c_attn.bias": "attn_qkv.bias", "attn.c_proj.weight": "attn_output.weight",
    "attn.c_proj.bias": "attn_output.bias", "ln_2.weight": "ffn_norm.weight", "ln_2.bias": "ffn_norm.bias",
    "mlp.c_fc.weight": "ffn_up.weight", "mlp.c_fc.bias": "ffn_up.bias", "mlp.c_proj.weight": "ffn_down.weight",
    "mlp.c_proj.bias": "ffn_down.bias",
}  # fmt: skip
LFM2_NAMES = {  # llama.cpp's LFM2 names (gguf-py's tensor map)
    "operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight", "conv.conv.weight": "shortconv.conv.weight",
    "conv.in_proj.weight": "shortconv.in_proj.weight", "conv.out_proj.weight": "shortconv.out_proj.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight", "self_attn.k_layernorm.weight": "attn_k_norm.weight",
}  # fmt: skip
QWEN35_NAMES = {  # llama.cpp's qwen35 names
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}  # fmt: skip
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight", "model.embedding_norm.weight": "token_embd_norm.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}  # fmt: skip


PERMUTED = ("llama", "smollm3", "granite")  # architectures whose converter (Llama's) permutes the Q/K rows


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for rotary rows: each head's (2, hd/2) halves become (hd/2, 2) pairs."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _gguf_name(name: str, names: dict) -> str:
    for prefix in ("model.layers.", "transformer.h."):
        if name.startswith(prefix):
            layer, rest = name.removeprefix(prefix).split(".", 1)
            return f"blk.{layer}.{names[rest]}"
    return GLOBAL_NAMES[name]


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it from a llama3 rope scaling (convert_hf_to_gguf.py,
    LlamaModel.generate_extra_tensors): each frequency's divisor."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_metadata(writer, c, arch: str) -> None:
    """What llama.cpp's converter writes for a Llama-family model (the window but no layer pattern or local
    rotary base for Gemma 3)."""
    writer.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    writer.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    writer.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    rope = c.rope_parameters["full_attention"] if arch == "gemma3" else c.rope_parameters
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    if arch == "granite":  # what llama.cpp's GraniteModel converter adds
        writer.add_float32("granite.attention.scale", c.attention_multiplier)
        writer.add_float32("granite.embedding_scale", c.embedding_multiplier)
        writer.add_float32("granite.residual_scale", c.residual_multiplier)
        writer.add_float32("granite.logit_scale", c.logits_scaling)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)


def _write_phi3_extras(writer, c) -> None:
    """What llama.cpp's Phi3MiniModel converter adds: the rotary width, the original context, LongRoPE's attention
    factor (from max / original) and its factors as tensors."""
    import math

    rope, original = c.rope_parameters, c.original_max_position_embeddings
    writer.add_uint32(
        "phi3.rope.dimension_count", int(rope["partial_rotary_factor"] * c.hidden_size) // c.num_attention_heads
    )
    writer.add_uint32("phi3.rope.scaling.original_context_length", original)
    writer.add_uint32("phi3.attention.sliding_window", 0)
    scale = c.max_position_embeddings / original
    writer.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(original)))
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _write_gpt2_metadata(writer, c) -> None:
    writer.add_uint32("gpt2.context_length", c.n_positions)
    writer.add_uint32("gpt2.embedding_length", c.n_embd)
    writer.add_uint32("gpt2.feed_forward_length", c.n_inner or 4 * c.n_embd)
    writer.add_uint32("gpt2.block_count", c.n_layer)
    writer.add_uint32("gpt2.attention.head_count", c.n_head)
    writer.add_float32("gpt2.attention.layer_norm_epsilon", c.layer_norm_epsilon)


def _write_lfm2_metadata(writer, c) -> None:
    """What conversion/lfm2.py writes: head_count_kv per layer (0 for a convolution layer), the MLP width after
    block_auto_adjust_ff_dim, shortconv.l_cache."""
    from edgelm.export.families.lfm2 import intermediate_size

    writer.add_uint32("lfm2.context_length", c.max_position_embeddings)
    writer.add_uint32("lfm2.embedding_length", c.hidden_size)
    writer.add_uint32("lfm2.feed_forward_length", intermediate_size(c.to_dict()))
    writer.add_uint32("lfm2.block_count", c.num_hidden_layers)
    writer.add_uint32("lfm2.attention.head_count", c.num_attention_heads)
    writer.add_array(
        "lfm2.attention.head_count_kv", [c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types]
    )
    writer.add_float32("lfm2.rope.freq_base", c.rope_parameters["rope_theta"])
    writer.add_uint32("lfm2.vocab_size", c.vocab_size)
    writer.add_uint32("lfm2.shortconv.l_cache", c.conv_L_cache)
    writer.add_float32("lfm2.attention.layer_norm_rms_epsilon", c.norm_eps)


def _write_gemma4_metadata(writer, c) -> None:
    """What conversion/gemma.py's Gemma4Model writes: per-layer KV heads and MLP widths where layers differ, both
    head sizes, the layer pattern, the shared layers, the per-layer input width, and rope_freqs.weight (1 for a
    rotated pair of the full layers, 1e30 for the others)."""
    values = c.to_dict()  # transformers refuses c.num_key_value_heads where full layers have their own
    types, n_layer, shared = values["layer_types"], values["num_hidden_layers"], values["num_kv_shared_layers"]
    full_head = next(v["head_dim"] for v in values["per_layer_config"].values())
    full_kv = next(
        v.get("num_key_value_heads", values["num_key_value_heads"]) for v in values["per_layer_config"].values()
    )
    inner = values["intermediate_size"]
    writer.add_uint32("gemma4.context_length", values["max_position_embeddings"])
    writer.add_uint32("gemma4.embedding_length", values["hidden_size"])
    wide = [inner * (2 if values["use_double_wide_mlp"] and i >= n_layer - shared else 1) for i in range(n_layer)]
    writer.add_array("gemma4.feed_forward_length", wide) if len(set(wide)) > 1 else writer.add_uint32(
        "gemma4.feed_forward_length", inner
    )
    writer.add_uint32("gemma4.block_count", n_layer)
    writer.add_uint32("gemma4.attention.head_count", values["num_attention_heads"])
    kv = [values["num_key_value_heads"] if t == "sliding_attention" else full_kv for t in types]
    writer.add_array("gemma4.attention.head_count_kv", kv) if len(set(kv)) > 1 else writer.add_uint32(
        "gemma4.attention.head_count_kv", kv[0]
    )
    for key, size in (("attention.key_length", full_head), ("attention.value_length", full_head),
                      ("attention.key_length_swa", values["head_dim"]),
                      ("attention.value_length_swa", values["head_dim"]), ("rope.dimension_count", full_head),
                      ("rope.dimension_count_swa", values["head_dim"])):  # fmt: skip
        writer.add_uint32(f"gemma4.{key}", size)
    rope = values["rope_parameters"]
    writer.add_float32("gemma4.rope.freq_base", rope["full_attention"]["rope_theta"])
    writer.add_float32("gemma4.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    writer.add_float32("gemma4.attention.layer_norm_rms_epsilon", values["rms_norm_eps"])
    writer.add_float32("gemma4.final_logit_softcapping", values["final_logit_softcapping"])
    writer.add_uint32("gemma4.attention.sliding_window", values["sliding_window"])
    writer.add_uint32("gemma4.attention.shared_kv_layers", shared)
    writer.add_uint32("gemma4.embedding_length_per_layer_input", values["hidden_size_per_layer_input"])
    writer.add_array("gemma4.attention.sliding_window_pattern", [t == "sliding_attention" for t in types])
    rotated = int(full_head * rope["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * rotated + [1e30] * (full_head // 2 - rotated)
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


def _write_qwen35_metadata(writer, c) -> None:
    """What conversion/qwen.py's Qwen3_5TextModel writes (no MTP block here)."""
    writer.add_uint32("qwen35.context_length", c.max_position_embeddings)
    writer.add_uint32("qwen35.embedding_length", c.hidden_size)
    writer.add_uint32("qwen35.feed_forward_length", c.intermediate_size)
    writer.add_uint32("qwen35.block_count", c.num_hidden_layers)
    writer.add_uint32("qwen35.attention.head_count", c.num_attention_heads)
    writer.add_uint32("qwen35.attention.head_count_kv", c.num_key_value_heads)
    writer.add_uint32("qwen35.attention.key_length", c.head_dim)
    writer.add_uint32("qwen35.attention.value_length", c.head_dim)
    writer.add_float32("qwen35.rope.freq_base", c.rope_parameters["rope_theta"])
    writer.add_float32("qwen35.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_uint32("qwen35.ssm.conv_kernel", c.linear_conv_kernel_dim)
    writer.add_uint32("qwen35.ssm.state_size", c.linear_key_head_dim)
    writer.add_uint32("qwen35.ssm.group_count", c.linear_num_key_heads)
    writer.add_uint32("qwen35.ssm.time_step_rank", c.linear_num_value_heads)
    writer.add_uint32("qwen35.ssm.inner_size", c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_array("qwen35.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types])
    writer.add_uint32("qwen35.full_attention_interval", 4)
    writer.add_uint32("qwen35.rope.dimension_count", int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    writer.add_array("qwen35.rope.dimension_sections", [11, 11, 10, 0])


def _qwen35_tensor(name: str, weight: np.ndarray, c) -> np.ndarray:
    """What conversion/qwen.py does to a Qwen3.5 tensor: the value heads from grouped by key head to tiled
    (_LinearAttentionVReorderBase), then A_log as -exp(A_log), the kernel squeezed, the norms but the gated one
    as 1 + w (Qwen3NextModel)."""
    k_heads, v_heads = c.linear_num_key_heads, c.linear_num_value_heads
    key, v_dim = 2 * k_heads * c.linear_key_head_dim, c.linear_value_head_dim

    def tiled(rows: np.ndarray, width: int) -> np.ndarray:  # _reorder_v_heads along the rows
        grouped = rows.reshape(k_heads, v_heads // k_heads, width, *rows.shape[1:])
        return grouped.swapaxes(0, 1).reshape(rows.shape)

    if name.endswith("conv1d.weight"):
        weight = weight.squeeze(1)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        weight = np.concatenate([weight[:key], tiled(weight[key:], v_dim)])
    elif name.endswith("in_proj_z.weight"):
        weight = tiled(weight, v_dim)
    elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        weight = tiled(weight, 1)
    elif name.endswith("out_proj.weight") and "linear_attn" in name:
        weight = tiled(weight.T, v_dim).T
    if name.endswith("A_log"):
        weight = -np.exp(weight)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        weight = weight + np.float32(1.0)
    return weight


def write_gguf(hf: torch.nn.Module, path: Path) -> Path:
    """The transformers model as llama.cpp's converter writes it (f32 tensors, its metadata keys)."""
    import gguf
    from test_gguf import _add_tokenizer  # pytest puts tests/ on the path

    c = hf.config
    arch = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "qwen3_5_text": "qwen35"}.get(c.model_type, c.model_type)
    names = {"gemma3": GEMMA_NAMES, "gemma4": GEMMA4_NAMES, "gpt2": GPT2_NAMES, "phi3": PHI3_NAMES, "lfm2": LFM2_NAMES,
             "qwen35": QWEN35_NAMES}.get(arch, LLAMA_NAMES)  # fmt: skip
    writer = gguf.GGUFWriter(path, arch)
    metadata = {"gpt2": _write_gpt2_metadata, "lfm2": _write_lfm2_metadata, "qwen35": _write_qwen35_metadata,
                "gemma4": _write_gemma4_metadata}  # fmt: skip
    metadata[arch](writer, c) if arch in metadata else _write_metadata(writer, c, arch)
    if arch == "phi3":
        _write_phi3_extras(writer, c)
    for name, tensor in hf.state_dict().items():
        tied_head = name == "lm_head.weight" and c.tie_word_embeddings
        mask_buffer = name.endswith(("attn.bias", "attn.masked_bias")) and not name.endswith("c_attn.bias")
        if tied_head or mask_buffer:
            continue
        weight = tensor.float().numpy()
        if arch == "gpt2" and weight.ndim == 2 and ".h." in name:
            weight = weight.T  # Conv1D (in, out), stored (out, in)
        if arch == "lfm2" and name.endswith("conv.conv.weight"):
            weight = weight.squeeze(1)  # "conv op requires 2d tensor"
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _permute(weight, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if arch == "qwen35":
            weight = _qwen35_tensor(name, weight, c)
        shift = 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        writer.add_tensor(_gguf_name(name, names), np.ascontiguousarray(weight) + np.float32(shift))
    rope = getattr(c, "rope_parameters", None) or {}
    if arch == "gemma4":
        pass  # its rope_freqs.weight was written with the metadata
    elif rope.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight",
            llama3_rope_factors(rope, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads),
        )
    _add_tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
