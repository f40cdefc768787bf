"""Writing a package folder without ever losing what was there: the one way export and quantize write.
The runtime only reads packages, so this writer lives outside runtime/ and runtime/ never imports it.

    with StagedOutput(out_dir, inputs=[checkpoint], overwrite=overwrite) as staging:
        ... write every file into staging ...

Before any work, the output path is refused when it is an input, contains one or lies inside one,
is the current directory or a parent of it, is a file, a symlink (dangling or not), or a folder that
is not an edgelm package (recognised by its manifest). Folders are compared by identity (st_dev,
st_ino) of the output, the inputs and all their ancestors, not by path string, so a bind mount, a
symlinked parent or any other spelling of the same folder is caught; so is an output package holding
a hard link to an input file. An existing package (or empty folder) is replaced only with overwrite,
and a package only when it holds nothing but the files its manifest lists.

The new package is written into `<hidden staging folder>/package` beside the output and swapped into
place at the end (renameat2's RENAME_EXCHANGE where the OS has it, else two renames); the old one is
removed after. A failure, Ctrl-C or SIGTERM at any point leaves either the old package or the new one,
complete, and removes the hidden folder. Only kill -9 (or a power cut) can leave one behind: its name
is STAGING_PREFIX plus 8 random characters (so it fits wherever the output's name fits), and it holds
OWNER_FILE naming the writer's pid, host and start time; the next run that writes into the same parent
folder removes the ones whose writer is gone, and never one of a live writer or of another host.

Single files (an adapter and its record) go the same way through StagedFiles: each path is refused when it
is a symlink (dangling or not), not a regular file, an input (by identity: a hard link too) or inside one,
and an existing file is replaced only with overwrite; the files are written in a staging folder beside
them and renamed into place at the end, a new one without replacing anything that appeared meanwhile.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

from edgelm.runtime.contract import MANIFEST_FILE, MANIFEST_FORMAT
from edgelm.runtime.package import file_sha256

STAGING_PREFIX = ".edgelm-staging-"  # hidden folders beside the output while a package is written
OWNER_FILE = "edgelm-staging.json"  # inside each: who writes it (pid, host, start time), for stale-folder cleanup
STAGED_PACKAGE = "package"  # the package being written, inside the staging folder
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


Identity = tuple[int, int]  # (st_dev, st_ino): one folder or file, however its path is spelled


def _identity(path: Path) -> Identity | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _lineage(path: Path) -> list[Identity]:
    """Identities of path (if it exists) and of every existing folder above it, nearest first."""
    resolved = path.resolve()
    found = [_identity(p) for p in (resolved, *resolved.parents)]
    return [i for i in found if i is not None]


def check_output(out_dir: str | Path, *, inputs: Iterable[str | Path | None] = (), overwrite: bool = False) -> Path:
    """Raise (ValueError, FileExistsError) if writing a package to out_dir could lose anything."""
    out = _usable_path(out_dir)
    out_identity = _identity(out)  # None when it does not exist yet
    if out_identity is not None and out_identity in _lineage(Path.cwd()):
        raise ValueError(f"the output {out} is the current directory or a parent of it; give a new folder's path")
    for given in inputs:
        if given is not None:
            _check_apart(out, given)
    if not out.is_dir():
        return out
    if any(out.iterdir()):
        _check_replaceable(out)
    if not overwrite:  # an empty folder too: the user may have made it for something else
        raise FileExistsError(f"{out} already exists (use --overwrite / overwrite=True to replace it)")
    return out


def _usable_path(out_dir: str | Path) -> Path:
    """out_dir as a Path, if it names nothing yet or a real folder (not a symlink, not a file)."""
    out = Path(out_dir)
    if not str(out_dir) or "\x00" in str(out_dir):
        raise ValueError(f"the output folder must be a path, got {str(out_dir)!r}")
    try:
        os.lstat(out)
    except OSError as e:  # not there is the usual case; a name too long, a parent that is a file is not
        if not isinstance(e, FileNotFoundError):
            raise ValueError(f"the output {str(out)[:300]} cannot be used: {e.strerror or e}") from None
    if out.is_symlink():
        raise ValueError(f"the output {out} is a symlink; give the real folder's path (a symlink is never replaced)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"the output {out} exists and is not a folder; a package is written as a new folder")
    return out


def _check_apart(out: Path, given: str | Path) -> None:
    """The output must not be the input, contain it, lie inside it, or hold a hard link to it."""
    out_identity, out_lineage, target = _identity(out), _lineage(out), out.resolve()
    source = Path(given).resolve()
    source_identity, source_lineage = _identity(source), _lineage(source)
    # by path first (that also covers an input that does not exist yet), then by identity: another spelling
    plain = source == target or target in source.parents or source in target.parents
    another = "" if plain else " (by another path: a bind mount or a symlink)"
    if target == source or (out_identity is not None and out_identity == source_identity):
        raise ValueError(f"the output folder must differ from the input {given}{another}")
    if target in source.parents or (out_identity is not None and out_identity in source_lineage):
        raise ValueError(f"the output {out} contains the input {given}{another}; give a folder outside it")
    if source in target.parents or (source_identity is not None and source_identity in out_lineage):
        raise ValueError(f"the output {out} lies inside the input {given}{another}; give a folder outside it")
    if out_identity is not None and out.is_dir() and source.is_file():  # a hard link to the input in the package
        for entry in os.scandir(out):
            if _identity(Path(entry.path)) == source_identity:
                raise ValueError(
                    f"the output {out} holds {entry.name}, a hard link to the input {given}; "
                    "give a folder that does not hold the input"
                )


def _check_replaceable(out: Path) -> None:
    """A folder with something in it is replaced only when it is an edgelm package holding only its files."""
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


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # renameat2's flags (linux/fs.h)


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2(a, b, flags); False where the OS or the file system cannot, OSError if it failed."""
    name = ctypes.util.find_library("c")
    renameat2 = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None) if name else None
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags) == 0:
        return True
    error = ctypes.get_errno()
    if error in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot; fall back
        return False
    raise OSError(error, os.strerror(error), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (RENAME_EXCHANGE); False where the OS cannot."""
    return _renameat2(a, b, RENAME_EXCHANGE)


def _place_new(staged: Path, out: Path) -> None:
    """Rename staged to out, never replacing what appeared at out meanwhile (RENAME_NOREPLACE, else a
    hard link, which fails on an existing name too)."""
    try:
        if _renameat2(staged, out, RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise FileExistsError(f"{out} appeared while it was written; nothing was replaced") from None
    try:
        os.link(staged, out)
    except FileExistsError:
        raise FileExistsError(f"{out} appeared while it was written; nothing was replaced") from None
    os.unlink(staged)


def _start_time(pid: int) -> int | None:
    """When process pid started (clock ticks since boot, /proc/PID/stat field 22), or None where there is no
    /proc; -1 for a zombie (dead, not yet reaped). Tells a live writer from a new process given its pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace").rpartition(")")[2].split()
        return -1 if fields[0] == "Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _owner(output: str) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()), "output": output}


def _writer_is_gone(owner: object) -> bool:
    """Whether the run an owner record names is certainly dead: same host, and its pid is no process, a
    zombie, or a process that started at another time (the pid was reused). Anything unclear: not gone."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return False  # another machine's writer (a shared folder) cannot be checked from here
    pid, started = owner.get("pid"), owner.get("started")
    if type(pid) is not int or not 0 < pid < 2**31 or not (started is None or type(started) is int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: a live process of another user
        return False
    now = _start_time(pid)
    return now == -1 or (started is not None and now is not None and now != started)


def remove_stale_staging(parent: Path) -> list[str]:
    """Remove the staging folders in parent that runs killed with SIGKILL left behind (see the module
    docstring); returns their names. Only folders named STAGING_PREFIX... holding an OWNER_FILE are looked at."""
    removed = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(STAGING_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        owner_path = Path(entry.path) / OWNER_FILE
        try:
            if not entry.is_dir(follow_symlinks=False) or not stat.S_ISREG(os.lstat(owner_path).st_mode):
                continue
            if os.lstat(owner_path).st_size > 4096:
                continue
            owner = json.loads(owner_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue  # no record (yet: a writer that just made its folder), or not one of ours
        if _writer_is_gone(owner) and _restore_old(parent, Path(entry.path), owner.get("output")):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _restore_old(parent: Path, staging: Path, output: object) -> bool:
    """Where the OS cannot swap atomically, a run killed between its two renames leaves the old package in
    `staging/old` and no output: put it back rather than delete the only copy. False when it cannot be put
    back: then the folder is kept."""
    old = staging / "old"
    if not old.is_dir() or old.is_symlink():
        return True
    valid = isinstance(output, str) and output not in ("", ".", "..") and "/" not in output and os.sep not in output
    if not valid:
        return False
    if os.path.lexists(parent / output):  # killed after the second rename: the new package is in place
        return True
    try:
        old.rename(parent / output)
    except OSError:
        return False
    return True


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
        remove_stale_staging(self.out_dir.parent)
        # a short name (STAGING_PREFIX + 8 characters) fits wherever the output's name does
        self.path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.out_dir.parent))
        try:  # a signal here would skip __exit__
            (self.path / OWNER_FILE).write_text(json.dumps(_owner(self.out_dir.name)), encoding="utf-8")
            (self.path / STAGED_PACKAGE).mkdir()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self.path / STAGED_PACKAGE

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
        package = self.path / STAGED_PACKAGE
        check_output(self.out_dir, inputs=self.inputs, overwrite=self.overwrite)  # again: it may have changed
        if not self.out_dir.exists():
            package.rename(self.out_dir)
            return
        if not any(self.out_dir.iterdir()):
            os.rmdir(self.out_dir)
            package.rename(self.out_dir)
            return
        if not _exchange(package, self.out_dir):  # then two renames, the old package aside first
            old = self.path / "old"
            self.out_dir.rename(old)
            try:
                package.rename(self.out_dir)
            except BaseException:
                old.rename(self.out_dir)
                raise
        # the staging folder now holds the old package; __exit__ removes it


def check_file_output(path: str | Path, *, inputs: Iterable[str | Path | None] = (), overwrite: bool = False) -> Path:
    """Raise (ValueError, FileExistsError) if writing the file `path` could lose anything (module docstring)."""
    out = Path(path)
    if not str(path) or "\x00" in str(path):
        raise ValueError(f"the output file must be a path, got {str(path)!r}")
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # a name too long, a parent that is a file
        raise ValueError(f"the output {str(out)[:300]} cannot be used: {e.strerror or e}") from None
    if mode is not None and stat.S_ISLNK(mode):
        raise ValueError(f"the output {out} is a symlink; give the real file's path (never written through)")
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(f"the output {out} exists and is not a regular file; give a file's path")
    for given in inputs:
        if given is not None:
            _check_apart(out, given)
    if mode is not None and not overwrite:
        raise FileExistsError(f"{out} already exists (use --overwrite / overwrite=True to replace it)")
    return out


class StagedFiles(StagedOutput):
    """StagedOutput for single files in one folder (an adapter and its record): checks every path when made,
    and the block writes each file under its own name into the folder it is given; they are moved into
    place, in the order given, when it succeeds."""

    def __init__(self, paths: list[str | Path], *, inputs: Iterable[str | Path | None] = (), overwrite: bool = False):
        self.inputs = [i for i in inputs if i is not None]
        self.overwrite = overwrite
        self.paths = [check_file_output(p, inputs=self.inputs, overwrite=overwrite) for p in paths]
        parents = {p.absolute().parent for p in self.paths}
        assert len(parents) == 1 and len({p.name for p in self.paths}) == len(self.paths), "one folder, distinct names"
        self.out_dir = self.paths[0]  # StagedOutput stages beside it
        self.path = None
        self._handlers = {}
        self._made = []

    def _commit(self) -> None:
        assert self.path is not None
        placed: list[Path] = []
        try:
            for out in self.paths:
                staged = self.path / STAGED_PACKAGE / out.name
                assert staged.is_file() and not staged.is_symlink(), f"{out.name} was not written"
                check_file_output(out, inputs=self.inputs, overwrite=self.overwrite)  # again: it may have changed
                if self.overwrite and os.path.lexists(out):
                    os.replace(staged, out)
                else:
                    _place_new(staged, out)
                    placed.append(out)
        except BaseException:
            for out in placed:  # new files this run made: without the rest they are no use
                out.unlink(missing_ok=True)
            raise


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def list_files(folder: Path) -> dict:
    """The manifest's "files" entry for a folder: sha256 and size of every file but the manifest."""
    return {
        p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }
