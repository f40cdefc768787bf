"""The one A/B harness: variants measured in rounds, round-robin, summarised as the median of per-round ratios.

A shared machine's speed drifts from minute to minute, so figures measured minutes apart do not compare. Here each
round runs every variant once, in turn, so drift falls on all of them alike, and a variant's figure is compared with
the baseline's of the same round; the summary is the median over rounds of those per-round ratios (with their min
and max), beside each variant's median figures.

    python benchmarks/ab.py --rounds 5 --baseline old old='/old/.venv/bin/python bench.py' new='python bench.py'
        [--order same|reverse|rotate] [--warmup 1] [--keys decode_tokens_per_s] [--json out.json]

A variant is
- a child command (`command`, or NAME=COMMAND on the command line) whose last line of output is JSON: a number, or an
  object whose numbers are the figures (nested objects flattened to dotted keys: `greedy.wall`); or
- a Python callable returning such a value: `spawned` runs it in a child process of its own (multiprocessing's spawn,
  so it must be importable: a module-level function), `here` in this process, for a comparison that is about one
  process (models loaded once, then taking turns).
Values that are not numbers (token ids, names) are kept in the rounds' records and left out of the summary.
Scripts import it (`import ab`, with benchmarks/ on sys.path, as a script's own folder is).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import get_context
from pathlib import Path

ORDERS = ("same", "reverse", "rotate")  # every round A B C; reversed every other round; round i starts at i % n


@dataclass
class Variant:
    """One side of the comparison: `measure()` returns its figures for one round."""

    name: str
    measure: Callable[[], object] = field(repr=False)


def command(name: str, argv: list[str], *, env: dict | None = None, cwd: str | Path | None = None) -> Variant:
    """A child command whose last JSON line holds the figures; a failing child ends the run naming its last line."""

    def measure() -> object:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"{name} failed (exit {done.returncode}): {last}")
        return parse_output(done.stdout, name)

    return Variant(name, measure)


def spawned(name: str, function: Callable, *args, **kwargs) -> Variant:
    """`function(*args, **kwargs)` in a fresh child process each round (spawned: no state shared with this one)."""

    def measure() -> object:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            return pool.submit(function, *args, **kwargs).result()

    return Variant(name, measure)


def here(name: str, function: Callable, *args, **kwargs) -> Variant:
    """`function(*args, **kwargs)` in this process: for variants that are loaded once and take turns."""
    return Variant(name, partial(function, *args, **kwargs))


def parse_output(stdout: str, name: str = "child") -> object:
    """The whole output as one JSON document (an indented one included), or else its last line that is JSON (a
    child may print more before it)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        pass
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    raise SystemExit(f"{name} printed no JSON line of figures: {stdout.strip()[-200:]!r}")


def figures(value: object, prefix: str = "") -> dict[str, float]:
    """The numbers of one round's value: a bare number is `value`, nested objects become dotted keys."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int | float):
        return {prefix or "value": float(value)}
    if isinstance(value, dict):
        flat: dict[str, float] = {}
        for key, item in value.items():
            flat |= figures(item, f"{prefix}.{key}" if prefix else str(key))
        return flat
    return {}


def order_of(names: list[str], round_index: int, order: str) -> list[str]:
    """The variants' turn in round `round_index` (0-based)."""
    if order == "same":
        return list(names)
    if order == "reverse":
        return list(names) if round_index % 2 == 0 else list(names)[::-1]
    if order == "rotate":
        start = round_index % len(names)
        return list(names)[start:] + list(names)[:start]
    raise ValueError(f"unknown order {order!r}: one of {', '.join(ORDERS)}")


def per_round_ratios(values: list[float], base: list[float]) -> list[float]:
    """values[i] / base[i]; a zero baseline gives nan (no ratio that round)."""
    return [v / b if b else float("nan") for v, b in zip(values, base, strict=True)]


def spread(ratios: list[float]) -> dict:
    """The median of per-round ratios, its min and max, and the ratios themselves."""
    kept = [r for r in ratios if r == r]  # nan != nan
    if not kept:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "per_round": ratios}
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept), "per_round": ratios}


def summarise(runs: dict[str, list[object]], baseline: str) -> dict:
    """{"medians": {variant: {key: median}}, "ratios": {variant: {key: spread of per-round ratios to baseline}}}."""
    flat = {name: [figures(value) for value in values] for name, values in runs.items()}
    base = flat[baseline]
    medians, ratios = {}, {}
    for name, rounds in flat.items():
        keys = [k for k in rounds[0] if all(k in r for r in rounds)] if rounds else []
        medians[name] = {k: statistics.median(r[k] for r in rounds) for k in keys}
        shared = [k for k in keys if all(k in r for r in base)]
        ratios[name] = {k: spread(per_round_ratios([r[k] for r in rounds], [r[k] for r in base])) for k in shared}
    return {"medians": medians, "ratios": ratios}


def between(result: dict, variant: str, other: str, key: str) -> dict:
    """The spread of per-round ratios variant / other for one figure: any pair, not only against the baseline."""
    values = [figures(v)[key] for v in result["runs"][variant]]
    base = [figures(v)[key] for v in result["runs"][other]]
    return spread(per_round_ratios(values, base))


def _progress(round_index: int, name: str, value: object) -> None:
    shown = ", ".join(f"{k} {v:.4g}" for k, v in list(figures(value).items())[:6])
    print(f"round {round_index + 1} {name}: {shown}", flush=True)


def run(
    variants: list[Variant],
    *,
    rounds: int,
    baseline: str | None = None,
    order: str = "same",
    warmup: int = 0,
    progress: Callable[[int, str, object], None] | None = _progress,
) -> dict:
    """Every variant once per round, in `order`, for `rounds` rounds (after `warmup` untimed calls each).

    Returns {"baseline", "rounds", "order", "runs": {variant: [value per round]}, "medians", "ratios"}."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names repeat: {names}")
    if not variants or rounds < 1:
        raise ValueError("give at least one variant and one round")
    baseline = baseline or names[0]
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not a variant: {', '.join(names)}")
    by_name = {v.name: v for v in variants}
    for variant in variants:
        for _ in range(warmup):
            variant.measure()
    runs: dict[str, list[object]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in order_of(names, round_index, order):
            runs[name].append(by_name[name].measure())
            if progress:
                progress(round_index, name, runs[name][-1])
    return {"baseline": baseline, "rounds": rounds, "order": order, "runs": runs} | summarise(runs, baseline)


def table(result: dict, keys: list[str] | None = None) -> str:
    """A markdown table: per variant and figure, its median and the median of its per-round ratios to the baseline."""
    baseline = result["baseline"]
    rows = [
        f"| variant | figure | median | per-round ratio to {baseline} (median) | min - max |",
        "|---|---|---|---|---|",
    ]
    for name, medians in result["medians"].items():
        for key, median in medians.items():
            if keys and key not in keys:
                continue
            ratio = result["ratios"][name].get(key)
            shown = (f"{ratio['median']:.3f}", f"{ratio['min']:.3f} - {ratio['max']:.3f}") if ratio else ("", "")
            rows.append(f"| {name} | {key} | {median:.4g} | {shown[0]} | {shown[1]} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="NAME=COMMAND, the command split as a shell would")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="the variant the ratios are against (default: the first)")
    parser.add_argument("--order", choices=ORDERS, default="same", help="each round's turn order")
    parser.add_argument("--warmup", type=int, default=0, help="untimed runs of each variant before the rounds")
    parser.add_argument("--keys", help="comma-separated figures to show (default: all)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    variants = []
    for spec in args.variants:
        name, sep, line = spec.partition("=")
        if not sep or not name or not line:
            parser.error(f"{spec!r}: give NAME=COMMAND")
        variants.append(command(name, shlex.split(line)))
    try:
        result = run(variants, rounds=args.rounds, baseline=args.baseline, order=args.order, warmup=args.warmup)
    except ValueError as error:
        parser.error(str(error))
    print()
    print(table(result, args.keys.split(",") if args.keys else None))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
