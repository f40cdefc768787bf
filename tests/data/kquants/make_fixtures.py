"""Regenerate the GGUF fixtures in this folder: a tiny random Llama (hidden 256, so every K-quant fits; one
layer; the first 512 tokens of models/shakespeare's tokenizer) written in F32 with gguf-py, then quantized
by llama.cpp's own `llama_model_quantize` to the presets people download. tests/export/test_gguf_blocks.py reads
them, so llama.cpp's real block layouts and type choices are tested without llama.cpp installed.

    .venv/bin/python tests/data/kquants/make_fixtures.py [--llamacpp-python /work/llamacpp-venv/bin/python]

The quantizing runs in a llama-cpp-python interpreter (benchmarks/make_kquants.py quantize).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent.parent
PRESETS = ("Q2_K", "Q4_K_M", "Q5_K_M")  # between them Q2_K .. Q6_K, and Q4_K beside Q6_K in one Q/K/V
VOCAB, HIDDEN, INNER, HEADS, KV_HEADS = 512, 256, 256, 4, 2


def write_f32(path: Path) -> None:
    tokenizer = json.loads((REPO / "models" / "shakespeare" / "tokenizer.json").read_text())
    tokens = [t for t, i in sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])][:VOCAB]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"][: VOCAB - 257]]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("context_length", 256), ("embedding_length", HIDDEN), ("feed_forward_length", INNER)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.block_count", 1)
    writer.add_uint32("llama.attention.head_count", HEADS)
    writer.add_uint32("llama.attention.head_count_kv", KV_HEADS)
    writer.add_float32("llama.rope.freq_base", 1e4)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("llama.rope.dimension_count", HIDDEN // HEADS)
    writer.add_uint32("llama.vocab_size", VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "blk.0.attn_norm.weight": (HIDDEN,)}
    shapes |= {"blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (kv, HIDDEN)}
    shapes |= {"blk.0.attn_v.weight": (kv, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN)}
    shapes |= {"blk.0.ffn_norm.weight": (HIDDEN,), "blk.0.ffn_gate.weight": (INNER, HIDDEN)}
    shapes |= {"blk.0.ffn_up.weight": (INNER, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, INNER)}
    shapes |= {"output_norm.weight": (HIDDEN,)}
    for name, shape in shapes.items():
        value = 1 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.1 * rng.standard_normal(shape)
        writer.add_tensor(name, value.astype(np.float32))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token == "<|endoftext|>" else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "tiny-f32.gguf"
        write_f32(source)
        for preset in PRESETS:
            target = HERE / f"tiny-llama.{preset}.gguf"
            target.unlink(missing_ok=True)
            code = "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1])"
            code += "; from make_kquants import quantize; quantize(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])"
            command = [args.llamacpp_python, "-c", code, str(REPO / "benchmarks"), str(source), str(target), preset]
            subprocess.run(command, check=True, capture_output=True)
            print(f"{target.name}: {target.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
