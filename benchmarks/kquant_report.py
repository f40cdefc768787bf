"""A llama.cpp K-quant GGUF kept as MatMulNBits (export/gguf_blocks.py): size, accuracy and speed.

    python benchmarks/kquant_report.py FILE.gguf [--out /tmp/kquant] [--tokens 2048] [--rounds 3]
                                       [--prompt-tokens 32,512] [--new-tokens 128] [--threads 2]
                                       [--llamacpp-python /work/llamacpp-venv/bin/python]

Exports FILE three ways (kept blocks at accuracy level 4, the default; kept at level 0, float activations;
--dequantize, fp32), then:
- size: each package against the file;
- accuracy: logits on --tokens held-out tokens (data/shakespeare-heldout.txt, windows of 512 from a cold
  cache) of level 4 and of the fp32 package against level 0: max |logit difference| and top-1 agreement;
- speed: edgelm's level-4 package and llama.cpp (llama-cpp-python) on the same FILE, each in a child
  process of its own (benchmarks/peers/peer_runner.py bench_in_child: one warm-up, median of 3 generations), round-robin
  over --rounds rounds and both prompt lengths, greedy, --new-tokens tokens past EOS; time to first token and
  decode tokens/s, and edgelm / llama.cpp per round (benchmarks/ab.py).
Prints one JSON report (and writes it to OUT/report.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "peers")]
HELDOUT = REPO / "data" / "shakespeare-heldout.txt"
WINDOW = 512


def export(gguf: Path, out: Path, *flags: str) -> Path:
    if not (out / "edgelm.json").is_file():
        command = [sys.executable, "-m", "edgelm.cli", "export", str(gguf), str(out), "--overwrite", *flags]
        subprocess.run(command, check=True)
    return out


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir()) / 1e6


def accuracy(packages: dict[str, Path], reference: str, tokens: int) -> dict:
    """Against `reference`: max |logit difference| and top-1 agreement over `tokens` held-out tokens."""
    from edgelm.runtime import load

    models = {name: load(path, provider="cpu") for name, path in packages.items()}
    ids = np.array(models[reference].tokenizer.encode(HELDOUT.read_text(encoding="utf-8")), dtype=np.int64)
    ids = ids[: tokens - tokens % WINDOW].reshape(-1, WINDOW)  # (windows, 512)
    report = {name: {"max_abs_logit_diff": 0.0, "agree": 0} for name in models if name != reference}
    for window in ids:
        expected = models[reference].forward(window[None])[0][0]  # (512, V)
        for name in report:
            logits = models[name].forward(window[None])[0][0]
            report[name]["max_abs_logit_diff"] = max(
                report[name]["max_abs_logit_diff"], float(np.abs(logits - expected).max())
            )
            report[name]["agree"] += int((logits.argmax(-1) == expected.argmax(-1)).sum())
    for entry in report.values():
        entry["top1_agreement"] = entry.pop("agree") / ids.size
    report["tokens"] = int(ids.size)
    return report


def _bench(child: str, path: Path, prompt_file: Path, child_args, python: str) -> dict:
    import peer_runner

    report = peer_runner.bench_in_child(child, path, prompt_file, child_args, python=python)
    if "error" in report:
        raise RuntimeError(report["error"])
    report.pop("token_ids", None)
    return report


def speed(package: Path, gguf: Path, args) -> dict:
    import ab

    child_args = argparse.Namespace(threads=args.threads, new_tokens=args.new_tokens, repeats=3)
    vocab = 49152
    rows = {}
    for length in args.prompt_tokens:
        prompt = np.random.default_rng(0).integers(100, vocab, length).tolist()
        prompt_file = args.out / f"prompt-{length}.json"
        prompt_file.write_text(json.dumps(prompt))
        variants = [
            ab.here("edgelm", _bench, "edgelm", package, prompt_file, child_args, sys.executable),
            ab.here("llamacpp", _bench, "llamacpp", gguf, prompt_file, child_args, args.llamacpp_python),
        ]
        result = ab.run(variants, rounds=args.rounds, baseline="llamacpp", progress=None)
        rounds = [dict(zip(result["runs"], one, strict=True)) for one in zip(*result["runs"].values(), strict=True)]
        ratio = result["ratios"]["edgelm"]["decode_tokens_per_s"]["per_round"]
        ttft = [1 / r for r in result["ratios"]["edgelm"]["ttft_s"]["per_round"]]  # llama.cpp's over edgelm's
        rows[length] = {
            "edgelm_decode_tokens_per_s": result["medians"]["edgelm"]["decode_tokens_per_s"],
            "llamacpp_decode_tokens_per_s": result["medians"]["llamacpp"]["decode_tokens_per_s"],
            "edgelm_ttft_ms": 1000 * result["medians"]["edgelm"]["ttft_s"],
            "llamacpp_ttft_ms": 1000 * result["medians"]["llamacpp"]["ttft_s"],
            "decode_ratio_per_round": ratio,
            "decode_ratio_median": result["ratios"]["edgelm"]["decode_tokens_per_s"]["median"],
            "ttft_speedup_median": statistics.median(ttft),
            "other_cpu_pct": [round(r["edgelm"]["other_cpu_pct"], 1) for r in rounds],
            "rounds": rounds,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kquant"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[32, 512])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: accuracy, speed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.gguf.stem
    packages = {
        "level4": export(args.gguf, args.out / f"{stem}-l4"),
        "level0": export(args.gguf, args.out / f"{stem}-l0", "--accuracy-level", "0"),
        "fp32": export(args.gguf, args.out / f"{stem}-fp32", "--dequantize"),
    }
    file_mb = args.gguf.stat().st_size / 1e6
    report = {
        "file": args.gguf.name,
        "cpu": cpu_name(),
        "file_mb": round(file_mb, 1),
        "package_mb": {name: round(size_mb(path), 1) for name, path in packages.items()},
        "package_over_file": {name: round(size_mb(path) / file_mb, 3) for name, path in packages.items()},
        "recipe": json.loads((packages["level4"] / "edgelm.json").read_text())["recipe"],
    }
    if "accuracy" not in args.skip:
        report["against_level0"] = accuracy(packages, "level0", args.tokens)
    if "speed" not in args.skip:
        report["speed"] = speed(packages["level4"], args.gguf, args)
    (args.out / f"{stem}-report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "speed"}, indent=2))
    for length, row in report.get("speed", {}).items():
        print(length, json.dumps({k: v for k, v in row.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
