#!/usr/bin/env bash
# The interpreter that benchmarks/peers/peers.py runs llama.cpp with (--llamacpp-python, by default
# .venv-llamacpp/bin/python), and llama.cpp's own HF-to-GGUF converter. Never part of CI: pip compiles
# llama.cpp from source, about 15 minutes on 2 cores.
#
#     bash benchmarks/peers/setup_llamacpp.sh                    # venv .venv-llamacpp in the repository root
#     LLAMACPP_VENV=/path/to/venv bash benchmarks/peers/setup_llamacpp.sh   # reuse (or build) a venv elsewhere
#
# What it leaves:
# - $LLAMACPP_VENV with llama-cpp-python 0.3.36, a plain CPU build (no BLAS, no GPU backends). The build is
#   skipped when that venv already imports llama_cpp, so a second run costs seconds, not a compile.
# - benchmarks/.llamacpp/ (gitignored): the source distribution, and from its vendored llama.cpp the
#   converter convert_hf_to_gguf.py with what it imports (gguf-py/, conversion/ where present). peers.py
#   runs it with the project's interpreter (torch, transformers, numpy) and gguf-py on PYTHONPATH, so the
#   GGUF comes from the same HF folder as every other system's model.
# The build runs under `nice -n 19` with one compile job, so other work on a small machine keeps moving.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=0.3.36
venv="${LLAMACPP_VENV:-.venv-llamacpp}"
dest=benchmarks/.llamacpp
sdist="$dest/llama_cpp_python-$version.tar.gz"

mkdir -p "$dest"
if [ ! -f "$sdist" ]; then
    # --no-binary for this package only: ":all:" would also build its build backend's own
    # dependencies from source, recursively, before pip even reads the metadata.
    python3 -m pip download --quiet --no-binary llama-cpp-python --no-deps --dest "$dest" "llama-cpp-python==$version"
fi
# The converter and what it imports, from the vendored llama.cpp inside the source distribution.
root="llama_cpp_python-$version/vendor/llama.cpp"
members=$(tar -tzf "$sdist" | grep -E "^$root/(convert_hf_to_gguf\.py|gguf-py/|conversion/|models/ggml-vocab)" || true)
if [ -z "$members" ]; then
    echo "setup_llamacpp: no convert_hf_to_gguf.py under $root in $sdist" >&2
    exit 1
fi
rm -rf "$dest/llama.cpp"
mkdir -p "$dest/llama.cpp"
echo "$members" | tar -xzf "$sdist" -C "$dest/llama.cpp" --strip-components=3 -T -
echo "converter: $dest/llama.cpp/convert_hf_to_gguf.py"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import llama_cpp' 2>/dev/null; then
    echo "$venv already imports llama_cpp: build skipped"
else
    start=$(date +%s)
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    # A plain CPU build, as `pip install llama-cpp-python` makes by default: ggml's CPU backend tuned for
    # this machine (GGML_NATIVE), OpenMP threads where the compiler has it; no BLAS, no GPU backends.
    CMAKE_ARGS="-DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=1 \
        nice -n 19 "$venv/bin/pip" install --verbose --no-cache-dir "$sdist"
    echo "build took $(( $(date +%s) - start )) s"
fi
"$venv/bin/python" -c '
import importlib.metadata as m
import llama_cpp
print("'"$venv"': llama-cpp-python", m.version("llama-cpp-python"), "numpy", m.version("numpy"))
print(llama_cpp.llama_print_system_info().decode())
'
