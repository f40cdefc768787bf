"""Where a decode step of an edgelm package spends its time: ONNX Runtime's ops, and the Python loop.

    python benchmarks/profile_decode.py PACKAGE [--threads 2] [--prompt-tokens 32] [--new-tokens 64]

Three views of the same greedy generation (prompt of random ids, EOS ignored), the prompt pass left out:
1. wall time per decode step, and the part of it spent inside `run_with_iobinding` (the rest is the
   runtime's Python: binding, sampling, bookkeeping);
2. ONNX Runtime's own profiler (SessionOptions.enable_profiling) summed by op type, per decode step;
3. cProfile of the whole loop, the Python functions with the most time of their own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgelm.runtime import load
from edgelm.runtime.bench import TimedSession


def profiling_session(model_path: Path, threads: int, folder: str) -> ort.InferenceSession:
    """The runtime's session options (see runtime/model.py) plus ONNX Runtime's profiler."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(folder) / "ort")
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def op_times(trace_file: str) -> tuple[dict[str, float], dict[str, float], list[float]]:
    """Kernel microseconds by op type and by node over the decode runs (every run after the first),
    and each decode run's total microseconds inside ONNX Runtime."""
    events = json.loads(Path(trace_file).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    decode = runs[1:]
    start = decode[0]["ts"] if decode else float("inf")
    by_op: dict[str, float] = defaultdict(float)
    by_node: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            by_op[e["args"].get("op_name", "?")] += e["dur"]
            by_node[f"{e['name'].removesuffix('_kernel_time')} ({e['args'].get('op_name', '?')})"] += e["dur"]
    return dict(by_op), dict(by_node), [r["dur"] for r in decode]


def wall_against_inside(model, prompt: list[int], args) -> None:
    """1. Wall time per decode step against the time inside ONNX Runtime."""
    timed = TimedSession(model.session)
    model.session = timed
    result = model.generate(prompt, args.new_tokens, ignore_eos=True)
    model.session = timed._session
    steps = len(timed.run_seconds) - 1
    decode_wall = result.timings.total_s - result.timings.time_to_first_token_s
    inside = sum(timed.run_seconds[1:])
    print(f"{args.package}: {args.threads} threads, {args.prompt_tokens}-token prompt, {steps} decode steps")
    print(f"  {result.timings.decode_tokens_per_s:.1f} tokens/s; per decode step {1000 * decode_wall / steps:.2f} ms")
    print(
        f"  inside run_with_iobinding {1000 * inside / steps:.2f} ms, outside (Python loop) "
        f"{1000 * (decode_wall - inside) / steps:.2f} ms ({100 * (1 - inside / decode_wall):.1f}%)"
    )


def onnxruntime_profile(model, prompt: list[int], args) -> None:
    """2. ONNX Runtime's profiler, by op type and by node."""
    session = model.session
    with tempfile.TemporaryDirectory() as folder:
        model.session = profiling_session(model.spec.model_path, args.threads, folder)
        model.generate(prompt, args.new_tokens, ignore_eos=True)
        by_op, by_node, run_us = op_times(model.session.end_profiling())
        model.session = session
    kernels = sum(by_op.values())
    print(f"\n  ONNX Runtime profiler, per decode step: model_run {np.median(run_us) / 1000:.2f} ms (median),")
    print(f"  kernels {kernels / len(run_us) / 1000:.2f} ms (mean); the rest is the executor's own work\n")
    print("  | op type | ms per step | share of kernel time |\n  |---|---|---|")
    for op, us in sorted(by_op.items(), key=lambda item: -item[1])[:12]:
        print(f"  | {op} | {us / len(run_us) / 1000:.3f} | {100 * us / kernels:.1f}% |")
    print("\n  | node (op type) | ms per step | share of kernel time |\n  |---|---|---|")
    for node, us in sorted(by_node.items(), key=lambda item: -item[1])[:8]:
        print(f"  | {node} | {us / len(run_us) / 1000:.3f} | {100 * us / kernels:.1f}% |")


def python_profile(model, prompt: list[int], args) -> None:
    """3. cProfile of the Python loop, by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    model.generate(prompt, args.new_tokens, ignore_eos=True)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    print("\n  cProfile, by own time:\n")
    print("\n".join("  " + line for line in text.getvalue().splitlines() if line.strip()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model = load(args.package, provider="cpu", threads=args.threads)
    prompt = np.random.default_rng(0).integers(0, model.vocab_size, args.prompt_tokens).tolist()
    model.generate(prompt, 4, ignore_eos=True)  # warm-up
    wall_against_inside(model, prompt, args)
    onnxruntime_profile(model, prompt, args)
    python_profile(model, prompt, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
