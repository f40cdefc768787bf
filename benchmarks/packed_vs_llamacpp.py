"""Packed GGUF blocks (issue 45) against llama.cpp on the same file: decode tok/s, first token, load time, peak RSS
and bytes read a token, for edgelm's packed package on its native kernels, the same package on its fallback
(EDGELM_NATIVE=0), today's MatMulNBits package, and llama.cpp (llama-cpp-python in --llamacpp-python).

    python benchmarks/packed_vs_llamacpp.py make FILE.gguf [FILE.gguf ...] [--dir D]     # the packages, once
    python benchmarks/packed_vs_llamacpp.py time FILE.gguf [...] [--dir D] [--results R] [--rounds 3]
                                                [--prompt-tokens 32,512] [--new-tokens 128] [--threads 2]
                                                [--systems packed,fallback,plain,llamacpp]
    python benchmarks/packed_vs_llamacpp.py report [--results R]

Files: benchmarks/real_sizes.py's shaped files (Qwen3-0.6B / Llama-3.2-1B / Qwen3-4B as Q4_K_M, Q5_K_M, Q6_K,
Q4_0, Q8_0, made by llama.cpp's own tools) and the real Gemma 3 270M and SmolLM2 files (~/.cache/edgelm). Each
system runs in a child process of its own (benchmarks/peers/peer_runner.py), round-robin, the order alternating; every
measurement is one JSON line in --results (a re-run skips what it holds). `report` prints medians and the median of
per-round ratios against llama.cpp with the load average the rounds ran at: time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import peer_runner  # noqa: E402
from peer_common import folder_bytes  # noqa: E402

from edgelm.export.onnx_export import export_package  # noqa: E402

REPO = HERE.parent
SYSTEMS = ("packed", "fallback", "plain", "llamacpp")  # the fallback is the packed package with EDGELM_NATIVE=0


def packages(gguf: Path, root: Path) -> dict[str, Path]:
    stem = gguf.stem
    return {"packed": root / f"pkg-{stem}-packed", "plain": root / f"pkg-{stem}-plain"}


def make(files: list[Path], root: Path) -> None:
    for gguf in files:
        for kind, folder in packages(gguf, root).items():
            if not (folder / "edgelm.json").is_file():
                # a file whose level-4 proof misses the default tolerance (Gemma 3's plain package) is timed anyway
                export_package(gguf, folder, packed_blocks=kind == "packed", tolerance=20.0)


def bytes_a_token(folder: Path) -> int:
    """Bytes of the initializers every decode step reads: the weights of MatMul, MatMulNBits and MatMulPacked nodes
    (an embedding's gathered rows are a few a token, left out)."""
    import numpy as np
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    sizes = {}
    for tensor in model.graph.initializer:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        sizes[tensor.name] = int(np.prod(tensor.dims, dtype=np.int64)) * itemsize
    read = set()
    for node in model.graph.node:
        if node.op_type in ("MatMul", "MatMulNBits", "MatMulPacked"):
            read.update(name for name in node.input[1:] if name in sizes)
    return sum(sizes[name] for name in read)


def measure(files: list[Path], root: Path, args) -> None:
    done = set()
    if args.results.is_file():
        for line in args.results.read_text().splitlines():
            r = json.loads(line)
            done.add((r["file"], r["prompt_tokens"], r["round"], r["system"]))
    child_args = argparse.Namespace(threads=args.threads, new_tokens=args.new_tokens, repeats=1)
    for tokens in args.prompt_tokens:
        prompt = root / f"prompt-{tokens}.json"
        if not prompt.is_file():
            prompt.write_text(json.dumps([(17 + 7919 * i) % 30000 + 100 for i in range(tokens)]))
        for round_ in range(args.rounds):
            for i, gguf in enumerate(files):
                order = list(args.systems) if (round_ + i) % 2 == 0 else list(reversed(args.systems))
                for system in order:
                    key = (gguf.name, tokens, round_, system)
                    if key in done:
                        continue
                    folder = packages(gguf, root).get("packed" if system == "fallback" else system, gguf)
                    child = "llamacpp" if system == "llamacpp" else "edgelm"
                    python = str(args.llamacpp_python) if system == "llamacpp" else sys.executable
                    os.environ["EDGELM_NATIVE"] = "0" if system == "fallback" else "1"
                    load = os.getloadavg()[0]
                    report = peer_runner.bench_in_child(child, folder, prompt, child_args, python=python)
                    report.pop("token_ids", None)
                    report.update(file=gguf.name, prompt_tokens=tokens, round=round_, system=system, load_average=load)
                    report["size_mb"] = (gguf.stat().st_size if system == "llamacpp" else folder_bytes(folder)) / 1e6
                    if system != "llamacpp":
                        report["bytes_a_token_mb"] = bytes_a_token(folder) / 1e6
                    with args.results.open("a") as out:
                        out.write(json.dumps(report) + "\n")
                    print(key, {k: report.get(k) for k in ("decode_tokens_per_s", "ttft_s", "error")}, flush=True)
    os.environ.pop("EDGELM_NATIVE", None)


def report(results: Path) -> str:
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    rows = [r for r in rows if "error" not in r]
    lines = [
        "| file | P | system | decode tok/s | x llama.cpp | first token ms | load s | peak RSS MB | size MB "
        "| MB a token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["file"], r["prompt_tokens"]) for r in rows})
    for file, tokens in keys:
        mine = [r for r in rows if r["file"] == file and r["prompt_tokens"] == tokens]
        peer = {r["round"]: r for r in mine if r["system"] == "llamacpp"}
        for system in SYSTEMS:
            these = [r for r in mine if r["system"] == system]
            if not these:
                continue
            med = lambda k, these=these: (
                statistics.median(r[k] for r in these if k in r) if any(k in r for r in these) else float("nan")
            )
            ratios = [
                r["decode_tokens_per_s"] / peer[r["round"]]["decode_tokens_per_s"] for r in these if r["round"] in peer
            ]
            ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
            lines.append(
                f"| {file} | {tokens} | {system} | {med('decode_tokens_per_s'):.1f} | {ratio} | "
                f"{1000 * med('ttft_s'):.0f} | {med('load_s'):.2f} | {med('peak_rss_mb'):.0f} | {med('size_mb'):.0f} | "
                f"{med('bytes_a_token_mb'):.0f} |"
            )
    loads = [r["load_average"] for r in rows]
    lines.append(f"\nload average while timing: {min(loads):.1f}-{max(loads):.1f}" if loads else "")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("make", "time", "report"))
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--dir", type=Path, default=REPO / "packages" / "packed")
    p.add_argument("--results", type=Path, help="the measurements' JSON lines (default: DIR/results.jsonl)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[32, 512])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--systems", type=lambda s: s.split(","), default=list(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}"
    )
    p.add_argument("--llamacpp-python", type=Path, default=Path("/work/main/.venv-llamacpp/bin/python"))
    args = p.parse_args()
    args.results = args.results or args.dir / "results.jsonl"
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.command == "report":
        print(report(args.results))
        return 0
    make(args.files, args.dir)
    if args.command == "time":
        started = time.perf_counter()
        measure(args.files, args.dir, args)
        print(f"timed in {time.perf_counter() - started:.0f} s")
        print(report(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
