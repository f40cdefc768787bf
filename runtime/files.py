"""Input files named by a user: said to be what they are, and read as UTF-8 text with one-line errors.

A FIFO, socket, device or folder where a file belongs is named as such before anything opens it (opening a
FIFO blocks until a writer comes; a device may never end), and never reported as missing. Text that is not
UTF-8 (a Latin-1 file, UTF-16 from a Windows editor, with or without a byte-order mark; text holding NUL)
is an error naming the file and the first bad byte's offset, not a UnicodeDecodeError without the name.
"""

from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_BOMS = (  # longest first: the UTF-32 LE mark starts with UTF-16 LE's
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


def kind_of(path: str | Path) -> str | None:
    """'a folder', 'a FIFO (named pipe)', ... for what is at path (symlinks followed), 'a regular file', or
    None when nothing is there (a dangling symlink included). Never opens it."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "a regular file")


def check_file(path: str | Path, what: str, *, error: type[Exception] = ValueError) -> Path:
    """path if it is a regular file (or a symlink to one); FileNotFoundError when nothing is there,
    `error` naming what it is otherwise."""
    kind = kind_of(path)
    if kind is None:
        dangling = " (a symlink to nothing)" if os.path.islink(path) else ""
        raise FileNotFoundError(f"{what} {path} does not exist{dangling}")
    if kind != "a regular file":
        raise error(f"{what} {path} is {kind}, not a regular file")
    return Path(path)


def decode_utf8(data: bytes, path: str | Path, what: str, *, error: type[Exception] = ValueError) -> str:
    """data as UTF-8 text; `error`, one line naming the file, when it is not."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        encoding = next((name for bom, name in _BOMS if data.startswith(bom)), None)
        if encoding is not None:
            raise error(
                f"{what} {path} is {encoding} text (it starts with a byte-order mark); save it as UTF-8"
            ) from None
        raise error(
            f"{what} {path} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} cannot be decoded "
            "(Latin-1 or another encoding?); save it as UTF-8"
        ) from None
    if "\x00" in text:  # valid UTF-8, but no text holds NUL: UTF-16 without a byte-order mark, or binary
        raise error(
            f"{what} {path} is not UTF-8 text: it holds NUL bytes (first at offset {data.index(0)}; UTF-16 or "
            "a binary file?)"
        )
    return text


def read_text(path: str | Path, what: str, *, error: type[Exception] = ValueError) -> str:
    """The UTF-8 text of the regular file at path, or a one-line error naming it (see the module docstring)."""
    check_file(path, what, error=error)
    try:  # non-blocking, and checked again once open: a FIFO swapped in after the check must not block
        with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read() if stat.S_ISREG(mode) else b""
    except OSError as e:
        raise error(f"{what} {path} cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{what} {path} is {next((k for test, k in _KINDS if test(mode)), 'special')}, not a regular file")
    return decode_utf8(data, path, what, error=error)
