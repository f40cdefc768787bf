"""A bounded walk over a GGUF file's header, before `gguf.GGUFReader` sees it.

GGUFReader trusts the counts and lengths it reads: a string array that claims 2**63 entries makes it loop for
ever, and a tensor past the end of the file is only found when its data is read. This walk checks every count,
length and offset against the file size first, so a hostile file costs at most one pass over its header.
Layout (little-endian, version 2 or 3): https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # a dimension product above this is not a model tensor
# value type id -> byte size of the scalar types; 8 is a string, 9 an array
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


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


def _skip_value(cursor: _Cursor, value_type: int, key: str, depth: int = 0) -> None:
    if value_type in SCALAR_SIZES:
        cursor.take(SCALAR_SIZES[value_type], f"value of {key}")
    elif value_type == STRING:
        cursor.take(cursor.unpack("<Q", f"string length of {key}"), f"string value of {key}")
    elif value_type == ARRAY and depth == 0:
        item_type = cursor.unpack("<I", f"array type of {key}")
        count = cursor.unpack("<Q", f"array length of {key}")
        if item_type in SCALAR_SIZES:
            cursor.take(count * SCALAR_SIZES[item_type], f"array {key}")
            return
        if item_type != STRING or count * 8 > cursor.size - cursor.offset:
            raise HeaderError(f"array {key} of type {item_type} with {count} entries does not fit the file")
        for _ in range(count):  # bounded: each entry takes at least 8 bytes of the file
            _skip_value(cursor, STRING, key, depth + 1)
    else:
        raise HeaderError(f"metadata {key} has unsupported value type {value_type}")


def check_header(path: Path) -> None:
    """Raise HeaderError when `path` is not a well-formed little-endian GGUF v2/v3 file with in-bounds tensors."""
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
        alignment = 32
        for _ in range(kv_count):
            key = _printable(cursor.string("metadata key"))
            value_type = cursor.unpack("<I", f"type of {key}")
            if key == "general.alignment":
                if value_type != 4:
                    raise HeaderError("general.alignment must be a uint32")
                alignment = struct.unpack_from("<I", data, cursor.offset)[0] if cursor.offset + 4 <= size else 0
                if alignment == 0 or alignment & (alignment - 1):
                    raise HeaderError(f"general.alignment {alignment} is not a power of two")
            _skip_value(cursor, value_type, key)
        tensors = []
        for _ in range(tensor_count):
            name = _printable(cursor.string("tensor name"))
            n_dims = cursor.unpack("<I", f"dimension count of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise HeaderError(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            dims = [cursor.unpack("<Q", f"dimensions of {name}") for _ in range(n_dims)]
            raw_type = cursor.unpack("<I", f"type of {name}")
            offset = cursor.unpack("<Q", f"data offset of {name}")
            tensors.append((name, dims, raw_type, offset))
        data_start = -(-cursor.offset // alignment) * alignment
    for name, dims, raw_type, offset in tensors:
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
        end = data_start + offset + elements // block_size * type_size
        if end > size:
            raise HeaderError(f"tensor {name} data ends at byte {end}, past the end of the file ({size} bytes)")
