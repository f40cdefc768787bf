"""Accuracy table of every quantization mode on SmolLM2-135M-Instruct, the real Llama-family model.

    python benchmarks/smollm2_accuracy.py [--out out/smollm2] [--eval-tokens 2048]

Fetches the Q4_1 GGUF (scripts/fetch_smollm2.py), exports it to an fp32 package, quantizes it in each
mode that reports accuracy, each as `edgelm quantize` in a child process timed with its peak RSS, and
evaluates each package against the fp32 one on the first tokens of data/shakespeare-heldout.txt (as
`edgelm eval --max-tokens N --reference FP32`). Prints a markdown table: perplexity, ratio to fp32, top-1
agreement, mean KL, size, quantize time and peak RSS. Static int8 is calibrated on
data/general-calibration.txt (general English, a dialogue and some Python, unlike the held-out text).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from edgelm.quantize.evaluate import evaluate_package
from edgelm.quantize.quantize import RECIPES
from edgelm.runtime import load

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "data" / "shakespeare-heldout.txt"
CALIBRATION = REPO / "data" / "general-calibration.txt"
EVALUATED_MODES = [mode for mode, recipe in RECIPES.items() if recipe.evaluated]


def fetch_gguf() -> Path:
    spec = importlib.util.spec_from_file_location("fetch_smollm2", REPO / "scripts" / "fetch_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fetch_smollm2()


def timed_edgelm(*args: str) -> dict:
    """Run `edgelm ARGS` in a child process: wall seconds and the child's own peak RSS (os.wait4's rusage)."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "edgelm", *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"edgelm {' '.join(args)} exited with {child.returncode}")
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"seconds": time.perf_counter() - started, "peak_rss_bytes": usage.ru_maxrss * scale}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "out" / "smollm2"))
    parser.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens to score (default 2048)")
    parser.add_argument("--calibration-text", default=str(CALIBRATION))
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--modes", default=",".join(EVALUATED_MODES))
    args = parser.parse_args()
    out = Path(args.out)
    gguf = fetch_gguf()
    runs = {"fp32": timed_edgelm("export", str(gguf), str(out / "fp32"), "--dequantize", "--overwrite")}
    fp32 = load(out / "fp32", provider="cpu")
    reports = {"fp32": evaluate_package(fp32, HELDOUT, max_tokens=args.eval_tokens)}
    for mode in args.modes.split(","):
        runs[mode] = timed_edgelm(
            "quantize",
            str(out / "fp32"),
            str(out / mode),
            f"--mode={mode}",
            f"--calibration-text={args.calibration_text}",
            f"--calibration-samples={args.calibration_samples}",
            "--no-eval",
            "--overwrite",
        )
        reports[mode] = evaluate_package(out / mode, HELDOUT, reference=fp32, max_tokens=args.eval_tokens)
        reports[mode]["quantize"] = runs[mode]
    reports["fp32"]["export"] = runs["fp32"]

    first = reports["fp32"]
    print(f"held-out: the first {first['tokens']:,} tokens of {HELDOUT.name} ({first['bytes']:,} bytes)\n")
    print(
        "| package | perplexity | perplexity vs fp32 | top-1 agreement | mean KL (nats) | size MB | size vs fp32 | "
        "time s | peak RSS GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in reports.items():
        ratio = f"{r['perplexity_ratio']:.4f}x" if "reference" in r else "1"
        agreement = f"{100 * r['top1_agreement']:.2f}%" if "reference" in r else "100%"
        kl = f"{r['mean_kl_nats']:.5f}" if "reference" in r else "0"
        size = f"{r['size_ratio']:.3f}" if "reference" in r else "1"
        run = runs[name]
        print(
            f"| {name} | {r['perplexity']:.3f} | {ratio} | {agreement} | {kl} | {r['size_bytes'] / 1e6:.1f} | {size} | "
            f"{run['seconds']:.0f} | {run['peak_rss_bytes'] / 1e9:.2f} |"
        )
    (out / "accuracy.json").write_text(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
