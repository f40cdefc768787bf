"""Where the memory and a decode step of a kept K-quant package go at real sizes (issue 34; docs/benchmarks.md,
"Real sizes: where a K-quant step goes").

    python benchmarks/kquant_step.py memory PACKAGE            # edgelm: load, RSS after it, peak, 16 tokens
    /work/venv-llamacpp/bin/python benchmarks/kquant_step.py memory FILE.gguf   # the same for llama.cpp
    python benchmarks/kquant_step.py session PACKAGE           # ONNX Runtime alone, as runtime/ did before
    python benchmarks/kquant_step.py profile PACKAGE --threads 1 --new-tokens 24

`memory` and `session` read /proc/self/status (Linux): resident set after the load, split into anonymous memory
(prepacked copies, the heap) and mapped file pages, and the peak (VmHWM). `session` builds a bare
InferenceSession and asks glibc for its freed heap (malloc_trim), which is all runtime/session.py did before it
dropped the mapped weight pages. `profile` sums ONNX Runtime's profiler by part of the step: the LM head's
MatMulNBits, the body's, the block offsets' (block sums of x) @ offsets terms, attention, the rest.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PROMPT = list(range(1000, 1032))


def status(key: str) -> float:
    """A /proc/self/status field in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def resident(what: str) -> str:
    return (
        f"{what}: RSS {status('VmRSS'):.0f} MB (anonymous {status('RssAnon'):.0f}, file {status('RssFile'):.0f}), "
        f"peak {status('VmHWM'):.0f} MB"
    )


def memory(path: str, threads: int) -> None:
    started = time.perf_counter()
    if path.endswith(".gguf"):
        from llama_cpp import Llama

        model = Llama(path, n_ctx=256, n_threads=threads, n_batch=64, verbose=False)
        print(f"llama.cpp load {time.perf_counter() - started:.1f} s; " + resident("after the load"))
        model.eval(PROMPT)
        for _ in range(16):
            model.eval([model.sample(temp=0.0)])
    else:
        from edgelm.runtime import load

        model = load(path, provider="cpu", threads=threads)
        print(f"edgelm load {time.perf_counter() - started:.1f} s; " + resident("after the load"))
        model.generate(PROMPT, 16, ignore_eos=True)
    print(resident("after 16 tokens"))


def session(path: str, threads: int) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    before = status("VmRSS")
    started = time.perf_counter()
    kept = ort.InferenceSession(str(Path(path) / "model.onnx"), options, providers=["CPUExecutionProvider"])
    built = time.perf_counter() - started
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(f"session built in {built:.1f} s from {before:.0f} MB; " + resident("trimmed"))
    del kept


def part(node: str, op: str) -> str:
    """The part of a decode step a node of the fused graph (export/graph.py) belongs to."""
    if op == "MatMulNBits":
        return "LM head (MatMulNBits)" if node.startswith("logits") else "body linears (MatMulNBits)"
    if node.endswith(("/offsets", "/ReduceSum")) or (op == "Add" and node.endswith("/MatMulNBits")):
        return "block offsets (ReduceSum, MatMul, Add)"
    if op == "GroupQueryAttention":
        return "attention (GroupQueryAttention)"
    return "the rest"


def profile(path: str, threads: int, new_tokens: int) -> None:
    from profile_decode import op_times, profiling_session

    from edgelm.runtime import load

    model = load(path, provider="cpu", threads=threads)
    with tempfile.TemporaryDirectory() as folder:
        model.session = profiling_session(model.spec.model_path, threads, folder)
        model.generate(PROMPT, new_tokens, ignore_eos=True)
        _, by_node, runs = op_times(model.session.end_profiling())
    parts: dict[str, float] = defaultdict(float)
    for key, us in by_node.items():
        node, op = key.removesuffix(")").rsplit(" (", 1)
        parts[part(node, op)] += us
    total = sum(parts.values())
    print(f"{path}: {threads} threads, {len(runs)} decode steps, kernels {total / len(runs) / 1000:.1f} ms a step")
    print("| part of the step | share of kernel time |\n|---|---|")
    for name, us in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"| {name} | {100 * us / total:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("memory", "session", "profile"))
    parser.add_argument("path", help="an edgelm package folder (or, for memory, a GGUF file: llama.cpp)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    if args.what == "memory":
        memory(args.path, args.threads)
    elif args.what == "session":
        session(args.path, args.threads)
    else:
        profile(args.path, args.threads, args.new_tokens)


if __name__ == "__main__":
    main()
