"""What each performance lever is worth, side by side in one run: packages of one GPT-2 checkpoint that
differ by one choice, benched alternately (round-robin, so drift on a shared machine hits all alike).

    python benchmarks/experiments/levers.py [--checkpoint out/peers/gpt2/checkpoint] [--out out/levers]
                                [--prompt-tokens 32,512] [--new-tokens 128] [--rounds 3] [--threads 2]

Pairs measured (every package built here from the checkpoint, or reused from --out):
- graph: the fused export (GroupQueryAttention, KV buffer updated in place) against the standard-ops
  export (past + new concatenated every step), at fp32, dynamic int8 and int4;
- int4 LM head: 8-bit (the default, for accuracy) against 4-bit.
Each row is the median over --rounds of `edgelm bench` figures (one child process per package and
round): decode tokens/s, time to first token, and the runtime's own share of a decode step; a lever's ratio is
the median of its per-round ratios (benchmarks/ab.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the A/B harness
import ab  # noqa: E402

CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"

# name -> (attention, quantize mode or None, extra quantize arguments)
PACKAGES = {
    "fused-fp32": ("fused", None, []),
    "standard-fp32": ("standard", None, []),
    "fused-int8-dynamic": ("fused", "dynamic", []),
    "standard-int8-dynamic": ("standard", "dynamic", []),
    "fused-int4": ("fused", "int4", []),
    "standard-int4": ("standard", "int4", []),
    "fused-int4-head4": ("fused", "int4", ["--int4-lm-head", "int4"]),
}
PAIRS = [
    ("fused-fp32", "standard-fp32"),
    ("fused-int8-dynamic", "standard-int8-dynamic"),
    ("fused-int4", "standard-int4"),
    ("fused-int4", "fused-int4-head4"),
]


def edgelm(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "edgelm", *args], check=True, stdout=subprocess.DEVNULL)


def build(checkpoint: Path, out: Path) -> dict[str, Path]:
    packages = {}
    for name, (attention, mode, extra) in PACKAGES.items():
        path = out / name
        if not path.exists():
            print(f"building {name} ...", flush=True)
            source = out / f"{attention}-fp32"
            if mode is None:
                edgelm("export", str(checkpoint), str(path), "--attention", attention)
            else:
                edgelm("quantize", str(source), str(path), "--mode", mode, "--no-eval", *extra)
        packages[name] = path
    return packages


def bench(name: str, package: Path, prompt_tokens: int, args) -> ab.Variant:
    """`edgelm bench --json` on one package, a child process per round."""
    command = [sys.executable, "-m", "edgelm", "bench", str(package), "--json", "--no-verify"]
    command += ["--prompt-tokens", str(prompt_tokens), "--new-tokens", str(args.new_tokens)]
    command += ["--threads", str(args.threads), "--repeats", "1"]
    return ab.command(name, command)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(REPO / "out" / "peers" / "gpt2" / "checkpoint"))
    parser.add_argument("--out", default=str(REPO / "out" / "levers"))
    parser.add_argument("--prompt-tokens", default="32,512")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    checkpoint, out = Path(args.checkpoint), Path(args.out)
    if not (checkpoint / "config.json").is_file():
        message = f"no checkpoint at {checkpoint}: run benchmarks/peers/peers.py first, or pass --checkpoint"
        print(message, file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    packages = build(checkpoint, out)
    results: dict = {}
    levers: dict = {}
    keys = ("decode_tokens_per_s", "time_to_first_token_s", "runtime_overhead_pct", "size_mb")
    for prompt_tokens in [int(n) for n in args.prompt_tokens.split(",")]:
        print(f"[{prompt_tokens}-token prompt]", flush=True)
        variants = [bench(name, path, prompt_tokens, args) for name, path in packages.items()]
        result = ab.run(variants, rounds=args.rounds)
        results[prompt_tokens] = {name: {key: m[key] for key in keys} for name, m in result["medians"].items()}
        levers[prompt_tokens] = {
            f"{first} / {second}": {key: ab.between(result, first, second, key)["median"] for key in keys[:2]}
            for first, second in PAIRS
        }
    report = {"args": vars(args), "results": results, "levers": levers}
    (out / "levers.json").write_text(json.dumps(report, indent=2))

    print(f"\nmedians of {args.rounds} rounds, {args.threads} threads, {args.new_tokens} new tokens\n")
    print("| prompt | package | decode tokens/s | first token ms | runtime overhead | size MB |")
    print("|---|---|---|---|---|---|")
    for prompt_tokens, rows in results.items():
        for name, r in rows.items():
            print(
                f"| {prompt_tokens} | {name} | {r['decode_tokens_per_s']:.1f} | "
                f"{1000 * r['time_to_first_token_s']:.1f} | {r['runtime_overhead_pct']:.1f}% | {r['size_mb']:.0f} |"
            )
    print("\n| prompt | lever | decode tokens/s ratio | first token ratio |\n|---|---|---|---|")
    for prompt_tokens, pairs in levers.items():
        for lever, ratio in pairs.items():
            rate, ttft = ratio["decode_tokens_per_s"], ratio["time_to_first_token_s"]
            print(f"| {prompt_tokens} | {lever} | {rate:.2f}x | {ttft:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
