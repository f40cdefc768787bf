"""Decode speed of two edgelm builds on one package, in alternating rounds.

A refactor of the decode loop must not cost speed. This runs each build (a Python interpreter whose
`edgelm` is that build) in a child process of its own, round by round, A then B then A..., and
reports each build's median decode tokens/s and the median of the per-round ratios B/A (benchmarks/ab.py, the
harness every A/B script uses). Alternating rounds keep a shared machine's drift out of the ratio.

    python benchmarks/alternate_builds.py PACKAGE --python /old/.venv/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse

import ab

CHILD = """
import json, sys
from edgelm.runtime import load
model = load(sys.argv[1], provider="cpu", threads=int(sys.argv[2]))
prompt = list(range(10, 10 + int(sys.argv[3])))
model.generate(prompt, 8, ignore_eos=True)  # warm-up: the first runs pay ONNX Runtime's allocations
rates = [model.generate(prompt, int(sys.argv[4]), ignore_eos=True).timings.decode_tokens_per_s for _ in range(3)]
print(json.dumps({"decode_tokens_per_s": max(rates)}))
"""


def variant(name: str, python: str, args: argparse.Namespace) -> ab.Variant:
    """One build: a child process of `python` printing its decode tokens/s, the best of three after a warm-up."""
    command = [python, "-c", CHILD, args.package, str(args.threads), str(args.prompt_tokens), str(args.new_tokens)]
    return ab.command(f"{name} ({python})", command)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package", help="a model package folder both builds can load")
    p.add_argument("--python", action="append", required=True, help="interpreter of a build (give exactly two)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    if len(args.python) != 2:
        p.error("give --python twice: the build to compare against, then the build to measure")
    variants = [variant(name, python, args) for name, python in zip("AB", args.python, strict=True)]
    result = ab.run(variants, rounds=args.rounds)
    print()
    print(ab.table(result))


if __name__ == "__main__":
    main()
