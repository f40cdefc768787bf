"""What each performance lever is worth, side by side in one run: packages of one GPT-2 checkpoint that
differ by one choice, benched alternately (round-robin, so drift on a shared machine hits all alike).

    python benchmarks/levers.py [--checkpoint out/peers/gpt2/checkpoint] [--out out/levers]
                                [--prompt-tokens 32,512] [--new-tokens 128] [--rounds 3] [--threads 2]

Pairs measured (every package built here from the checkpoint, or reused from --out):
- graph: the fused export (GroupQueryAttention, KV buffer updated in place) against the standard-ops
  export (past + new concatenated every step), at fp32, dynamic int8 and int4;
- int4 LM head: 8-bit (the default, for accuracy) against 4-bit.
Each row is the median over --rounds of `edgelm bench` figures (one child process per package and
round): decode tokens/s, time to first token, and the runtime's own share of a decode step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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


def bench(package: Path, prompt_tokens: int, args) -> dict:
    command = [sys.executable, "-m", "edgelm", "bench", str(package), "--json", "--no-verify"]
    command += ["--prompt-tokens", str(prompt_tokens), "--new-tokens", str(args.new_tokens)]
    command += ["--threads", str(args.threads), "--repeats", "1"]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


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
        print(f"no checkpoint at {checkpoint}: run benchmarks/peers.py first, or pass --checkpoint", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    packages = build(checkpoint, out)
    results: dict = {}
    for prompt_tokens in [int(n) for n in args.prompt_tokens.split(",")]:
        runs: dict[str, list[dict]] = {name: [] for name in packages}
        for round_ in range(args.rounds):
            for name, path in packages.items():
                print(f"[{prompt_tokens}-token prompt, round {round_ + 1}] {name}", flush=True)
                runs[name].append(bench(path, prompt_tokens, args))
        results[prompt_tokens] = {
            name: {
                key: statistics.median(r[key] for r in rows)
                for key in ("decode_tokens_per_s", "time_to_first_token_s", "runtime_overhead_pct", "size_mb")
            }
            for name, rows in runs.items()
        }
    (out / "levers.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))

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
    for prompt_tokens, rows in results.items():
        for first, second in PAIRS:
            a, b = rows[first], rows[second]
            rate = a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
            ttft = a["time_to_first_token_s"] / b["time_to_first_token_s"]
            print(f"| {prompt_tokens} | {first} / {second} | {rate:.2f}x | {ttft:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
