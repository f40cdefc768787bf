"""Load time, peak memory and decode speed of two packages of one model, in alternating rounds.

Written for compact GGUF blocks (export/compact_blocks.py): the same file exported with plain and with compact
blocks must decode at the same speed, and this measures what unpacking at load costs. Each package is loaded
in a child process of its own, round by round, A then B then A..., so a shared machine's drift stays out of
the per-round ratios (benchmarks/ab.py). A child reports the session build (Model.load_s), the first generation's
time to first token (a cold session: ONNX Runtime's first-run allocations included), the process's peak RSS after
the load and at the end, its RSS right after the load (Linux's VmRSS: what stays once the load's peak is over), and
decode tokens/s (the best of three generations after a warm-up).

    python benchmarks/alternate_packages.py PLAIN_PACKAGE COMPACT_PACKAGE [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys

import ab

CHILD = """
import json, resource, sys
from edgelm.runtime import load
package, threads, prompt_tokens, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
peak_mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
status = lambda: open("/proc/self/status").read().split("VmRSS:")[1].split()[0]
model = load(package, provider="cpu", threads=threads)
loaded_mb, resident_mb = peak_mb(), int(status()) / 1024
prompt = list(range(10, 10 + prompt_tokens))
first = model.generate(prompt, 1, ignore_eos=True).timings.time_to_first_token_s
model.generate(prompt, 8, ignore_eos=True)  # warm-up
runs = [model.generate(prompt, new_tokens, ignore_eos=True).timings.decode_tokens_per_s for _ in range(3)]
print(json.dumps({"load_s": model.load_s, "first_token_s": first, "loaded_rss_mb": loaded_mb,
                  "resident_mb": resident_mb, "peak_rss_mb": peak_mb(), "decode_tokens_per_s": max(runs)}))
"""
FIGURES = ("load_s", "first_token_s", "loaded_rss_mb", "resident_mb", "peak_rss_mb", "decode_tokens_per_s")


def variant(name: str, package: str, args: argparse.Namespace) -> ab.Variant:
    command = [args.python, "-c", CHILD, package, str(args.threads), str(args.prompt_tokens), str(args.new_tokens)]
    return ab.command(f"{name} ({package})", command)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packages", nargs=2, help="the package to compare against, then the package to measure")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose edgelm runs both")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    variants = [variant(name, package, args) for name, package in zip("AB", args.packages, strict=True)]
    result = ab.run(variants, rounds=args.rounds)
    print()
    print(ab.table(result, list(FIGURES)))


if __name__ == "__main__":
    main()
