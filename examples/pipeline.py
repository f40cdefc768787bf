"""The whole pipeline on the bundled model: export, quantize (dynamic and static int8), generate.

    python examples/pipeline.py [--out out] [--checkpoint models/shakespeare]

Writes out/fp32, out/int8-dynamic and out/int8-static, prints each quantized package's accuracy
against fp32 on the held-out text, then three samples per package (greedy, top-k, temperature)
with their speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgelm.export.onnx_export import export_package
from edgelm.quantize.quantize import quantize_package
from edgelm.runtime import load

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"
PROMPT = "ROMEO:\n"
SAMPLERS = [
    ("greedy", dict(temperature=0.0, repetition_penalty=1.1)),
    ("top-k 40, T=0.8", dict(temperature=0.8, top_k=40, seed=1)),
    ("temperature 1.0", dict(temperature=1.0, seed=2)),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(REPO / "models" / "shakespeare"))
    parser.add_argument("--out", default=str(REPO / "out"))
    parser.add_argument("--max-new-tokens", type=int, default=60)
    args = parser.parse_args()
    out = Path(args.out)

    print("== export")
    export_package(args.checkpoint, out / "fp32", last_token_logits=False, overwrite=True)
    for mode in ("dynamic", "static"):
        print(f"\n== quantize {mode}")
        quantize_package(
            out / "fp32",
            out / f"int8-{mode}",
            mode=mode,
            overwrite=True,
            calibration_text=DATA / "shakespeare-calibration.txt",
            eval_text=DATA / "shakespeare-heldout.txt",
        )

    for name in ("fp32", "int8-dynamic", "int8-static"):
        model = load(out / name, provider="cpu")
        size = model.info()["size_bytes"] / 1e6
        print(f"\n== generate: {name} ({size:.1f} MB)")
        for label, options in SAMPLERS:
            result = model.generate(PROMPT, args.max_new_tokens, **options)
            t = result.timings
            print(
                f"--- {label}: {t.decode_tokens_per_s:.0f} tokens/s, first token "
                f"{t.time_to_first_token_s * 1000:.1f} ms, finish {result.finish_reason}"
            )
            print(PROMPT + result.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
