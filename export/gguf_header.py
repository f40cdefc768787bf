"""A bounded read of a GGUF file's header: its metadata, and where each tensor's data lies.

Every count, length and offset is checked against the file size as it is read, so a hostile file (a string
array that claims 2**63 entries, a tensor past the end, tensors sharing bytes) costs at most one pass over its
header and gives a HeaderError. No two tensors share bytes, so their data together fits in the file and what a
file can ask export to dequantize is bounded by its size. It replaces `gguf.GGUFReader`'s header walk, which
trusts what it reads and builds a numpy view per metadata element; the `gguf` package still supplies the tensor
types and dequantizes.
Layout (little-endian, version 2 or 3): https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # a dimension product above this is not a model tensor
# value type id -> byte size of the scalar types; 8 is a string, 9 an array
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
SCALAR_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8"}
SCALAR_DTYPES[12] = "<f8"
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous (row) length
    tensor_type: GGMLQuantizationType
    start: int  # byte offset of its data in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    metadata: dict  # key -> int, float, bool, str, or a list of them
    tensors: list[TensorInfo]  # in file order


class HeaderError(ValueError):
    """What is wrong with the header, without the file's name (the caller adds it)."""


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data, self.offset, self.size = data, 0, len(data)

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.offset + n > self.size:
            raise HeaderError(f"{what} at byte {self.offset} runs past the end of the file ({self.size} bytes)")
        start, self.offset = self.offset, self.offset + n
        return start

    def unpack(self, fmt: str, what: str):
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.data, start)[0]

    def string(self, what: str) -> bytes:
        length = self.unpack("<Q", f"{what} length")
        start = self.take(length, what)
        return bytes(self.data[start : start + length])


def _printable(raw: bytes) -> str:
    """A key or tensor name as it may appear in a one-line message: at most 80 characters, no control characters."""
    text = raw[:80].decode("utf-8", "replace")
    return text if text.isprintable() and len(raw) <= 80 else repr(text)


def _read_value(cursor: _Cursor, value_type: int, key: str, depth: int = 0):
    if value_type in SCALAR_SIZES:
        start = cursor.take(SCALAR_SIZES[value_type], f"value of {key}")
        return np.frombuffer(cursor.data, SCALAR_DTYPES[value_type], 1, start)[0].item()
    if value_type == STRING:
        return cursor.string(f"string value of {key}").decode("utf-8")
    if value_type == ARRAY and depth == 0:
        item_type = cursor.unpack("<I", f"array type of {key}")
        count = cursor.unpack("<Q", f"array length of {key}")
        if item_type in SCALAR_SIZES:
            start = cursor.take(count * SCALAR_SIZES[item_type], f"array {key}")
            return np.frombuffer(cursor.data, SCALAR_DTYPES[item_type], count, start).tolist()
        if item_type != STRING or count * 8 > cursor.size - cursor.offset:
            raise HeaderError(f"array {key} of type {item_type} with {count} entries does not fit the file")
        return [_read_value(cursor, STRING, key, depth + 1) for _ in range(count)]  # each takes >= 8 bytes
    raise HeaderError(f"metadata {key} has unsupported value type {value_type}")


def read_header(path: Path) -> Header:
    """The metadata and tensor layout of `path`; HeaderError when it is not a well-formed little-endian GGUF
    v2/v3 file with in-bounds tensors (UnicodeDecodeError for a string that is not UTF-8)."""
    size = path.stat().st_size
    if size < 24:
        raise HeaderError(f"{size} bytes is too short for a GGUF header")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if bytes(data[:4]) != MAGIC:
            raise HeaderError(f"bad magic {bytes(data[:4])!r}, expected {MAGIC!r} (not a GGUF file)")
        cursor.take(4, "magic")
        version = cursor.unpack("<I", "version")
        if version not in (2, 3):
            raise HeaderError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        tensor_count = cursor.unpack("<Q", "tensor count")
        kv_count = cursor.unpack("<Q", "metadata count")
        # Smallest possible entries: a metadata pair is 8 + 4 + 1 bytes, a tensor description 8 + 4 + 4 + 8.
        if kv_count * 13 > size or tensor_count * 24 > size:
            raise HeaderError(f"{kv_count} metadata entries and {tensor_count} tensors cannot fit in {size} bytes")
        metadata = _read_metadata(cursor, kv_count)
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or isinstance(alignment, bool):
            raise HeaderError("general.alignment must be a uint32")
        if alignment <= 0 or alignment & (alignment - 1):
            raise HeaderError(f"general.alignment {alignment} is not a power of two")
        tensors = [_read_tensor_entry(cursor) for _ in range(tensor_count)]
        data_start = -(-cursor.offset // alignment) * alignment
    return Header(metadata, _tensor_infos(tensors, data_start=data_start, size=size))


def _read_metadata(cursor: _Cursor, kv_count: int) -> dict:
    """The `kv_count` metadata pairs: key -> value, each key once."""
    metadata = {}
    for _ in range(kv_count):
        raw_key = cursor.string("metadata key")
        key = _printable(raw_key)
        value_type = cursor.unpack("<I", f"type of {key}")
        if raw_key.decode("utf-8") in metadata:
            raise HeaderError(f"metadata key {key} appears twice")
        metadata[raw_key.decode("utf-8")] = _read_value(cursor, value_type, key)
    return metadata


def _read_tensor_entry(cursor: _Cursor) -> tuple[bytes, str, list[int], int, int]:
    """One tensor description as stored: (raw name, printable name, dims, raw type, data offset)."""
    raw_name = cursor.string("tensor name")
    name = _printable(raw_name)
    n_dims = cursor.unpack("<I", f"dimension count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise HeaderError(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = [cursor.unpack("<Q", f"dimensions of {name}") for _ in range(n_dims)]
    raw_type = cursor.unpack("<I", f"type of {name}")
    offset = cursor.unpack("<Q", f"data offset of {name}")
    return raw_name, name, dims, raw_type, offset


def _tensor_infos(tensors: list[tuple], *, data_start: int, size: int) -> list[TensorInfo]:
    """The tensor descriptions checked: known types, possible dimensions, data inside the file and not shared
    with another tensor, names once."""
    infos, seen = [], set()
    for raw_name, name, dims, raw_type, offset in tensors:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise HeaderError(f"tensor {name} has unknown tensor type {raw_type}") from None
        elements = 1
        for dim in dims:
            elements *= dim
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if elements == 0 or elements > MAX_ELEMENTS or dims[0] % block_size:
            raise HeaderError(f"tensor {name} has impossible dimensions {dims} for type {tensor_type.name}")
        nbytes = elements // block_size * type_size
        end = data_start + offset + nbytes
        if end > size:
            raise HeaderError(f"tensor {name} data ends at byte {end}, past the end of the file ({size} bytes)")
        if raw_name in seen:
            raise HeaderError(f"tensor {name} appears twice")
        seen.add(raw_name)
        infos.append(TensorInfo(raw_name.decode("utf-8"), tuple(dims), tensor_type, data_start + offset, nbytes))
    _check_no_overlap(infos)
    return infos


def _check_no_overlap(infos: list[TensorInfo]) -> None:
    """Each tensor's bytes its own (llama.cpp lays them out one after another): a file whose tensors share
    bytes, one layer's data read as 400 layers, would ask for more work and memory than its size holds."""
    by_start = sorted(infos, key=lambda t: t.start)
    for before, after in zip(by_start, by_start[1:], strict=False):
        if after.start < before.start + before.nbytes:
            raise HeaderError(
                f"tensors {_printable(before.name.encode())} and {_printable(after.name.encode())} overlap "
                f"(bytes {before.start}-{before.start + before.nbytes} and {after.start}-{after.start + after.nbytes})"
            )
