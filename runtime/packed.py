"""Packages that hold a GGUF file's blocks as the file stores them, and the two ways the runtime runs them.

Export writes each kept linear as one `ai.edgelm.MatMulPacked` node (and a kept embedding as `ai.edgelm.GatherPacked`)
on the file's rows, uint8 [N, row_bytes] (the contract of ONNX Runtime's com.microsoft.MatMulPacked: `packed_type`
the ggml type number, N, K), so the package is the file's size. The runtime runs them

- **native**: through edgelm's kernels (runtime/native.py builds runtime/csrc/ on first use), registered with
  `SessionOptions.register_custom_ops_library`, on the CPU provider; or
- **fallback**, where the library cannot be built or loaded, where `EDGELM_NATIVE=0`, and on CUDA: the graph export
  wrote beside model.onnx (`FALLBACK_MODEL`, today's MatMulNBits form of the same linears) opened with the
  MatMulNBits arrays converted from the raw blocks at load (runtime/block_types.py, numpy) and handed over with
  `SessionOptions.add_external_initializers`; `FALLBACK_PLAN` says which array comes from which raw tensors. Its
  other initializers point at model.onnx's own bytes. The fallback holds the converted arrays in memory (about 1.5-1.8x
  the blocks) and warns once.
"""

from __future__ import annotations

import json
import mmap
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .block_types import FORMATS, pack, row_bytes, unpacked
from .errors import PackageError
from .onnx_external import ExternalData, check_ranges, external_data, operators

DOMAIN = "ai.edgelm"
PACKED_TYPES = (2, 3, 6, 7, 8, 12, 13, 14)  # ggml types the kernels read: runtime/csrc/blocks.c's TYPES
FALLBACK_MODEL = "model.fallback.onnx"
FALLBACK_PLAN = "model.fallback.json"
CONVERTED = "edgelm:converted-at-load"  # the fallback graph's location of the arrays the runtime computes
PLAN_FORMAT = 1
CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class KernelPath:
    """How a package's packed blocks run: the native kernels (and their ISA) or the fallback graph, and why."""

    native: bool
    isa: str | None  # the kernels' instruction set; None on the fallback
    reason: str  # why the fallback runs; "" on the native path

    def describe(self) -> str:
        return f"native kernels ({self.isa})" if self.native else f"fallback MatMulNBits graph ({self.reason})"

    def to_json(self) -> dict:
        return {"path": "native" if self.native else "fallback", "isa": self.isa, "reason": self.reason or None}


def uses_packed(model_path: Path) -> bool:
    return any(op.domain == DOMAIN for op in operators(model_path))


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"edgelm's native kernels are not used ({reason}): the package's GGUF blocks run as MatMulNBits "
            "converted at load (slower, more memory)",
            RuntimeWarning,
            stacklevel=4,
        )


@dataclass
class Prepared:
    """What to open: the graph's path, how its blocks run, and the arrays the session reads (kept alive with it)."""

    model_path: Path
    kernels: KernelPath | None  # None: the package has no packed blocks
    arrays: dict[str, np.ndarray]


_opened: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> its Prepared (arrays kept alive)


def opened(session, prepared: Prepared) -> None:
    """Remember how `session` was prepared (its arrays live as long as it does)."""
    _opened[session] = prepared


def kernel_path(session) -> KernelPath | None:
    """How a session's packed blocks run; None for a package without them (or a session not opened here)."""
    prepared = _opened.get(session)
    return None if prepared is None else prepared.kernels


def graph_path(session, default: Path) -> Path:
    """The graph a session runs: the fallback graph where it runs that, else `default` (model.onnx)."""
    prepared = _opened.get(session)
    return default if prepared is None else prepared.model_path


def prepare(model_path: Path, options, providers: list[str]) -> Prepared:
    """Set up `options` (an ort.SessionOptions) to open a package's graph: unchanged for one without packed blocks;
    the custom ops registered where they run; else the fallback graph and its converted arrays."""
    if not uses_packed(model_path):
        return Prepared(model_path, None, {})
    from . import native  # noqa: PLC0415 - builds the library on first use only where a package needs it

    if providers[0] != CPU:
        reason = f"{providers[0]} runs the fallback graph"
    else:
        try:
            options.register_custom_ops_library(str(native.ops_library()))
            return Prepared(model_path, KernelPath(True, native.best_isa(), ""), {})
        except native.NativeUnavailable as error:
            reason = str(error).splitlines()[0][:300]
        except Exception as error:  # onnxruntime's own exception types: a library it cannot load
            reason = f"ONNX Runtime cannot load the native library: {str(error).splitlines()[0][:300]}"
    _warn_once(reason)
    return fallback(model_path, options, reason)


def fallback(model_path: Path, options, reason: str, *, graph: Path | None = None) -> Prepared:
    """The fallback graph beside model_path (or `graph`, a copy of it: export's float twin), its converted arrays
    added to `options`."""
    import onnxruntime as ort  # noqa: PLC0415 - the caller has it imported already

    folder = model_path.parent
    plan_file = folder / FALLBACK_PLAN
    graph = folder / FALLBACK_MODEL if graph is None else graph
    if not graph.is_file() or not plan_file.is_file():
        raise PackageError(
            f"{model_path.name} needs edgelm's native kernels ({reason}) and the package has no {FALLBACK_MODEL} / "
            f"{FALLBACK_PLAN} to run without them; re-export it with this edgelm"
        )
    arrays = converted_arrays(model_path, graph, read_plan(plan_file))
    names = list(arrays)
    options.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(arrays[n]) for n in names])
    return Prepared(graph, KernelPath(False, None, reason), arrays)


def read_plan(path: Path) -> dict:
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PackageError(f"{path.name} is not readable JSON: {error}") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT or not isinstance(plan.get("arrays"), dict):
        raise PackageError(f"{path.name} is not a format-{PLAN_FORMAT} fallback plan")
    return plan["arrays"]


class _Rows:
    """model.onnx's raw block tensors, memory-mapped from its data files."""

    def __init__(self, model_path: Path):
        self.folder = model_path.parent
        self.entries = {e.tensor: e for e in external_data(model_path)}
        self.maps: dict[str, np.ndarray] = {}

    def __call__(self, name: str, kind: int, n: int, k: int) -> np.ndarray:
        entry = self.entries.get(name)
        width = row_bytes(kind, k)
        if entry is None:
            raise PackageError(f"{FALLBACK_PLAN} names raw blocks {name!r} that model.onnx does not keep externally")
        if entry.location not in self.maps:
            with open(self.folder / entry.location, "rb") as f:
                self.maps[entry.location] = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
        offset = int(entry.offset or 0)
        length = int(entry.length) if entry.length is not None else n * width
        if length != n * width:
            raise PackageError(f"raw blocks {name!r} hold {length} bytes, not {n} rows of {width}")
        return self.maps[entry.location][offset : offset + length].reshape(n, width)


def _widened(values, scales, offsets, *, native_block: int, block_size: int):
    factor = native_block // block_size
    if factor == 1:
        return values, scales, offsets
    return values, np.repeat(scales, factor, axis=1), None if offsets is None else np.repeat(offsets, factor, axis=1)


def converted_arrays(model_path: Path, graph: Path, plan: dict) -> dict[str, np.ndarray]:
    """Every array the fallback graph names at CONVERTED, from model.onnx's raw blocks (plan: fallback name -> what
    it is made of), after checking the graph's other external data against model.onnx's."""
    rows = _Rows(model_path)
    entries = external_data(graph)
    outside = [e for e in entries if e.location != CONVERTED]
    own = {e.location for e in rows.entries.values()}
    if any(e.location not in own for e in outside):
        raise PackageError(f"{graph.name} names external data that {model_path.name} does not")
    check_ranges(graph, outside, {loc: graph.parent / loc for loc in own})
    wanted = {e.tensor: e for e in entries if e.location == CONVERTED}
    if set(wanted) != set(plan):
        raise PackageError(f"{graph.name} and {FALLBACK_PLAN} do not name the same converted arrays")
    made: dict[tuple, tuple] = {}
    arrays = {}
    for name, item in plan.items():
        if isinstance(item, dict) and "same_as" in item:  # a second initializer of the same bytes (a tied gather)
            continue
        arrays[name] = _array(item, rows, made)
    for name, item in plan.items():
        if "same_as" in item:
            if item["same_as"] not in arrays:
                raise PackageError(f"{FALLBACK_PLAN}: {name} is the same as {item['same_as']!r}, which it lacks")
            arrays[name] = arrays[item["same_as"]]
        _check_size(wanted[name], arrays[name], name)
    return arrays


def _check_size(entry: ExternalData, array: np.ndarray, name: str) -> None:
    if entry.length is not None and int(entry.length) != array.nbytes:
        raise PackageError(f"{FALLBACK_MODEL}'s {name} is {entry.length} bytes but its blocks make {array.nbytes}")


def _array(item: dict, rows: _Rows, made: dict) -> np.ndarray:
    """One fallback array: MatMulNBits' B (N, K / block, blob), its scales (N, K / block) or the offsets
    (K / block, N), of the parts (raw tensors along the outputs) in `bits` and `block_size`."""
    try:
        array, bits, block_size, k = item["array"], int(item["bits"]), int(item["block_size"]), int(item["k"])
        parts = [(str(p["tensor"]), int(p["type"]), int(p["rows"])) for p in item["parts"]]
    except (KeyError, TypeError, ValueError):
        raise PackageError(f"{FALLBACK_PLAN} has a malformed entry: {str(item)[:200]}") from None
    key = (tuple(parts), bits, block_size, k)
    if key not in made:
        made.clear()  # the three arrays of one linear are asked for in turn: keep one linear's unpacking
        pieces = []
        for tensor, kind, n in parts:
            if kind not in FORMATS or FORMATS[kind].block_size % block_size or FORMATS[kind].bits > bits:
                raise PackageError(
                    f"{FALLBACK_PLAN}: ggml type {kind} cannot be held in {bits}-bit blocks of {block_size}"
                )
            native_block = FORMATS[kind].block_size
            pieces.append(_widened(*unpacked(kind, rows(tensor, kind, n, k), k), native_block=native_block,
                                   block_size=block_size))  # fmt: skip
        values = np.concatenate([p[0] for p in pieces])
        scales = np.concatenate([p[1] for p in pieces])
        has_offsets = any(p[2] is not None for p in pieces)
        offsets = (
            np.ascontiguousarray(np.concatenate([p[2] if p[2] is not None else np.zeros_like(p[1]) for p in pieces]).T)
            if has_offsets
            else None
        )
        made[key] = (values, scales, offsets)
    values, scales, offsets = made[key]
    if array == "B":
        return pack(values, bits, block_size)
    if array == "scales":
        return scales
    if array == "offsets" and offsets is not None:
        return offsets
    raise PackageError(f"{FALLBACK_PLAN} asks for {array!r} of blocks that have none")


def add_genai_custom_ops(folder: Path) -> Path:
    """Make a packed package runnable by onnxruntime-genai: a copy of the native library built on this machine put
    in the folder (genai loads custom-op libraries only from inside the model's folder) and named by its
    genai_config.json's decoder session option custom_ops_library. Returns the copy's path. The library is this
    machine's build: run this again where the package is copied. The manifest's hash of genai_config.json then no
    longer matches; edgelm's runtime does not read that file for a package of its own."""
    import shutil  # noqa: PLC0415

    from . import native  # noqa: PLC0415 - builds the library on first use
    from .contract import GENAI_CONFIG_FILE  # noqa: PLC0415

    folder = Path(folder)
    library = folder / native.ops_library().name
    shutil.copyfile(native.ops_library(), library)
    path = folder / GENAI_CONFIG_FILE
    config = json.loads(path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["custom_ops_library"] = str(library.resolve())
    path.write_text(json.dumps(config, indent=2) + "\n")
    return library
