"""Cheap levers on an edgelm package, without touching the export: ONNX Runtime session options, and packages
that differ by one quantization choice, benched alternately (round-robin, one child process per variant and
round) so that drift on a shared machine hits all alike.

    python benchmarks/experiments/session_levers.py BASE [--package NAME=FOLDER ...] [--options] [--rounds 3]
                                        [--prompt-tokens 32] [--new-tokens 128] [--threads 2]

Variants: BASE with the runtime's own session (runtime/session.py), each --package folder with it, and with
--options BASE under each of SESSION_VARIANTS. Packages are loaded without the sha256 check (a lever made
by editing model.onnx no longer matches its manifest). Prints medians of decode tokens/s and first token, and the
median of each variant's per-round ratios to base (benchmarks/ab.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the A/B harness
import ab  # noqa: E402

SESSION_VARIANTS = {
    "same-options": {"session.intra_op.allow_spinning": "1"},  # ORT's default: a control for the session swap
    "no-spinning": {"session.intra_op.allow_spinning": "0"},
    "extended-opt": {"graph_optimization_level": "extended"},
    "no-mem-pattern": {"enable_mem_pattern": "0"},
    "dynamic-block-4": {"session.dynamic_block_base": "4"},
    "1-thread": {"intra_op_num_threads": "1"},
}


def child(package: str, options: dict, args) -> dict:
    import numpy as np
    import onnxruntime as ort

    from edgelm.runtime import load

    model = load(package, provider="cpu", threads=args.threads, verify=False)
    if options:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = args.threads, 1, 3
        for key, value in options.items():
            if key == "graph_optimization_level":
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            elif key == "enable_mem_pattern":
                so.enable_mem_pattern = value == "1"
            elif key == "intra_op_num_threads":
                so.intra_op_num_threads = int(value)
            else:
                so.add_session_config_entry(key, value)
        model.session = ort.InferenceSession(str(model.spec.model_path), so, providers=["CPUExecutionProvider"])
    prompt = np.random.default_rng(args.prompt_tokens).integers(0, model.vocab_size, args.prompt_tokens).tolist()
    model.generate(prompt, 4, ignore_eos=True)
    t = model.generate(prompt, args.new_tokens, ignore_eos=True).timings
    return {"decode_tokens_per_s": t.decode_tokens_per_s, "ttft_s": t.time_to_first_token_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("--package", action="append", default=[], help="NAME=FOLDER, benched with BASE")
    parser.add_argument("--options", action="store_true", help="also BASE under each session variant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        package, options = json.loads(args.child)
        print(json.dumps(child(package, options, args)))
        return 0
    variants = {"base": (args.base, {})}
    variants |= {name: (folder, {}) for name, folder in (p.split("=", 1) for p in args.package)}
    if args.options:
        variants |= {name: (args.base, options) for name, options in SESSION_VARIANTS.items()}
    common = ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    common += ["--threads", str(args.threads)]
    children = [
        ab.command(name, [sys.executable, __file__, args.base, *common, "--child", json.dumps(variant)])
        for name, variant in variants.items()
    ]
    started = time.perf_counter()
    result = ab.run(children, rounds=args.rounds, baseline="base")
    print(f"\n{args.base}: {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {args.threads} threads,")
    print(f"medians of {args.rounds} alternating rounds ({time.perf_counter() - started:.0f} s)\n")
    print("| variant | decode tokens/s | vs base (median of per-round ratios) | first token ms |\n|---|---|---|---|")
    for name, medians in result["medians"].items():
        ratio = result["ratios"][name]["decode_tokens_per_s"]["median"]
        print(f"| {name} | {medians['decode_tokens_per_s']:.1f} | {ratio:.2f}x | {1000 * medians['ttft_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
