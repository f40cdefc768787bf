"""Per-token decode cost of two edgelm builds, greedy and sampled, in alternating rounds, wall and CPU time.

Each build (a Python interpreter whose `edgelm` is that build) runs in a child process of its own, round by
round, A then B then A...; a child loads the package with one thread, warms up, and reports the best of
`--reps` generations (EOS ignored) as milliseconds per token, by wall clock and by the process's CPU time
(less sensitive to a loaded machine). `--fixed-logits` replaces the model call by fixed logits (rolled each
step, so the argmax moves), which leaves only the Python side of a step: picker, sampler, loop ending and
detokenization. The report is each build's medians and the median of the per-round ratios B/A (benchmarks/ab.py).

    python benchmarks/decode_step_time.py PACKAGE --python /old/.venv/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse

import ab

CHILD = """
import json, sys, time
import numpy as np
import edgelm.runtime.decode as decode
from edgelm.runtime import load
package, reps, new_tokens, fixed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
model = load(package, provider="cpu", threads=1)
if fixed:
    vocab = json.load(open(package + "/edgelm.json"))["architecture"]["vocab_size"]
    base = (np.random.default_rng(0).standard_normal(vocab) * 3).astype(np.float32)

    class FixedLogits:
        def __init__(self, *args, **kwargs):
            self.step = 0
        def prompt(self):
            return base[None, :].copy()
        def extend(self, feed, all_logits=False):
            return base.copy()
        def next(self, next_ids):
            self.step += 1
            return np.roll(base, 7 * self.step)[None, :]

    decode.make_cache = FixedLogits
modes = {"greedy": dict(temperature=0), "sample": dict(temperature=0.8, top_k=40, top_p=0.95, seed=1)}
result = {}
for name, options in modes.items():
    model.generate("The king said", max_new_tokens=16, ignore_eos=True, **options)  # warm-up
    wall = cpu = float("inf")
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        tokens = len(model.generate("The king said", max_new_tokens=new_tokens, ignore_eos=True, **options).token_ids)
        wall = min(wall, (time.perf_counter() - w0) * 1e3 / tokens)
        cpu = min(cpu, (time.process_time() - c0) * 1e3 / tokens)
    result[name] = {"wall": wall, "cpu": cpu}
print(json.dumps(result))
"""


def variant(name: str, python: str, args: argparse.Namespace) -> ab.Variant:
    """A child prints {mode: {"wall": ms/token, "cpu": ms/token}}: figures `greedy.wall`, `sample.cpu`, ..."""
    fixed = "1" if args.fixed_logits else "0"
    return ab.command(
        f"{name} ({python})", [python, "-c", CHILD, args.package, str(args.reps), str(args.new_tokens), fixed]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package", help="a model package folder both builds can load")
    p.add_argument("--python", action="append", required=True, help="interpreter of a build (give exactly two)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=3, help="generations per mode in a child; the best counts")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--fixed-logits", action="store_true", help="replace the model call: the Python side only")
    args = p.parse_args(argv)
    if len(args.python) != 2:
        p.error("give --python twice: the build to compare against, then the build to measure")
    variants = [variant(name, python, args) for name, python in zip("AB", args.python, strict=True)]
    result = ab.run(variants, rounds=args.rounds)
    print()
    print(ab.table(result, [f"{mode}.{clock}" for mode in ("greedy", "sample") for clock in ("cpu", "wall")]))


if __name__ == "__main__":
    main()
