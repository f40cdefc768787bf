"""edgelm's runtime against onnxruntime-genai on the very same package, in one process, alternating.

    python benchmarks/same_package.py PACKAGE [--rounds 6] [--prompt-tokens 32] [--new-tokens 128] [--threads 2]

Both load the package once; each round generates greedily from the same random prompt with edgelm's
`generate`, with genai, and with a loop of bare KV-cache steps (`cache.next` with a fixed token: the
cache grows as in generation, nothing is sampled), the floor for any Python driver of that session.
Prints decode tokens/s per round and the median of the per-round ratios (benchmarks/ab.py, its callables taking
turns in this one process), which holds on a machine whose speed drifts between rounds.
"""

from __future__ import annotations

import argparse
import json
import time

import ab
import numpy as np
import onnxruntime_genai as og

from edgelm.runtime import load
from edgelm.runtime.kvcache import make_cache


def genai_model(package: str, threads: int):
    config = og.Config(package)
    config.clear_providers()
    options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


def edgelm_rate(model, prompt: list[int], new: int) -> float:
    return model.generate(prompt, new, ignore_eos=True).timings.decode_tokens_per_s


def genai_rate(genai, prompt: list[int], new: int) -> float:
    length = len(prompt)
    params = og.GeneratorParams(genai)
    params.set_search_options(do_sample=False, max_length=length + new, min_length=length + new, batch_size=1)
    generator = og.Generator(genai, params)
    generator.append_tokens(np.array(prompt, dtype=np.int32))
    generator.generate_next_token()  # the prompt and the first token: decode is timed from here
    started = time.perf_counter()
    while not generator.is_done():
        generator.generate_next_token()
    return (new - 1) / (time.perf_counter() - started)


def cache_steps_rate(model, prompt: list[int], new: int) -> float:
    cache = make_cache(model, [prompt], capacity=len(prompt) + new)
    cache.prompt()
    token = np.array([[prompt[-1]]])
    cache.next(token)
    started = time.perf_counter()
    for _ in range(new - 1):
        cache.next(token)  # the cache grows as in generation; no logits are read, nothing is sampled
    return (new - 1) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    length, new = args.prompt_tokens, args.new_tokens
    model = load(args.package, provider="cpu", threads=args.threads)
    prompt = np.random.default_rng(0).integers(100, model.spec.arch.vocab_size, length).tolist()
    genai = genai_model(args.package, args.threads)
    systems = [
        ab.here("edgelm", edgelm_rate, model, prompt, new),
        ab.here("onnxruntime-genai", genai_rate, genai, prompt, new),
        ab.here("cache steps only", cache_steps_rate, model, prompt, new),
    ]
    result = ab.run(systems, rounds=args.rounds, warmup=1)  # one warm-up each, then every system in turn
    print(f"\n{args.package}: {length}-token prompt, {new} new tokens, {args.threads} threads, {args.rounds} rounds")
    print("| system | decode tokens/s (median) | per-round ratio to edgelm (median) |\n|---|---|---|")
    for name, medians in result["medians"].items():
        print(f"| {name} | {medians['value']:.1f} | {result['ratios'][name]['value']['median']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
