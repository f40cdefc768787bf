"""External data and operators in model.onnx, found without `onnx`.

An initializer (or a Constant's tensor, at any depth of subgraphs) may keep its bytes in another file:
TensorProto.external_data is a list of key/value entries, one with key "location", a path relative to
the model file. ONNX Runtime refuses locations outside the model's folder only since late 2025
(microsoft/onnxruntime#26776); older releases, which pyproject allows, follow "../../etc/passwd", an
absolute path or a symlink anywhere. So the runtime checks every location before the session opens
the model. It cannot import `onnx`; it walks the protobuf wire format instead (onnx/onnx.proto's field
numbers), descending only through the fields that can lead to a TensorProto and skipping everything
else, weights included, by length. The file is memory-mapped: only the graph's structure is read.
`operators` walks the same way to every node (op type, domain, integer attributes), which speculative
decoding reads to know whether a step of several tokens computes what steps of one token compute.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

from .errors import PackageError

_ONNX_PATHS = {  # message -> {field number: message type of that (length-delimited) field}
    "ModelProto": {7: "GraphProto", 20: "TrainingInfoProto", 25: "FunctionProto"},
    "TrainingInfoProto": {1: "GraphProto", 2: "GraphProto"},
    "FunctionProto": {7: "NodeProto"},
    "GraphProto": {1: "NodeProto", 5: "TensorProto", 15: "SparseTensorProto"},
    "NodeProto": {5: "AttributeProto"},
    "AttributeProto": {
        5: "TensorProto",  # t
        6: "GraphProto",  # g
        10: "TensorProto",  # tensors
        11: "GraphProto",  # graphs
        22: "SparseTensorProto",  # sparse_tensor
        23: "SparseTensorProto",  # sparse_tensors
    },
    "SparseTensorProto": {1: "TensorProto", 2: "TensorProto"},
    "TensorProto": {13: "StringStringEntryProto"},  # external_data
}


class _Malformed(Exception):
    pass


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _length_delimited(buf: memoryview, start: int, end: int):
    """Yield (field number, start, end) of each length-delimited field of the message in buf[start:end]."""
    for number, wire_type, value in _fields(buf, start, end):
        if wire_type == 2:
            yield number, *value


def _fields(buf: memoryview, start: int, end: int):
    """Yield (field number, wire type, value) of each varint field (value: the integer) and length-delimited field
    (value: its (start, end)) of the message in buf[start:end]; fixed-width fields are skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        wire_type = key & 7
        if wire_type == 0:  # varint
            value, pos = _varint(buf, pos, end)
            yield key >> 3, 0, value
        elif wire_type == 1:  # 64-bit
            pos += 8
        elif wire_type == 2:  # bytes, string, sub-message, packed repeated
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise _Malformed
            yield key >> 3, 2, (pos, pos + length)
            pos += length
        elif wire_type == 5:  # 32-bit
            pos += 4
        else:  # groups (3, 4) are not used by ONNX; 6 and 7 do not exist
            raise _Malformed
    if pos != end:
        raise _Malformed


@dataclass
class ExternalData:
    """One tensor's bytes in another file: TensorProto.external_data's location, offset and length."""

    tensor: str
    location: str
    offset: str | None  # as written (a decimal string); None when absent (0)
    length: str | None  # None when absent (to the end of the file)


def external_data(model_path: Path) -> list[ExternalData]:
    """Every tensor of model.onnx that keeps its bytes in another file, at any depth of the graph."""
    if model_path.stat().st_size == 0:
        return []  # ONNX Runtime refuses an empty file itself
    found = []
    with open(model_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as buf:
            try:
                stack = [("ModelProto", 0, len(buf))]  # a stack, not recursion: subgraphs nest arbitrarily deep
                while stack:
                    message, start, end = stack.pop()
                    if message == "TensorProto":  # name (8) and external_data (13) entries: key (1), value (2)
                        name, entries = "", {}
                        for number, s, e in _length_delimited(buf, start, end):
                            if number == 8:
                                name = bytes(buf[s:e]).decode("utf-8")
                            elif number == 13:
                                entry = {n: bytes(buf[a:b]) for n, a, b in _length_delimited(buf, s, e)}
                                entries[entry.get(1, b"").decode("utf-8")] = entry.get(2, b"").decode("utf-8")
                        if "location" in entries:
                            found.append(
                                ExternalData(name, entries["location"], entries.get("offset"), entries.get("length"))
                            )
                        continue
                    children = _ONNX_PATHS[message]
                    for number, s, e in _length_delimited(buf, start, end):
                        if number in children:
                            stack.append((children[number], s, e))
            except (_Malformed, UnicodeDecodeError):
                raise PackageError(f"{model_path.name} is not a valid ONNX file (corrupt or truncated)") from None
    return found


@dataclass(frozen=True)
class Operator:
    """One node of the graph (or of a subgraph or function): what it runs, and its integer attributes."""

    op_type: str
    domain: str  # "" for the standard ONNX domain, e.g. "com.microsoft"
    ints: dict[str, int]  # integer attributes by name, e.g. {"accuracy_level": 4, "bits": 4}


_NODE_PATHS = {  # message -> {field number: message type}: the fields that can lead to a NodeProto
    "ModelProto": {7: "GraphProto", 25: "FunctionProto"},
    "FunctionProto": {7: "NodeProto"},
    "GraphProto": {1: "NodeProto"},
    "AttributeProto": {6: "GraphProto", 11: "GraphProto"},  # g, graphs: an If's or a Loop's body
}


def operators(model_path: Path) -> list[Operator]:
    """Every node of model.onnx, subgraphs and functions included, in no particular order."""
    found = []
    with open(model_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as buf:
            try:
                stack = [("ModelProto", 0, len(buf))]
                while stack:
                    message, start, end = stack.pop()
                    if message == "NodeProto":  # op_type (4), attribute (5), domain (7)
                        op_type, domain, ints = "", "", {}
                        for number, wire_type, value in _fields(buf, start, end):
                            if wire_type != 2:
                                continue
                            if number == 4:
                                op_type = bytes(buf[value[0] : value[1]]).decode("utf-8")
                            elif number == 7:
                                domain = bytes(buf[value[0] : value[1]]).decode("utf-8")
                            elif number == 5:  # an attribute: name (1), i (3), subgraphs g (6) and graphs (11)
                                name, integer = "", None
                                for n, w, v in _fields(buf, *value):
                                    if n == 1 and w == 2:
                                        name = bytes(buf[v[0] : v[1]]).decode("utf-8")
                                    elif n == 3 and w == 0:
                                        integer = v - (1 << 64) if v >= 1 << 63 else v  # int64, two's complement
                                    elif n in (6, 11) and w == 2:
                                        stack.append(("GraphProto", *v))
                                if integer is not None:
                                    ints[name] = integer
                        found.append(Operator(op_type, domain, ints))
                        continue
                    children = _NODE_PATHS[message]
                    for number, s, e in _length_delimited(buf, start, end):
                        if number in children:
                            stack.append((children[number], s, e))
            except (_Malformed, UnicodeDecodeError, ValueError):  # ValueError: mmap of an empty file
                raise PackageError(f"{model_path.name} is not a valid ONNX file (corrupt or truncated)") from None
    return found


def external_data_locations(model_path: Path) -> list[str]:
    """The external-data locations model.onnx names, from every tensor at any depth of the graph."""
    return [entry.location for entry in external_data(model_path)]


def check_ranges(model_path: Path, entries: list[ExternalData], files: dict[str, Path]) -> None:
    """Each tensor's byte range must be a number inside its file, and no two may overlap: ONNX Runtime reads
    whatever range it is given, and a file edgelm (or any ONNX saver) writes never shares bytes between tensors.
    Two tensors may name the same range exactly (edgelm.writers.onnxfile.SameBytes: a tied head's blocks, gathered
    by the embedding under names of their own). A range without a length (ONNX Runtime then takes the tensor's own
    size) is checked for its offset only."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for entry in entries:
        size = files[entry.location].stat().st_size
        where = f"tensor {entry.tensor!r} in {model_path.name}"
        try:
            offset = int(entry.offset) if entry.offset is not None else 0
            length = int(entry.length) if entry.length is not None else 0
        except ValueError:
            raise PackageError(f"{where}: external data offset/length must be integers") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise PackageError(
                f"{where}: external data bytes {offset}..{offset + length} lie outside {entry.location} ({size} bytes)"
            )
        if length:
            by_file.setdefault(entry.location, []).append((offset, offset + length, entry.tensor))
    for location, ranges in by_file.items():
        ranges.sort()
        for (begin, end, first), (start, stop, second) in zip(ranges, ranges[1:], strict=False):
            if start < end and (start, stop) != (begin, end):  # the same range twice: one tensor's two names
                raise PackageError(
                    f"tensors {first!r} and {second!r} in {model_path.name} overlap in {location} from byte "
                    f"{start}; each tensor must have bytes of its own or name another's exactly (a corrupt or "
                    "crafted model file)"
                )
