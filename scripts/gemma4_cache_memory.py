"""The KV cache of a Gemma-4-E2B-shaped package at 8k context, with KV sharing and without: computed from the
manifest (runtime/kvcache.py kv_cache_bytes) and measured as the bytes of the buffers the runtime binds.

    .venv/bin/python scripts/gemma4_cache_memory.py [--context 8192] [--out /tmp/gemma4-cache]

The attention shapes are E2B's (35 layers, 4 sliding then 1 full, 8 query heads, 1 KV head, heads of 256 on
sliding layers and 512 on full ones, the last 20 layers reading the cache of layers 13 and 14); width, MLP and
vocabulary are small, as they do not change the cache. Results: docs/export.md, "Gemma 4".
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

from edgelm.export.onnx_export import export_package
from edgelm.runtime import load
from edgelm.runtime.kvcache import kv_cache_bytes, make_cache

E2B_ATTENTION = dict(
    num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, sliding_window=512,
)  # fmt: skip
SMALL = dict(hidden_size=64, intermediate_size=64, vocab_size=2048, vocab_size_per_layer_input=2048,
             hidden_size_per_layer_input=8, bos_token_id=1, eos_token_id=1, pad_token_id=0)  # fmt: skip


def measure(folder: Path, *, shared: int, context: int) -> tuple[int, int, int]:
    """(cache tensors, bytes the manifest gives, bytes of the buffers the runtime binds) at `context` positions."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**E2B_ATTENTION, **SMALL, num_kv_shared_layers=shared,
                                           max_position_embeddings=context)  # fmt: skip
    checkpoint, package = folder / f"hf-{shared}", folder / f"package-{shared}"
    hf = transformers.Gemma4ForCausalLM(config).eval()
    hf.save_pretrained(checkpoint)
    shutil.copy(Path(__file__).parent.parent / "models" / "shakespeare" / "tokenizer.json", checkpoint)
    # 35 layers of unscaled attention over unit-norm heads of 512 (random weights, norms at 1): float32 moves the
    # logits by a few 1e-4 here, which is not what this script measures
    export_package(checkpoint, package, progress=lambda _: None, overwrite=True, tolerance=1e-3)
    model = load(package, provider="cpu")
    ids = np.array([[5, 6, 7, 99, 300, 12]])
    with torch.no_grad():
        difference = np.abs(model.forward(ids)[0] - hf(torch.from_numpy(ids)).logits.numpy()).max()
    print(f"shared {shared}: max |logit difference| against transformers {difference:.1e}", file=sys.stderr)
    cache = make_cache(model, [[5, 6, 7]], capacity=context)
    bound = sum(buffer.numpy().nbytes for buffer in cache.buffers)
    return len(cache.buffers), kv_cache_bytes(model.spec, batch=1, capacity=context), bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [(shared, *measure(Path(tmp), shared=shared, context=args.context)) for shared in (20, 0)]
    print(f"| shared layers | cache tensors | manifest (kv_cache_bytes) | runtime buffers | context {args.context} |")
    print("|---|---|---|---|---|")
    for shared, tensors, computed, bound in rows:
        print(f"| {shared} | {tensors} | {computed / 2**20:.1f} MiB | {bound / 2**20:.1f} MiB | fp32, batch 1 |")
    print(f"ratio shared / unshared: {rows[0][3] / rows[1][3]:.4f}", file=sys.stderr)
    assert all(computed == bound for _, _, computed, bound in rows), "the manifest and the runtime disagree"
    assert np.isclose(rows[0][3] / rows[1][3], 36 / 84), "E2B's ratio: (12 x 256 + 3 x 512) / (28 x 256 + 7 x 512)"


if __name__ == "__main__":
    main()
