"""onnxruntime-genai on its own model builder's export, a peer for benchmarks/peers/peers.py (Llama family).

`python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p fp32|int4 -e cpu` is what Microsoft ships
these models with: its own fused graph (GroupQueryAttention, SkipSimplifiedLayerNormalization, RotaryEmbedding
inside the attention op) and its genai_config.json, so genai runs it with nothing added. The int4 is the
builder's default CPU recipe: MatMulNBits, block 32, symmetric, accuracy level 4, every MatMul including
the LM head. The builder has no GPT-2 family; for GPT-2, genai runs on the Optimum export instead.

The builder needs transformers 5 and a tokenizer in the input folder; it runs offline (HF_HUB_OFFLINE=1)
on a local folder.

    python benchmarks/peers/genai_builder_peer.py FOLDER OUT --precision fp32|int4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PRECISIONS = {"fp32": "fp32", "int4": "int4"}  # benchmark precision -> the builder's -p
FAMILIES = ("llama",)  # config.json model_type values this peer is run on (the builder takes more)


def build_command(checkpoint: Path, package: Path, *, precision: str, cache: Path) -> list[str]:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(package)]
    return command + ["-p", PRECISIONS[precision], "-e", "cpu", "-c", str(cache)]


def build_packages(checkpoint: Path, out: Path, *, rebuild: bool) -> dict[str, dict]:
    """The builder's fp32 and int4 export of `checkpoint`, each in a child process, in
    out/genai-builder-PRECISION/; returns precision -> {"path", "recipe"}."""
    model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"the genai model builder peer runs on {', '.join(FAMILIES)} checkpoints, not {model_type!r}")
    if not (checkpoint / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{checkpoint} has no tokenizer.json: onnxruntime-genai's builder needs one")
    packages = {}
    for precision in PRECISIONS:
        package = out / f"genai-builder-{precision}"
        command = build_command(checkpoint, package, precision=precision, cache=out / "genai-builder-cache")
        recipe = " ".join(["python", *command[1:]])
        if (package / "genai_config.json").is_file() and not rebuild:
            print(f"  {package.name}: reusing (--rebuild to redo)", flush=True)
        else:
            shutil.rmtree(package, ignore_errors=True)
            started = time.perf_counter()
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"onnxruntime-genai's model builder failed ({precision}): {last}")
            print(f"  {package.name}: {time.perf_counter() - started:.1f} s", flush=True)
        packages[precision] = {"path": package, "recipe": recipe}
    return packages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a Hugging Face folder with config.json and tokenizer.json")
    parser.add_argument("out", type=Path, help="the folder the builder's packages go in")
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()
    for precision, package in build_packages(args.checkpoint, args.out, rebuild=args.rebuild).items():
        print(f"{precision}: {package['path']}  ({package['recipe']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
