"""Running a GGUF file or a Hugging Face model folder directly: the first use exports it into a cache of
packages, later uses load the cached package at once (llama.cpp and Ollama run a downloaded file in one command).

    model = edgelm.load("SmolLM2-135M-Instruct.Q4_1.gguf")   # exports once, then loads from the cache
    path = resolve("SmolLM2-135M-Instruct.Q4_1.gguf")        # the package folder, exported if needed

The cache is a folder of ordinary packages (`$EDGELM_CACHE/packages`, default `~/.cache/edgelm/packages`), each
named `<source name>-<key>`. The key is a sha256 over the source's content (the file's sha256; a folder's files,
by name), the export options and the edgelm version, so an edited or replaced source, other options or a new
edgelm export again, while a renamed or copied file does not. Hashing a large file takes a while, so each file's
sha256 is remembered under `.hashes/` with its size, mtime and inode, and hashed again only when those change.

Exporting writes through writers/package_writer.py (staged beside the entry, swapped in complete), and a lock per key
(`.locks/`, where the OS has fcntl) makes a second process wait for the first and load what it wrote; a source that
is already a package is loaded as it is. The runtime never imports this module: export is needed only on a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from edgelm.writers.version import __version__

from .runtime import untrusted
from .runtime.contract import GENAI_CONFIG_FILE, MANIFEST_FILE, MODEL_FILE
from .runtime.errors import PackageError, PackageNotFoundError
from .runtime.files import kind_of
from .runtime.package import file_sha256

CACHE_ENV = "EDGELM_CACHE"  # the cache root (scripts/fetch_smollm2.py keeps the SmolLM2 GGUF there too)
PACKAGES = "packages"
CACHE_FORMAT = 1  # bumped when the key's recipe changes
# export_package's defaults, but for kept GGUF blocks the plain storage: a cached package is there to start fast,
# and plain blocks build a session several times faster, with a lower memory peak, than compact ones, which ONNX
# Runtime unpacks at every load (docs/results.md, "Compact storage"); they take more disk (1.2x-1.5x the file).
CACHE_EXPORT_OPTIONS = {"compact_blocks": False}
HF_CONFIG_FILE = "config.json"

Progress = Callable[[str], None]


def cache_dir() -> Path:
    """Where cached packages live: $EDGELM_CACHE/packages, default ~/.cache/edgelm/packages."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "edgelm"
    return Path(root).expanduser() / PACKAGES


def source_kind(path: str | Path) -> str | None:
    """What a path names: "package" (an edgelm, onnxruntime-genai or Optimum folder), "gguf" (a file starting with
    the GGUF magic), "checkpoint" (a Hugging Face model folder: config.json and no model.onnx; export says what
    else it lacks), or None (anything else, missing included: the runtime's loader then says what is wrong)."""
    kind = kind_of(path)
    folder = Path(path)
    if kind == "a regular file":
        try:
            with open(folder, "rb") as f:
                return "gguf" if f.read(4) == b"GGUF" else None
        except OSError:
            return None
    if kind != "a folder":
        return None
    if (folder / MANIFEST_FILE).exists() or (folder / GENAI_CONFIG_FILE).exists() or (folder / MODEL_FILE).exists():
        return "package"
    if (folder / HF_CONFIG_FILE).is_file():
        return "checkpoint"
    return None


# ---- the key -----------------------------------------------------------------------------------------------


def _remembered_sha256(path: Path, memo_dir: Path) -> str:
    """path's sha256, read from memo_dir when its size, mtime and inode are those recorded, else computed."""
    real = path.resolve()
    st = real.stat()
    stamp = {"path": str(real), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    memo = memo_dir / (hashlib.sha256(str(real).encode("utf-8", "surrogateescape")).hexdigest()[:32] + ".json")
    with contextlib.suppress(OSError, untrusted.Unbounded):  # a damaged record is hashed again
        record = untrusted.loads(memo.read_bytes())
        if isinstance(record, dict) and all(record.get(k) == v for k, v in stamp.items()):
            digest = record.get("sha256")
            if isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest):
                return digest
    digest = file_sha256(real)
    with contextlib.suppress(OSError):  # a read-only cache still works, hashing every time
        memo_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(memo, json.dumps(stamp | {"sha256": digest}))
    return digest


def source_sha256(path: str | Path, *, cache: Path | None = None) -> str:
    """A sha256 of what a source holds: a GGUF file's own sha256; for a folder, one over the "name sha256" lines of
    its files (hidden ones left out), sorted by name."""
    path, memo_dir = Path(path), (cache or cache_dir()) / ".hashes"
    if path.is_file():
        return _remembered_sha256(path, memo_dir)
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    lines = "".join(f"{p.name} {_remembered_sha256(p, memo_dir)}\n" for p in files)
    return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).hexdigest()


def cache_key(source_hash: str, export_options: dict) -> str:
    """The cache key of a source's content and the export options, with the edgelm version."""
    record = {"format": CACHE_FORMAT, "edgelm": __version__, "source": source_hash, "options": export_options}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def entry_name(source: Path, key: str) -> str:
    """`<source name>-<key>`: the file name without .gguf, or the folder's name, in safe characters."""
    stem = source.resolve().name
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    stem = re.sub(r"[^A-Za-z0-9._+-]+", "_", stem).strip("._")[:80] or "model"
    return f"{stem}-{key}"


def _find(cache: Path, key: str, source: Path) -> Path | None:
    """The cached package of a key, whatever its source was called when it was exported: an entry is trusted by
    what it is, not its name (see _holds)."""
    if not cache.is_dir():
        return None
    for entry in cache.glob(f"*-{key}"):
        if not entry.name.startswith(".") and _holds(entry, source, cache):
            return entry
    return None


def _holds(entry: Path, source: Path, cache: Path) -> bool:
    """Whether entry is a package exported from source's content: a real folder (not a link to one elsewhere)
    whose manifest is a real file recording the sha256 of every file export read, each equal to the source's
    file now. A folder copied or linked in under another model's key, or one missing its manifest, is not."""
    manifest = entry / MANIFEST_FILE
    if entry.is_symlink() or not entry.is_dir() or manifest.is_symlink() or not manifest.is_file():
        return False
    try:
        data = untrusted.loads(manifest.read_bytes())
    except (OSError, untrusted.Unbounded):
        return False
    recorded = data.get("source") if isinstance(data, dict) else None
    files = recorded.get("files") if isinstance(recorded, dict) else None
    if not isinstance(files, dict) or not files:
        return False
    memo_dir = cache / ".hashes"
    try:
        if source.is_file():
            return recorded.get("sha256") == _remembered_sha256(source, memo_dir)
        for name, digest in files.items():
            path = source / name
            if not isinstance(name, str) or Path(name).name != name or path.is_symlink() or not path.is_file():
                return False
            if digest != _remembered_sha256(path, memo_dir):
                return False
    except OSError:
        return False
    return True


# ---- resolving a source ------------------------------------------------------------------------------------


@dataclass
class Resolved:
    """A package folder to load, and how it was found: "package" (given), "cached", "exported" (into the cache
    now) or "temporary" (exported without the cache; `temporary` removes the folder when collected)."""

    path: Path
    how: str
    source: Path
    temporary: tempfile.TemporaryDirectory | None = None


def resolve(
    source: str | Path,
    *,
    cache: bool = True,
    export_options: dict | None = None,
    progress: Progress | None = None,
) -> Resolved:
    """The package folder to load for `source`: a package as it is; a GGUF file or Hugging Face model folder from
    the cache, exported into it first on a miss (cache=False: into a temporary folder). export_options: keyword
    arguments of export_package over CACHE_EXPORT_OPTIONS (part of the key); progress: export's progress lines
    (default: stderr)."""
    if not isinstance(source, (str, os.PathLike)) or "\x00" in str(source):
        raise PackageError(f"a model path must be a str or Path without NUL characters, got {source!r}")
    path, options = Path(source), CACHE_EXPORT_OPTIONS | dict(export_options or {})
    kind = source_kind(path)
    if kind_of(path) is None and not os.path.islink(path):
        raise PackageNotFoundError(f"{path} does not exist (give a package folder, a GGUF file or a model folder)")
    if kind_of(path) == "a regular file" and kind is None:
        raise PackageError(
            f"{path} is a file but not a GGUF file (it does not start with GGUF's magic bytes); give a package "
            "folder, a GGUF file or a Hugging Face model folder"
        )
    if kind in (None, "package"):
        return Resolved(path, "package", path)  # the runtime's loader names what is wrong with anything else
    say = progress or _stderr
    if not cache:
        temporary = tempfile.TemporaryDirectory(prefix="edgelm-")
        out = Path(temporary.name) / entry_name(path, "nocache")
        _export(path, out, options, say, f"{path} is a {_KIND_WORDS[kind]}: exporting it to a temporary package")
        return Resolved(out, "temporary", path, temporary)
    root = cache_dir()
    key = cache_key(source_sha256(path, cache=root), options)
    found = _find(root, key, path)
    if found is not None:
        return Resolved(found, "cached", path)
    _make_cache(root)
    with _locked(root, key, say):
        found = _find(root, key, path)  # another process may have exported it while this one waited
        if found is not None:
            return Resolved(found, "cached", path)
        out = root / entry_name(path, key)
        if os.path.lexists(out):  # the key's entry, but not this source's package: half-removed, linked, replaced
            say(f"{out} is not a package exported from {path} (no manifest, a link, or another model's): replacing it")
            remove_folder(out)
        said = f"{path} is a {_KIND_WORDS[kind]}: exporting it once into the cache ({out}); later runs load it at once"
        try:
            _export(path, out, options, say, said)
        except FileExistsError:  # no fcntl: another process committed the same key first
            found = _find(root, key, path)
            if found is None:
                raise
            return Resolved(found, "cached", path)
        except OSError as e:  # the disk filled, or the cache is not writable after all
            raise PackageError(f"cannot export into the cache {root} (${CACHE_ENV}): {e.strerror or e}") from None
    return Resolved(out, "exported", path)


def _make_cache(root: Path) -> None:
    """The cache folder, made if needed; a one-line PackageError naming $EDGELM_CACHE when it cannot be (a file, a
    dangling link, a read-only parent)."""
    where = f"the cache {root} (${CACHE_ENV}{'' if os.environ.get(CACHE_ENV) else ' unset: the default'})"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise PackageError(f"{where} is not a folder: point ${CACHE_ENV} at a folder") from None
    except OSError as e:
        raise PackageError(f"{where} cannot be made: {e.strerror or e}; point ${CACHE_ENV} elsewhere") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise PackageError(f"{where} is not writable; point ${CACHE_ENV} at a folder you can write")


_KIND_WORDS = {"gguf": "GGUF file", "checkpoint": "Hugging Face model folder"}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _export(source: Path, out: Path, options: dict, progress: Progress, announce: str) -> None:
    """Export source to out, saying `announce` first; a one-line PackageError where export is not installed."""
    try:
        from .export.onnx_export import export_package
    except ModuleNotFoundError as e:
        raise PackageError(
            f"{source} is a {_KIND_WORDS[source_kind(source)]}, and making a package of it needs the Python package "
            f"{e.name!r}: pip install 'edgelm[export]' (or export it on another machine with `edgelm export`)"
        ) from None
    progress(announce)
    export_package(source, out, progress=progress, **options)


@contextlib.contextmanager
def _locked(root: Path, key: str, say: Progress) -> Iterator[None]:
    """One exporter per key at a time (fcntl.flock on .locks/<key>; where the OS has no fcntl, two exports may run
    and the second fails to commit over the first, harmlessly)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    locks = root / ".locks"
    locks.mkdir(exist_ok=True)
    with open(locks / key, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("waiting for another edgelm process exporting the same model into the cache")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load(
    source: str | Path,
    provider: str = "auto",
    threads: int | None = None,
    *,
    verify: bool = True,
    cache: bool = True,
    export_options: dict | None = None,
    progress: Progress | None = None,
):
    """edgelm.runtime.load for a package, a GGUF file or a Hugging Face model folder (see resolve)."""
    from .runtime.model import Model

    resolved = resolve(source, cache=cache, export_options=export_options, progress=progress)
    try:
        model = Model(resolved.path, provider=provider, threads=threads, verify=verify)
    except PackageError as e:  # a package edgelm wrote that no longer loads: damaged, or from an older edgelm
        if resolved.how != "cached":
            raise
        raise PackageError(
            f"the cached package {resolved.path} does not load ({e}); remove it with `edgelm rm {resolved.path.name}` "
            "and run again"
        ) from None
    model.origin = resolved  # keeps a temporary package folder for as long as the model lives
    return model


# ---- managing the cache ------------------------------------------------------------------------------------


@dataclass
class Entry:
    name: str
    path: Path
    bytes: int
    precision: str
    source: str  # the exported file's or folder's name, from the manifest
    created: float  # the manifest's mtime (seconds since the epoch)


def entries() -> list[Entry]:
    """The cache's entries, newest first (hidden folders, such as an export being staged, left out), those that are
    not whole packages included (precision "incomplete", a link: "link"), so that `edgelm rm` can remove them."""
    root, found = cache_dir(), []
    if not root.is_dir():
        return found
    for path in root.iterdir():
        if path.name.startswith("."):
            continue
        manifest = path / MANIFEST_FILE
        whole = not path.is_symlink() and path.is_dir() and not manifest.is_symlink() and manifest.is_file()
        data = {}
        if whole:
            with contextlib.suppress(OSError, untrusted.Unbounded):
                data = untrusted.loads(manifest.read_bytes())
        data = data if isinstance(data, dict) else {}
        source = data.get("source") if isinstance(data.get("source"), dict) else {}
        kind = "link" if path.is_symlink() else None if whole else "incomplete"
        found.append(
            Entry(
                name=path.name,
                path=path,
                bytes=_bytes(path),
                precision=kind or str(data.get("precision", "?")),
                source=str(source.get("checkpoint", "?")),
                created=(manifest if whole else path).lstat().st_mtime,
            )
        )
    return sorted(found, key=lambda e: e.created, reverse=True)


def _bytes(path: Path) -> int:
    """The bytes of an entry's own files (a link's target is not the cache's)."""
    if path.is_symlink() or not path.is_dir():
        return 0
    return sum(p.lstat().st_size for p in path.iterdir() if not p.is_symlink() and p.is_file())


def remove(name: str | Path) -> list[Path]:
    """Remove a cached package: `name` is an entry's name (`edgelm list`), whatever state the entry is in (no
    manifest, a link), or a GGUF file or model folder (its entry for the default export options). Returns the
    folders removed; PackageNotFoundError when none matched."""
    root, name = cache_dir(), str(name)
    if source_kind(name) in ("gguf", "checkpoint"):
        key = cache_key(source_sha256(name, cache=root), CACHE_EXPORT_OPTIONS)
        targets = [entry for entry in root.glob(f"*-{key}") if not entry.name.startswith(".")] if root.is_dir() else []
    else:
        path = root / name
        valid = name and "/" not in name and os.sep not in name and not name.startswith(".") and name != ".."
        targets = [path] if valid and os.path.lexists(path) else []
    if not targets:
        raise PackageNotFoundError(f"no cached package {name!r} in {root} (see `edgelm list`)")
    for path in targets:
        remove_folder(path)
    return targets


def remove_folder(path: Path) -> None:
    """Out of sight first (a rename is atomic: a process looking the key up meanwhile exports again instead of
    loading half a folder), then deleted."""
    hidden = path.with_name(f".removing-{path.name}")
    if os.path.lexists(hidden):  # an earlier removal cut short
        _delete(hidden)
    path.rename(hidden)
    _delete(hidden)


def _delete(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():  # a link goes, never what it points at
        path.unlink()
        return
    shutil.rmtree(path)


def _write_atomically(path: Path, text: str) -> None:
    fd, temporary = tempfile.mkstemp(prefix=".", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
