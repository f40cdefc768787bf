"""Writing a package folder without ever losing what was there: the one way export and quantize write.

    with StagedOutput(out_dir, inputs=[checkpoint], overwrite=overwrite) as staging:
        ... write every file into staging ...

Before any work, the output path is refused when it is an input, contains one or lies inside one,
is the current directory or a parent of it, is a file, a symlink (dangling or not), or a folder that
is not an edgelm package (recognised by its manifest). An existing package (or empty folder) is
replaced only with overwrite, and a package only when it holds nothing but the files its manifest lists.
The new package is written into a hidden folder beside the output and swapped into place at the end
(renameat2's RENAME_EXCHANGE where the OS has it, else two renames); the old one is removed after.
A failure, Ctrl-C or SIGTERM at any point leaves either the old package or the new one, complete,
and removes the hidden folder.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

from .contract import MANIFEST_FILE, MANIFEST_FORMAT

STAGING_PREFIX = ".edgelm-staging-"  # hidden folders beside the output while a package is written
_SIGNALS = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]


def _is_package(folder: Path) -> tuple[bool, list[str]]:
    """Whether folder holds an edgelm manifest, and the entries it holds that the manifest does not list."""
    manifest_path = folder / MANIFEST_FILE
    if manifest_path.is_symlink() or not manifest_path.is_file():
        return False, []
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False, []
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return False, []
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    extra = [
        p.name
        for p in folder.iterdir()
        if p.name != MANIFEST_FILE and (p.name not in files or p.is_symlink() or not p.is_file())
    ]
    return True, sorted(extra)


def check_output(out_dir: str | Path, *, inputs: Iterable[str | Path | None] = (), overwrite: bool = False) -> Path:
    """Raise (ValueError, FileExistsError) if writing a package to out_dir could lose anything."""
    out = Path(out_dir)
    if not str(out_dir) or "\x00" in str(out_dir):
        raise ValueError(f"the output folder must be a path, got {str(out_dir)!r}")
    if out.is_symlink():
        raise ValueError(f"the output {out} is a symlink; give the real folder's path (a symlink is never replaced)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"the output {out} exists and is not a folder; a package is written as a new folder")
    target = out.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise ValueError(f"the output {out} is the current directory or a parent of it; give a new folder's path")
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if target == source:
            raise ValueError(f"the output folder must differ from the input {given}")
        if target in source.parents:
            raise ValueError(f"the output {out} contains the input {given}; give a folder outside it")
        if source in target.parents:
            raise ValueError(f"the output {out} lies inside the input {given}; give a folder outside it")
    if not out.is_dir():
        return out
    if any(out.iterdir()):
        is_package, extra = _is_package(out)
        if not is_package:
            raise ValueError(
                f"the output {out} is a folder that is not an edgelm package (no valid {MANIFEST_FILE}); "
                "edgelm replaces only its own packages and empty folders: remove it yourself or give another path"
            )
        if extra:
            raise ValueError(
                f"the package {out} also holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}, which its "
                f"{MANIFEST_FILE} does not list; move them out, or give a new folder's path"
            )
    if not overwrite:  # an empty folder too: the user may have made it for something else
        raise FileExistsError(f"{out} already exists (use --overwrite / overwrite=True to replace it)")
    return out


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the OS cannot."""
    name = ctypes.util.find_library("c")
    renameat2 = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None) if name else None
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot; fall back
        return False
    raise OSError(error, os.strerror(error), str(b))


class _Terminated(SystemExit):
    """Raised from a SIGTERM/SIGHUP handler so the staging folder is removed on the way out."""


class StagedOutput:
    """Checks out_dir when made (before any work), stages the package in a hidden folder beside it,
    and swaps it into place when the block succeeds; see the module docstring."""

    def __init__(self, out_dir: str | Path, *, inputs: Iterable[str | Path | None] = (), overwrite: bool = False):
        self.inputs = [i for i in inputs if i is not None]
        self.overwrite = overwrite
        self.out_dir = check_output(out_dir, inputs=self.inputs, overwrite=overwrite)
        self.path: Path | None = None
        self._handlers: dict = {}
        self._made: list[Path] = []

    def __enter__(self) -> Path:
        parent = self.out_dir.parent.absolute()
        self._made = [p for p in [parent, *parent.parents] if not os.path.lexists(p)]  # removed again on failure
        if threading.current_thread() is threading.main_thread():  # before the folder exists: no window
            for number in _SIGNALS:
                self._handlers[number] = signal.signal(number, self._terminate)
        parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{self.out_dir.name}-", dir=self.out_dir.parent))
        return self.path

    def _terminate(self, number, frame) -> None:
        raise _Terminated(128 + number)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._commit()
        finally:
            if self.path is not None and self.path.exists():
                shutil.rmtree(self.path, ignore_errors=True)
            if exc_type is not None:
                for folder in self._made:  # deepest first; only if still empty
                    try:
                        folder.rmdir()
                    except OSError:
                        break
            for number, handler in self._handlers.items():
                signal.signal(number, handler)

    def _commit(self) -> None:
        assert self.path is not None
        self.path.chmod(0o755)  # mkdtemp makes it private; a package is an ordinary folder
        check_output(self.out_dir, inputs=self.inputs, overwrite=self.overwrite)  # again: it may have changed
        if not self.out_dir.exists():
            self.path.rename(self.out_dir)
            return
        if not any(self.out_dir.iterdir()):
            os.rmdir(self.out_dir)
            self.path.rename(self.out_dir)
            return
        if not _exchange(self.path, self.out_dir):  # then two renames, the old package aside first
            old = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{self.out_dir.name}-old-", dir=self.out_dir.parent))
            self.out_dir.rename(old / "package")
            try:
                self.path.rename(self.out_dir)
            except BaseException:
                (old / "package").rename(self.out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)
        # self.path now holds the old package; __exit__ removes it
