"""A few systems of benchmarks/peers/peers.py benched round-robin, for a ratio that holds on a busy machine.

peers.py runs each system once, one after another: when other work comes and goes during the run, rows
measured minutes apart are not comparable. Here each round runs every named system once (a child process
each, peers.py's own children), so drift hits all of them alike; the ratio is the median over rounds of
each round's ratio to the first system (benchmarks/ab.py).

    python benchmarks/peers/alternate_peers.py --out out/peers/smollm2-135m --prompt-tokens 32 --rounds 3 \
        edgelm=edgelm-int4 onnxruntime-genai=genai-builder-int4 llamacpp=llamacpp/model-q4_0.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the A/B harness
import ab  # noqa: E402
import llamacpp_peer  # noqa: E402
import peer_runner  # noqa: E402


def bench(child: str, path: Path, prompt_file: Path, args, python: str) -> dict:
    """One system once, in peers.py's own child; a failed child ends the run."""
    row = peer_runner.bench_in_child(child, path, prompt_file, args, python=python)
    if "error" in row:
        raise SystemExit(f"{child} {path}: FAILED {row['error']}")
    return row


def progress(round_index: int, spec: str, row: dict) -> None:
    print(
        f"round {round_index + 1} {spec}: {row['decode_tokens_per_s']:.1f} tokens/s, first token "
        f"{1000 * row['ttft_s']:.0f} ms, other processes {row['other_cpu_pct']:.0f}%",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("systems", nargs="+", help="CHILD=PATH, PATH relative to --out; the first is the baseline")
    parser.add_argument("--out", type=Path, required=True, help="a peers.py model folder (holds prompt-N.json)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llamacpp-python", type=Path, default=llamacpp_peer.LLAMACPP_PYTHON)
    args = parser.parse_args()
    args.repeats = 1
    prompt_file = args.out / f"prompt-{args.prompt_tokens}.json"
    if not prompt_file.is_file():
        parser.error(f"no {prompt_file}: run peers.py on this model first")
    variants = []
    for spec in args.systems:
        child, path = spec.split("=", 1)
        python = str(args.llamacpp_python) if child == "llamacpp" else sys.executable
        variants.append(ab.here(spec, bench, child, args.out / path, prompt_file, args, python))
    result = ab.run(variants, rounds=args.rounds, progress=progress)
    rows = result["runs"]
    print(
        f"\n{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {args.threads} threads, "
        f"{args.rounds} rounds\n"
    )
    print("| system | decode tokens/s (median) | per-round ratio to the first (median) | first token ms | other CPU |")
    print("|---|---|---|---|---|")
    for spec, medians in result["medians"].items():
        ratio = result["ratios"][spec]["decode_tokens_per_s"]["median"]
        print(
            f"| {spec} | {medians['decode_tokens_per_s']:.1f} | {ratio:.2f}x | "
            f"{1000 * medians['ttft_s']:.0f} | {medians['other_cpu_pct']:.0f}% |"
        )
    (args.out / f"alternate-{args.prompt_tokens}.json").write_text(
        json.dumps({"args": args.systems, "rows": rows}, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
