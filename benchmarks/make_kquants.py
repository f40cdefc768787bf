"""The GGUF files people download, made by llama.cpp's own quantizer: SmolLM2-135M-Instruct as Q4_K_M,
Q5_K_M, Q6_K and Q8_0, from the shipped Q4_1 file (`llama_model_quantize` with allow_requantize, as
`llama-quantize --allow-requantize` does). Each ends up in --out (a cache folder, not the repository);
tests/export/test_gguf_blocks.py and docs/results.md read them from there.

    /work/llamacpp-venv/bin/python benchmarks/make_kquants.py [--source FILE] [--out ~/.cache/edgelm/kquants]

Runs in a llama-cpp-python interpreter (it needs nothing but llama_cpp). Requantizing from Q4_1 stacks a
second rounding on the first, so these files are not the ones a Hub repository would hold; their block
layouts (which tensors get which type) are llama.cpp's own, which is what edgelm has to read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

CACHE = Path.home() / ".cache" / "edgelm"
SOURCE = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = CACHE / "kquants"
PRESETS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def quantize(source: Path, target: Path, preset: str, *, threads: int = 2) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
    params.nthread = threads
    params.allow_requantize = True
    partial = target.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source.name} -> {preset}) returned {status}")
    partial.rename(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--presets", default=",".join(PRESETS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.source.name.split(".")[0]  # SmolLM2-135M-Instruct
    for preset in args.presets.split(","):
        target = args.out / f"{stem}.{preset}.gguf"
        if not target.is_file():
            quantize(args.source, target, preset)
        print(f"{target} {target.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
