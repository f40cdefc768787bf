"""Export, quantize and bench a GPT-2 124M-shaped model with random weights, side by side in one run.

    python benchmarks/gpt2_124m.py [--out out/gpt2-124m] [--threads 2] [--new-tokens 128]

No download: the checkpoint is GPT-2's configuration with random weights, written in Hugging Face's
layout by edgelm itself. Random weights say nothing about accuracy, only about speed and size; the
bundled model's tokenizer is copied in so static calibration has text to read (its ids are a subset
of GPT-2's vocabulary). Prints a markdown table; docs/benchmarks.md records one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_checkpoint(folder: Path) -> None:
    import torch

    from edgelm.export.families.gpt2 import save_checkpoint
    from edgelm.export.models.gpt2 import GPT, PRESETS, GPTConfig

    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig(**PRESETS["gpt2"])).eval(), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(REPO / "models" / "shakespeare" / name, folder / name)


def timed_export(checkpoint: Path, out: Path) -> dict:
    """Export in a child process so its wall time and peak memory are its own."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "edgelm", "export", str(checkpoint), str(out), "--overwrite"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"export_s": wall, "export_peak_rss_mb": peak_kb / 1024}


def bench_in_child(package: Path, args) -> dict:
    """One package per child process: load time and peak RSS are then that package's alone."""
    command = [
        sys.executable,
        "-m",
        "edgelm",
        "bench",
        str(package),
        "--json",
        "--threads",
        str(args.threads),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--new-tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
        "--provider",
        "cpu",
    ]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def quantize_all(out: Path, modes: list[str]) -> dict[str, Path]:
    """The fp32 package and its quantizations in each of `modes`, timed."""
    from edgelm.quantize.quantize import quantize_package

    packages = {"fp32": out / "fp32"}
    for mode in [m for m in modes if m != "fp32"]:
        print(f"quantizing {mode} ...", flush=True)
        started = time.perf_counter()
        quantize_package(
            out / "fp32",
            out / mode,
            mode=mode,
            overwrite=True,
            evaluate=False,
            calibration_text=REPO / "data" / "shakespeare-calibration.txt",
            calibration_samples=8,
            progress=lambda _: None,
        )
        print(f"  {time.perf_counter() - started:.1f} s", flush=True)
        packages[mode] = out / mode
    return packages


def print_table(rows: dict[str, dict], args) -> None:
    base = rows["fp32"]["decode_tokens_per_s"]
    print(
        f"\nGPT-2 124M (random weights), CPU, {args.threads} threads, batch 1, {args.prompt_tokens}-token prompt, "
        f"{args.new_tokens} new tokens, median of {args.repeats}\n"
    )
    print(
        "| package | size MB | load s | first token ms | decode tokens/s | vs fp32 | runtime overhead | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['size_mb']:.0f} | {r['load_s']:.2f} | {r['time_to_first_token_s'] * 1000:.1f} | "
            f"{r['decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s'] / base:.2f}x | "
            f"{r['runtime_overhead_pct']:.1f}% | {r['peak_rss_mb']:.0f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "out" / "gpt2-124m"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="fp32,dynamic,static,int4")
    args = parser.parse_args()
    out = Path(args.out)
    checkpoint = out / "checkpoint"
    if not (checkpoint / "model.safetensors").is_file():
        print("writing a random GPT-2 124M checkpoint ...", flush=True)
        make_checkpoint(checkpoint)
    print("exporting ...", flush=True)
    facts = timed_export(checkpoint, out / "fp32")
    print(f"  export {facts['export_s']:.1f} s, peak RSS {facts['export_peak_rss_mb']:.0f} MB", flush=True)
    packages = quantize_all(out, args.modes.split(","))
    rows = {}
    for name, package in packages.items():
        print(f"bench {name} ...", flush=True)
        rows[name] = bench_in_child(package, args)
    print_table(rows, args)
    print(f"\nexport: {facts['export_s']:.1f} s, peak RSS {facts['export_peak_rss_mb']:.0f} MB")
    (out / "results.json").write_text(json.dumps({"export": facts, "bench": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
