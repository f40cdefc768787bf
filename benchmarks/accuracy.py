"""Accuracy table of every quantization mode on the bundled model's held-out text.

    python benchmarks/accuracy.py [--out out/accuracy] [--calibration-method minmax]

Exports models/shakespeare, quantizes it in each mode, evaluates each package against the fp32 one
on data/shakespeare-heldout.txt (all of it, sliding windows of the context length) and prints a
markdown table: perplexity, bits per byte, ratio to fp32, top-1 agreement, mean KL, size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgelm.export.onnx_export import export_package
from edgelm.quantize.evaluate import evaluate_package
from edgelm.quantize.quantize import quantize_package

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "data" / "shakespeare-heldout.txt"
CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(REPO / "models" / "shakespeare"))
    parser.add_argument("--out", default=str(REPO / "out" / "accuracy"))
    parser.add_argument("--calibration-method", default="percentile")
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--modes", default="dynamic,static,int4")
    args = parser.parse_args()
    out = Path(args.out)
    quiet = lambda _: None
    export_package(args.checkpoint, out / "fp32", overwrite=True, progress=quiet)
    reports = {"fp32": evaluate_package(out / "fp32", HELDOUT)}
    for mode in args.modes.split(","):
        quantize_package(
            out / "fp32",
            out / mode,
            mode=mode,
            overwrite=True,
            evaluate=False,
            progress=quiet,
            calibration_text=CALIBRATION,
            calibration_method=args.calibration_method,
            calibration_samples=args.calibration_samples,
        )
        reports[mode] = evaluate_package(out / mode, HELDOUT, reference=out / "fp32")
    print(f"held-out: {HELDOUT.name}, {reports['fp32']['tokens']:,} tokens, {reports['fp32']['bytes']:,} bytes\n")
    print(
        "| package | perplexity | bits/byte | perplexity vs fp32 | top-1 agreement | mean KL (nats) | size MB | "
        "size vs fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in reports.items():
        ratio = f"{r['perplexity_ratio']:.4f}x" if "reference" in r else "1"
        agreement = f"{100 * r['top1_agreement']:.2f}%" if "reference" in r else "100%"
        kl = f"{r['mean_kl_nats']:.5f}" if "reference" in r else "0"
        size = f"{r['size_ratio']:.3f}" if "reference" in r else "1"
        print(
            f"| {name} | {r['perplexity']:.3f} | {r['bits_per_byte']:.4f} | {ratio} | {agreement} | {kl} | "
            f"{r['size_bytes'] / 1e6:.2f} | {size} |"
        )
    (out / "accuracy.json").write_text(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
