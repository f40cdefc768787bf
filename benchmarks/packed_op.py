"""One op, timed: edgelm's ai.edgelm.MatMulPacked on a GGUF type's raw rows against ONNX Runtime's MatMulNBits on the
same weights (what a plain package runs: 4 or 8 bits, the type's runs, accuracy_level 4), y = x W^T for M rows.

    .venv/bin/python benchmarks/packed_op.py --type Q4_K --n 2048 --k 2048 --m 1 --threads 2

Random blocks (finite float16 scales); prints the least disturbed time of a run of each and the bytes each reads a
call. `--instructions` counts instead the instructions a call executes (valgrind's callgrind over the op run 10 and
60 times, the difference over 50): a number the machine's load does not move, for comparing kernel changes.

    .venv/bin/python benchmarks/packed_op.py --type Q4_K --m 32 --threads 1 --instructions"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgelm.runtime import native
from edgelm.runtime.block_types import FORMATS, pack, unpacked

NAMES = {row.name: number for number, row in FORMATS.items()}


def random_rows(number: int, n: int, k: int, rng) -> np.ndarray:
    row = FORMATS[number]
    blocks = rng.integers(0, 256, (n * k // row.elems, row.bytes), dtype=np.uint8)
    halves = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}[number]
    for at in halves:
        blocks[:, at : at + 2] = (
            (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return blocks.reshape(n, -1)


def session(nodes, initializers, k: int, threads: int, library: str | None) -> ort.InferenceSession:
    graph = helper.make_graph(
        nodes, "op", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=initializers,
    )  # fmt: skip
    opsets = [
        helper.make_opsetid("", 17),
        helper.make_opsetid("com.microsoft", 1),
        helper.make_opsetid(native.DOMAIN, 1),
    ]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library:
        options.register_custom_ops_library(library)
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def timed(sessions: list[ort.InferenceSession], x: np.ndarray, seconds: float) -> list[float]:
    """The least disturbed time of a run of each session, taken in turn (the machine may be shared)."""
    feed = {"x": x}
    for s in sessions:
        for _ in range(5):
            s.run(None, feed)
    best, end = [float("inf")] * len(sessions), time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i, s in enumerate(sessions):
            start = time.perf_counter()
            s.run(None, feed)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def instructions(argv: list[str], which: str) -> float:
    """Instructions one call of `which` ("ours", "theirs") executes, from two callgrind runs of this script."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    counts = []
    for calls in (10, 60):
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "callgrind.out"
            command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__]
            command += [*argv, "--calls", str(calls), "--only", which]
            subprocess.run(command, check=True, capture_output=True)
            summary = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M)
            counts.append(int(summary.group(1)))
    return (counts[1] - counts[0]) / 50


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--type", default="Q4_K", choices=sorted(NAMES))
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--instructions", action="store_true", help="count instructions a call (valgrind) instead of timing")
    p.add_argument("--calls", type=int, help=argparse.SUPPRESS)  # the child of --instructions: run this many calls
    p.add_argument("--only", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.instructions:
        argv = [a for a in sys.argv[1:] if a != "--instructions"]
        ours, theirs = instructions(argv, "ours"), instructions(argv, "theirs")
        print(f"{args.type} N={args.n} K={args.k} M={args.m} threads={args.threads} (kernels: {native.best_isa()})")
        print(f"  instructions a call: MatMulPacked {ours / 1e6:.3f} M, MatMulNBits {theirs / 1e6:.3f} M")
        print(f"  ratio (MatMulNBits / MatMulPacked): {theirs / ours:.2f}x")
        return 0
    number, rng = NAMES[args.type], np.random.default_rng(0)
    rows = random_rows(number, args.n, args.k, rng)
    x = rng.standard_normal((args.m, args.k)).astype(np.float32)
    fmt = FORMATS[number]
    packed = helper.make_node(
        "MatMulPacked", ["x", "rows"], ["y"], domain=native.DOMAIN, packed_type=number, N=args.n, K=args.k
    )
    ours = session([packed], [numpy_helper.from_array(rows, "rows")], args.k, args.threads, str(native.ops_library()))
    values, scales, offsets = unpacked(number, rows, args.k)
    b = pack(values, fmt.bits, fmt.block_size)
    nodes = [helper.make_node(
        "MatMulNBits", ["x", "B", "scales"], ["y" if offsets is None else "blocks"], domain="com.microsoft",
        K=args.k, N=args.n, bits=fmt.bits, block_size=fmt.block_size, accuracy_level=4,
    )]  # fmt: skip
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "scales")]
    if offsets is not None:  # w = scale * c + offset: (block sums of x) @ offsets beside, as export/graph_blocks.py
        runs = args.k // fmt.block_size
        inits += [
            numpy_helper.from_array(np.ascontiguousarray(offsets.T), "offsets"),
            numpy_helper.from_array(np.array([0, runs, fmt.block_size], np.int64), "shape"),
            numpy_helper.from_array(np.array([-1], np.int64), "axis"),
        ]
        nodes += [
            helper.make_node("Reshape", ["x", "shape"], ["xb"]),
            helper.make_node("ReduceSum", ["xb", "axis"], ["sums"], keepdims=0),
            helper.make_node("MatMul", ["sums", "offsets"], ["correction"]),
            helper.make_node("Add", ["blocks", "correction"], ["y"]),
        ]
    theirs = session(nodes, inits, args.k, args.threads, None)
    if args.calls:
        for _ in range(args.calls):
            (ours if args.only == "ours" else theirs).run(None, {"x": x})
        return 0
    t_ours, t_theirs = timed([ours, theirs], x, args.seconds)
    bytes_ours = rows.nbytes
    bytes_theirs = b.nbytes + scales.nbytes + (0 if offsets is None else offsets.nbytes)
    print(f"{args.type} N={args.n} K={args.k} M={args.m} threads={args.threads} (kernels: {native.best_isa()})")
    print(
        f"  MatMulPacked (edgelm)     {t_ours * 1e6:9.1f} us  {bytes_ours / 1e6:6.2f} MB  "
        f"{bytes_ours / t_ours / 1e9:5.1f} GB/s"
    )
    print(f"  MatMulNBits (ORT, level 4) {t_theirs * 1e6:8.1f} us  {bytes_theirs / 1e6:6.2f} MB")
    print(f"  ratio (MatMulNBits time / MatMulPacked time): {t_theirs / t_ours:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
