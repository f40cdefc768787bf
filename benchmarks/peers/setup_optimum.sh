#!/usr/bin/env bash
# The second interpreter that benchmarks/peers/peers.py runs Optimum with (--optimum-python, by default
# .venv-optimum/bin/python). A venv of its own: optimum[onnxruntime] (optimum 2.1.0, optimum-onnx 0.1.0)
# needs transformers<4.58, and the project's venv runs transformers 5, the transformers baseline.
#
#     bash benchmarks/peers/setup_optimum.sh [VENV]          # default .venv-optimum, in the repository root
#
# Pinned so that Optimum's rows differ from the others by the system only:
# - torch 2.13.0 as in the project's venv (named explicitly: unpinned, pip pulls a multi-GB CUDA build);
# - onnxruntime at the project venv's version (1.32.0 when there is no .venv), the runtime under
#   Optimum, onnxruntime-genai and edgelm alike;
# - transformers 4.57.6, the newest that optimum-onnx 0.1.0 accepts;
# - accelerate: without it Optimum's export keeps two copies of GPT-2's tied embedding;
# - onnx-ir: onnxruntime 1.32's MatMulNBitsQuantizer imports it (the int4 of the Optimum export).
# onnxruntime-genai is not needed here: peers.py runs it from the project's venv on every package.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${1:-.venv-optimum}"
ort_version=1.32.0
if [ -x .venv/bin/python ]; then
    ort_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("onnxruntime"))')
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet \
    torch==2.13.0 \
    "onnxruntime==$ort_version" \
    "optimum[onnxruntime]==2.1.0" \
    optimum-onnx==0.1.0 \
    transformers==4.57.6 \
    accelerate==1.15.0 \
    onnx-ir==1.1.0
"$venv/bin/python" -c '
import importlib.metadata as m
import optimum.onnxruntime  # noqa: F401
names = ("optimum", "optimum-onnx", "transformers", "torch", "onnxruntime", "onnx", "accelerate", "onnx-ir")
print("'"$venv"':", ", ".join(f"{n} {m.version(n)}" for n in names))
'
