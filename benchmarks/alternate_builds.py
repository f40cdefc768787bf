"""Decode speed of two edgelm builds on one package, in alternating rounds.

A refactor of the decode loop must not cost speed. This runs each build (a Python interpreter whose
`edgelm` is that build) in a child process of its own, round by round, A then B then A..., and
reports each build's median decode tokens/s and the median of the per-round ratios B/A. Alternating
rounds keep a shared machine's drift out of the ratio.

    python benchmarks/alternate_builds.py PACKAGE --python /old/.venv/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

CHILD = """
import json, sys
from edgelm.runtime import load
model = load(sys.argv[1], provider="cpu", threads=int(sys.argv[2]))
prompt = list(range(10, 10 + int(sys.argv[3])))
model.generate(prompt, 8, ignore_eos=True)  # warm-up: the first runs pay ONNX Runtime's allocations
rates = [model.generate(prompt, int(sys.argv[4]), ignore_eos=True).timings.decode_tokens_per_s for _ in range(3)]
print(json.dumps(max(rates)))
"""


def one_run(python: str, args: argparse.Namespace) -> float:
    """Decode tokens/s of one child process: the best of three generations after a warm-up."""
    command = [python, "-c", CHILD, args.package, str(args.threads), str(args.prompt_tokens), str(args.new_tokens)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"{python} failed: {last}")
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


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
    rates: list[list[float]] = [[], []]
    for round_ in range(args.rounds):
        for build, python in enumerate(args.python):
            rates[build].append(one_run(python, args))
        print(f"round {round_ + 1}: A {rates[0][-1]:.1f}  B {rates[1][-1]:.1f} tokens/s", flush=True)
    ratios = [b / a for a, b in zip(*rates, strict=True)]
    print(f"A median {statistics.median(rates[0]):.1f} tokens/s ({args.python[0]})")
    print(f"B median {statistics.median(rates[1]):.1f} tokens/s ({args.python[1]})")
    spread = f"min {min(ratios):.3f}, max {max(ratios):.3f}"
    print(f"B/A median of per-round ratios {statistics.median(ratios):.3f} ({spread})")


if __name__ == "__main__":
    main()
