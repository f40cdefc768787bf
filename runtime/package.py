"""Reading a model package: the contract between export, quantize and the runtime.

Three kinds of folder load:

1. an edgelm package: `edgelm.json` (the manifest) names the model file, the I/O names, the
   architecture, the special tokens, the precision and the sha256 of every file; each file is
   checked against it before ONNX Runtime sees anything;
2. an onnxruntime-genai folder: `genai_config.json` (model.decoder.* gives the same facts);
3. an Optimum export of GPT-2: `model.onnx` + Hugging Face `config.json`.

Everything the runtime needs comes from these JSON files; nothing is guessed from names. Every path
a JSON file names must resolve inside the package folder, and so must every external-data location
inside model.onnx (runtime/onnx_external.py reads them without `onnx`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .contract import (
    GENAI_CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    Architecture,
    IONames,
    Manifest,
    Tokens,
)
from .errors import PackageError, PackageNotFoundError
from .files import kind_of
from .foreign import HF_CONFIG_FILE, ForeignPackage, read_genai, read_optimum
from .onnx_external import check_ranges, external_data


@dataclass
class PackageSpec:
    """What the runtime knows about a package, whichever kind of folder it came from."""

    folder: Path
    kind: str  # "edgelm", "genai" or "optimum"
    model_path: Path
    tokenizer_path: Path | None
    arch: Architecture
    io: IONames
    tokens: Tokens
    precision: str = "fp32"
    manifest: Manifest | None = None  # edgelm packages only
    chat_template_path: Path | None = None
    verified: bool = False  # every file the runtime reads was checked against the manifest's sha256
    pending_hashes: PendingHashes | None = None  # read_package(background_hashes=True): finish_verification()

    def finish_verification(self) -> None:
        """Wait for the hashes read_package left running; raise PackageError on a mismatch."""
        if self.pending_hashes is not None:
            pending, self.pending_hashes = self.pending_hashes, None
            pending.wait()
            self.verified = True


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise PackageError(f"{path.name} is not valid JSON: {e}") from None
    except OSError as e:
        raise PackageError(f"{path.name} cannot be read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise PackageError(f"{path.name} is not a JSON object")
    return data


def inside(folder: Path, name: object, what: str) -> Path:
    """Resolve a file name taken from package JSON; refuse anything that leaves the folder."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise PackageError(f"{what} must be a file name, got {name!r}")
    if os.path.isabs(name):
        raise PackageError(f"{what} {name!r} is an absolute path; package files must be inside the package folder")
    root = folder.resolve()
    path = (folder / name).resolve()
    if path != root and root not in path.parents:
        raise PackageError(f"{what} {name!r} resolves outside the package folder")
    return path


def _tokenizer(folder: Path) -> Path | None:
    path = folder / TOKENIZER_FILE
    return inside(folder, TOKENIZER_FILE, "tokenizer") if path.is_file() else None


def _from_manifest(folder: Path, data: dict) -> PackageSpec:
    manifest = Manifest.parse(data)
    tok = manifest.tokenizer
    return PackageSpec(
        folder=folder,
        kind="edgelm",
        model_path=inside(folder, manifest.model_file, "model_file"),
        tokenizer_path=inside(folder, tok.file, "tokenizer file") if tok.file else None,
        chat_template_path=inside(folder, tok.chat_template, "chat template") if tok.chat_template else None,
        arch=manifest.architecture,
        io=manifest.io,
        tokens=tok,
        precision=manifest.precision,
        manifest=manifest,
    )


def _from_foreign(folder: Path, found: ForeignPackage) -> PackageSpec:
    return PackageSpec(
        folder=folder,
        kind=found.kind,
        model_path=inside(folder, found.model_file, found.model_file_what),
        tokenizer_path=_tokenizer(folder),
        arch=found.arch,
        io=found.io,
        tokens=found.tokens,
    )


# Files at least this large are hashed in a background thread when the caller asks (Model: the ONNX
# Runtime session is built meanwhile, and ONNX Runtime releases the GIL while it builds).
BACKGROUND_HASH_BYTES = 8 << 20


class PendingHashes:
    """The sha256 checks still running in the background; wait() raises what stopped them (the first
    mismatch, an unreadable file, or anything else: a check that did not finish never passes)."""

    def __init__(self, checks: list[tuple[str, Path, str]]):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(checks,), name="edgelm-sha256", daemon=True)
        self.thread.start()

    def _run(self, checks: list[tuple[str, Path, str]]) -> None:
        try:
            for name, path, expected in checks:
                try:
                    digest = file_sha256(path)
                except OSError as e:
                    raise PackageError(f"cannot read package file {name}: {e.strerror or e}") from None
                if digest != expected:
                    raise PackageError(_mismatch(name))
        except BaseException as e:  # handed to the waiting thread
            self.error = e

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _mismatch(name: str) -> str:
    return f"package file {name} does not match its sha256 in {MANIFEST_FILE} (corrupt or tampered)"


def verify_files(folder: Path, manifest: dict, *, background: bool = False) -> PendingHashes | None:
    """Check every file the manifest lists against its size and sha256. With background, files of
    BACKGROUND_HASH_BYTES or more are hashed in a thread: the caller must wait() on what is returned
    before it uses anything read from them."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise PackageError(f"{MANIFEST_FILE}: 'files' must list the package's files with their sha256")
    later = []
    for name, entry in files.items():
        path = inside(folder, name, "listed file")
        regular_file(path, "package file")
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            raise PackageError(f"{MANIFEST_FILE}: entry for {name} lacks a sha256")
        size = path.stat().st_size
        if isinstance(entry.get("bytes"), int) and size != entry["bytes"]:
            raise PackageError(
                f"package file {name} is {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)"
            )
        if background and size >= BACKGROUND_HASH_BYTES:
            later.append((name, path, entry["sha256"]))
        elif file_sha256(path) != entry["sha256"]:
            raise PackageError(_mismatch(name))
    return PendingHashes(later) if later else None


def _check_listed(folder: Path, manifest: Manifest, paths: list[Path]) -> None:
    """With verification, every file the runtime reads must be one whose sha256 was just checked."""
    listed = {inside(folder, name, "listed file") for name in manifest.files}
    for path in paths:
        if path not in listed:
            raise PackageError(
                f"{path.relative_to(folder.resolve())} is not listed in {MANIFEST_FILE}'s files, so it cannot be "
                "verified; re-export the package or load it with verify=False"
            )


def read_package(path: str | Path, *, verify: bool = True, background_hashes: bool = False) -> PackageSpec:
    """Read a package folder's JSON; with verify, check file hashes first (edgelm packages). With
    background_hashes, the large files' hashes are still running on return: spec.finish_verification()
    finishes them (and sets spec.verified) before anything read from those files may be used."""
    if not isinstance(path, (str, os.PathLike)) or "\x00" in str(path):
        raise PackageError(f"a package path must be a str or Path without NUL characters, got {path!r}")
    folder = Path(path)
    try:
        exists, is_dir = folder.exists(), folder.is_dir()
    except OSError as e:  # a name too long for the file system, a folder we may not read
        raise PackageError(f"cannot read package folder {str(folder)[:200]!r}: {e.strerror or e}") from None
    if not exists:
        raise PackageNotFoundError(f"package folder {folder} does not exist")
    if not is_dir:
        raise PackageError(_not_a_folder(folder))
    manifest_path = folder / MANIFEST_FILE
    if _is_checkpoint_folder(folder):
        raise PackageError(
            f"{folder} is a Hugging Face model folder, not a package: {_EXPORT_FIRST.format(path=str(folder))}"
        )
    other_kind = (folder / GENAI_CONFIG_FILE).is_file() or (folder / HF_CONFIG_FILE).is_file()
    if verify and not manifest_path.is_file() and (other_kind or os.path.lexists(manifest_path)):
        raise PackageError(_unsigned_reason(folder, manifest_path))
    if manifest_path.is_file():
        manifest = _read_json(inside(folder, MANIFEST_FILE, "manifest"))
        pending = verify_files(folder, manifest, background=background_hashes) if verify else None
        try:
            spec = _from_manifest(folder, manifest)
            spec.pending_hashes = pending
            return _check_files(folder, spec, verify=verify)
        except PackageError:
            if pending is not None:
                pending.wait()  # a file that fails its sha256 explains any other error best
            raise
    elif (folder / GENAI_CONFIG_FILE).is_file():
        spec = _from_foreign(folder, read_genai(_read_json(inside(folder, GENAI_CONFIG_FILE, "genai config"))))
    elif (folder / HF_CONFIG_FILE).is_file() and (folder / MODEL_FILE).is_file():
        spec = _from_foreign(folder, read_optimum(_read_json(inside(folder, HF_CONFIG_FILE, "config"))))
    else:
        raise PackageError(
            f"{folder} is not a model package: it has no {MANIFEST_FILE}, no {GENAI_CONFIG_FILE}, "
            f"and no {HF_CONFIG_FILE} + model.onnx"
        )
    return _check_files(folder, spec, verify=verify)


# what to do with a GGUF file or a model folder, which edgelm.load (edgelm/cache.py, outside the runtime) runs
_EXPORT_FIRST = (
    "load it with edgelm.load, which exports it once into a cache of packages, or write a package with `edgelm "
    "export {path} OUT`"
)


def _not_a_folder(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            gguf = f.read(4) == b"GGUF"
    except OSError:
        gguf = False
    if gguf:
        return f"{path} is a GGUF file, not a package: {_EXPORT_FIRST.format(path=str(path))}"
    return f"{path} is a file, not a folder: a package is a folder holding model.onnx and its JSON"


def _is_checkpoint_folder(folder: Path) -> bool:
    """A folder with a Hugging Face config.json and neither a manifest, a genai config nor an ONNX model."""
    return (folder / HF_CONFIG_FILE).is_file() and not any(
        (folder / name).exists() for name in (MANIFEST_FILE, GENAI_CONFIG_FILE, MODEL_FILE)
    )


def _check_files(folder: Path, spec: PackageSpec, *, verify: bool) -> PackageSpec:
    """What every kind of package must pass: regular files, special tokens inside the vocabulary, external
    data inside the folder and, with verification, listed in the manifest."""
    regular_file(spec.model_path, "model file")
    for path in (spec.tokenizer_path, spec.chat_template_path):
        if path is not None:
            regular_file(path, "package file")
    tokens, vocab_size = spec.tokens, spec.arch.vocab_size
    for token in [*tokens.eos_token_ids, tokens.pad_token_id, tokens.bos_token_id]:
        if token is not None and not 0 <= token < vocab_size:
            raise PackageError(f"special token id {token} is outside the vocabulary (size {vocab_size})")
    entries = external_data(spec.model_path)
    what = f"external data location in {spec.model_path.name}"
    files = {entry.location: inside(spec.model_path.parent, entry.location, what) for entry in entries}
    external = list(dict.fromkeys(files.values()))
    for path in external:
        regular_file(path, f"external data of {spec.model_path.name}")
    check_ranges(spec.model_path, entries, files)
    if verify:
        optional = [p for p in (spec.tokenizer_path, spec.chat_template_path) if p is not None]
        read = [spec.model_path, *external, *optional]
        _check_listed(folder, spec.manifest, read)
        spec.verified = spec.pending_hashes is None
    return spec


def _unsigned_reason(folder: Path, manifest_path: Path) -> str:
    """Why a folder cannot load with verify=True, and how to load it on purpose."""
    if os.path.lexists(manifest_path):
        why = f"its {MANIFEST_FILE} is not a regular file"
    else:
        why = f"it has no {MANIFEST_FILE} manifest"
    return (
        f"{folder} cannot be verified: {why}, so its files' sha256 cannot be checked. To run an unsigned folder "
        "on purpose (for example one written by onnxruntime-genai's builder or Optimum), load it with "
        "verify=False (CLI: --no-verify)"
    )


def regular_file(path: Path, what: str) -> None:
    """Refuse anything but a regular file before it is opened: a FIFO or a device would block or never end."""
    kind = kind_of(path)
    if kind is None:
        raise PackageNotFoundError(f"{what} {path.name} is missing from {path.parent}")
    if kind != "a regular file":
        raise PackageError(f"{what} {path.name} is {kind}, not a regular file")
