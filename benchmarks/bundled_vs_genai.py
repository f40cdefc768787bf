"""The bundled model, edgelm's runtime against onnxruntime-genai on the very same package, alternating.

    python benchmarks/bundled_vs_genai.py [PACKAGE ...] [--rounds 5] [--threads 2]

At 3.7M parameters a decode step reads 15 MB (fp32), so the time goes to per-step overhead (the
executor, binding, sampling, Python) rather than to the weights: this measures that overhead.
Default packages: the bundled model exported and quantized (dynamic int8, int4) under out/bundled.
Greedy, 32-token prompt, 90 new tokens (the context is 128), EOS masked for both (genai's min_length);
each system in child processes of its own, alternating, 3 generations per child after a warm-up (their median
the child's figure); edgelm / genai is the median of the per-round ratios (benchmarks/ab.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ab
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


def child(system: str, package: Path, threads: int, rounds: int) -> list[float]:
    """Runs in a process of its own: two ONNX Runtime thread pools in one process (edgelm's session and
    genai's) would spin against each other on 2 cores."""
    from edgelm.runtime import load

    model = load(package, provider="cpu", threads=threads)
    text = (REPO / "data" / "shakespeare-heldout.txt").read_text(encoding="utf-8")[:2000]
    prompt = model.encode(text)[:PROMPT_TOKENS]
    if system == "edgelm":
        run = lambda: edgelm_rate(model, prompt)
    else:
        import onnxruntime_genai as og

        config = og.Config(str(package))
        config.overlay(f'{{"model": {{"decoder": {{"session_options": {{"intra_op_num_threads": {threads}}}}}}}}}')
        genai = og.Model(config)
        run = lambda: genai_rate(og, genai, prompt)
    run()  # warm-up
    return [run() for _ in range(rounds)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*")
    parser.add_argument("--out", default=str(REPO / "out" / "bundled"))
    parser.add_argument("--rounds", type=int, default=5, help="alternating child runs per system and package")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=("edgelm", "genai"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rates = child(args.child, Path(args.packages[0]), args.threads, 3)
        print(json.dumps({"decode_tokens_per_s": statistics.median(rates), "rates": rates}))
        return 0
    packages = [Path(p) for p in args.packages] or default_packages(Path(args.out))

    print("| package | edgelm decode tokens/s | onnxruntime-genai decode tokens/s | edgelm / genai |")
    print("|---|---|---|---|")
    for package in packages:
        variants = [
            ab.command(
                system, [sys.executable, __file__, str(package), "--child", system, "--threads", str(args.threads)]
            )
            for system in ("edgelm", "genai")
        ]
        result = ab.run(variants, rounds=args.rounds, baseline="genai", progress=None)
        ours, theirs = (result["medians"][system]["decode_tokens_per_s"] for system in ("edgelm", "genai"))
        ratio = result["ratios"]["edgelm"]["decode_tokens_per_s"]["median"]
        print(f"| {package.name} | {ours:.0f} | {theirs:.0f} | {ratio:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
