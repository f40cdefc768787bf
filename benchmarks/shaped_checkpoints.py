"""Hugging Face folders of real models' shapes with random weights, for measuring export and runtime at real
sizes (issue 34): speed and memory do not depend on the values.

    python benchmarks/shaped_checkpoints.py qwen3-0.6b /work/big-scratch/q06-bf16 --dtype bfloat16
    python benchmarks/shaped_checkpoints.py qwen3-4b /work/big-scratch/q4b-bf16 --shard-gb 2
    python benchmarks/shaped_checkpoints.py llama-3.1-8b /work/big-scratch/l8b-bf16 --shard-gb 2

The config is transformers' own (`config_class(**SHAPES[name]).save_pretrained`), the tensor names and shapes
those of the transformers model built on the meta device, and the weights are written shard by shard in
`save_pretrained`'s layout (model.safetensors, or model-0000N-of-0000M.safetensors and
model.safetensors.index.json), so a 4B folder is made in the memory of one shard, not of the whole model. Linear
and embedding weights are N(0, 0.02), norm weights 1 (transformers' own init). The tokenizer is the real one,
read from llama.cpp's vocabulary GGUF files (`AutoTokenizer.from_pretrained(..., gguf_file=...)`), so
llama.cpp's converter recognizes it and makes GGUF files of the folder:

    PYTHONPATH=$LLAMA_CPP/gguf-py python $LLAMA_CPP/convert_hf_to_gguf.py FOLDER --outtype f16 --outfile X.gguf
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

# a llama.cpp tree holding models/ggml-vocab-*.gguf: $LLAMA_CPP, else what benchmarks/peers/setup_llamacpp.sh extracts
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP", Path(__file__).resolve().parent / ".llamacpp" / "llama.cpp"))
SHAPES = {
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643,
        eos_token_id=151645,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000,
        eos_token_id=128009,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000,
        eos_token_id=128009,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "qwen3-4b": dict(
        model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen3.5-0.8b": dict(  # Gated DeltaNet x3 + gated attention, repeated
        model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, intermediate_size=3584, vocab_size=248320, tie_word_embeddings=True,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        max_position_embeddings=262144, rms_norm_eps=1e-6, bos_token_id=248044, eos_token_id=248046,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
    ),
    "lfm2-1.2b": dict(  # short convolutions, attention at 6 of 16 layers; FFN 12288 auto-adjusted to 8192
        model_type="lfm2", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=12288, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
        vocab_size=65536, tie_word_embeddings=True, max_position_embeddings=128000, norm_eps=1e-5,
        layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), bos_token_id=1, eos_token_id=7,
        pad_token_id=0,
    ),
    "phi-4-mini": dict(  # 3.8B, LongRoPE (the factors: stand-ins of the real length, 48 = 128 x 0.75 / 2)
        model_type="phi3", hidden_size=3072, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=200064, tie_word_embeddings=True, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=199999, eos_token_id=199999,
        pad_token_id=199999, sliding_window=None,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
            short_factor=[1.0] * 48, long_factor=[1.0 + 0.6 * i for i in range(48)],
        ),
    ),
    "gemma-4-e2b": dict(  # per-layer embeddings, the last 20 layers reuse earlier layers' keys and values
        model_type="gemma4_text", hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, global_head_dim=512, intermediate_size=6144, use_double_wide_mlp=True, num_kv_shared_layers=20,
        hidden_size_per_layer_input=256, vocab_size=262144, vocab_size_per_layer_input=262144,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, sliding_window=512,
        final_logit_softcapping=30.0, max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-6,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
    "qwen3-tiny": dict(  # the same code path in seconds
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643,
        eos_token_id=151645,
    ),
}  # fmt: skip
# the tokenizer of each model type from llama.cpp's vocabulary files; LFM2's and Phi-4-mini's own (a 65k BPE, OpenAI's
# o200k) are not among them, so GPT-2's and Qwen2's byte-level BPEs stand in: the vocabulary's size (the embedding,
# the head) is the real one, ids past the tokenizer's are padding tokens in llama.cpp's converter
VOCABS = {
    "qwen3": "ggml-vocab-qwen2.gguf", "llama": "ggml-vocab-llama-bpe.gguf", "qwen3_5_text": "ggml-vocab-qwen35.gguf",
    "lfm2": "ggml-vocab-gpt-2.gguf", "phi3": "ggml-vocab-qwen2.gguf", "gemma4_text": "ggml-vocab-gemma-4.gguf",
}  # fmt: skip
# llama.cpp's Phi-3 converter reads a byte-level BPE only when tokenizer_config.json names GPT2Tokenizer
TOKENIZER_CLASSES = {"phi3": "GPT2Tokenizer"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def meta_state(shape: dict) -> dict[str, torch.Tensor]:
    """The transformers model's state dict on the meta device: names and shapes, no memory (the tied head
    left out, as save_pretrained does)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    state = model.state_dict()
    if shape.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return config, state


def write_weights(state: dict, folder: Path, *, dtype: torch.dtype, shard_bytes: int, seed: int = 0) -> None:
    """Random weights written shard by shard: one shard in memory at a time."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    shards, current, size = [], {}, 0
    for name, meta in state.items():
        nbytes = meta.numel() * torch.finfo(dtype).bits // 8
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = meta
        size += nbytes
    shards.append(current)
    total = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        tensors = {}
        for name, meta in shard.items():
            if meta.dim() == 1:  # norms
                tensors[name] = torch.ones(meta.shape, dtype=dtype)
            else:
                tensors[name] = torch.empty(meta.shape, dtype=torch.float32).normal_(0, 0.02, generator=generator)
                tensors[name] = tensors[name].to(dtype)
            weight_map[name] = file
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        print(f"wrote {file} ({len(tensors)} tensors)", flush=True)
        del tensors
    if total > 1:
        total_size = sum(m.numel() * torch.finfo(dtype).bits // 8 for m in state.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def drop_tokens_past(folder: Path, vocab_size: int) -> None:
    """transformers' GGUF tokenizer conversion adds an <|endoftext|> past Llama 3's 128,256 tokens; the real
    model has none, and export refuses a tokenizer bigger than the embedding."""
    for name, key in (("tokenizer.json", "added_tokens"), ("tokenizer_config.json", "added_tokens_decoder")):
        path = folder / name
        data = json.loads(path.read_text())
        tokens = data.get(key)
        if isinstance(tokens, list):
            data[key] = [t for t in tokens if t["id"] < vocab_size]
        elif isinstance(tokens, dict):
            data[key] = {k: v for k, v in tokens.items() if int(k) < vocab_size}
        path.write_text(json.dumps(data, ensure_ascii=False, indent=2))


def tokenizer_of(vocab: Path):
    """transformers' tokenizer of a llama.cpp vocabulary file. Where transformers cannot read the file (5.24 reads
    the whole config first, and Gemma 4's per-layer KV head counts fail its validation), edgelm's own reader of
    the same metadata builds it (export/gguf_tokenizer.py, checked against llama.cpp's ids in the tests)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(vocab.parent, gguf_file=vocab.name)
    except StrictDataclassError:
        from tokenizers import Tokenizer

        from edgelm.export.gguf_header import read_header
        from edgelm.export.gguf_tokenizer import build_tokenizer_json

        meta = read_header(vocab).metadata
        tokens = meta["tokenizer.ggml.tokens"]
        special = {
            f"{name}_token": tokens[meta[f"tokenizer.ggml.{name}_token_id"]]
            for name in ("bos", "eos", "unknown", "padding")
            if f"tokenizer.ggml.{name}_token_id" in meta
        }
        special["unk_token"] = special.pop("unknown_token", None)
        special["pad_token"] = special.pop("padding_token", None)
        tokenizer = Tokenizer.from_str(build_tokenizer_json(meta))
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **{k: v for k, v in special.items() if v})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--shard-gb", type=float, default=None, help="shard size (save_pretrained's max_shard_size)")
    args = parser.parse_args()
    from transformers import GenerationConfig

    shape = SHAPES[args.shape]
    args.out.mkdir(parents=True, exist_ok=True)
    config, state = meta_state(shape)
    config.torch_dtype = args.dtype
    config.save_pretrained(args.out)
    GenerationConfig(bos_token_id=shape["bos_token_id"], eos_token_id=shape["eos_token_id"]).save_pretrained(args.out)
    tokenizer_of(LLAMA_CPP / "models" / VOCABS[shape["model_type"]]).save_pretrained(args.out)
    drop_tokens_past(args.out, shape["vocab_size"])
    if shape["model_type"] in TOKENIZER_CLASSES:
        path = args.out / "tokenizer_config.json"
        path.write_text(
            json.dumps(json.loads(path.read_text()) | {"tokenizer_class": TOKENIZER_CLASSES[shape["model_type"]]})
        )
    shard_bytes = int(args.shard_gb * 1e9) if args.shard_gb else 1 << 62
    write_weights(state, args.out, dtype=DTYPES[args.dtype], shard_bytes=shard_bytes)
    print(f"{args.shape}: {sum(m.numel() for m in state.values()) / 1e6:.1f}M parameters in {args.out}")


if __name__ == "__main__":
    main()
