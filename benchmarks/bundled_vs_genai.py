"""The bundled model, edgelm's runtime against onnxruntime-genai on the very same package, alternating.

    python benchmarks/bundled_vs_genai.py [PACKAGE ...] [--rounds 5] [--threads 2]

At 3.7M parameters a decode step reads 15 MB (fp32), so the time goes to per-step overhead (the
executor, binding, sampling, Python) rather than to the weights: this measures that overhead.
Default packages: the bundled model exported and quantized (dynamic int8, int4) under out/bundled.
Greedy, 32-token prompt, 90 new tokens (the context is 128), EOS masked for both (genai's min_length).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PROMPT_TOKENS, NEW_TOKENS = 32, 90


def default_packages(out: Path) -> list[Path]:
    packages = [out / "fp32", out / "int8-dynamic", out / "int4"]
    if not packages[0].exists():
        checkpoint = REPO / "models" / "shakespeare"
        subprocess.run([sys.executable, "-m", "edgelm", "export", str(checkpoint), str(packages[0])], check=True)
    for path, mode in zip(packages[1:], ("dynamic", "int4"), strict=True):
        if not path.exists():
            command = ["quantize", str(packages[0]), str(path), "--mode", mode]
            subprocess.run([sys.executable, "-m", "edgelm", *command], check=True)
    return packages


def edgelm_rate(model, prompt: list[int]) -> float:
    return model.generate(prompt, NEW_TOKENS, ignore_eos=True).timings.decode_tokens_per_s


def genai_rate(og, genai, prompt: list[int]) -> float:
    params = og.GeneratorParams(genai)
    length = PROMPT_TOKENS + NEW_TOKENS
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    generator = og.Generator(genai, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    generator.generate_next_token()  # the first token, as edgelm's figure excludes it
    started, steps = time.perf_counter(), 0
    while not generator.is_done():
        generator.generate_next_token()
        steps += 1
    return steps / (time.perf_counter() - started)


def main() -> int:
    import onnxruntime_genai as og

    from edgelm.runtime import load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*")
    parser.add_argument("--out", default=str(REPO / "out" / "bundled"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    packages = [Path(p) for p in args.packages] or default_packages(Path(args.out))
    text = (REPO / "data" / "shakespeare-heldout.txt").read_text(encoding="utf-8")[:2000]

    print("| package | edgelm decode tokens/s | onnxruntime-genai decode tokens/s | edgelm / genai |")
    print("|---|---|---|---|")
    for package in packages:
        model = load(package, provider="cpu", threads=args.threads)
        prompt = model.encode(text)[:PROMPT_TOKENS]
        config = og.Config(str(package))
        config.overlay(f'{{"model": {{"decoder": {{"session_options": {{"intra_op_num_threads": {args.threads}}}}}}}}}')
        genai = og.Model(config)

        edgelm_rate(model, prompt), genai_rate(og, genai, prompt)  # warm-up
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(edgelm_rate(model, prompt))
            theirs.append(genai_rate(og, genai, prompt))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"| {package.name} | {a:.0f} | {b:.0f} | {a / b:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
