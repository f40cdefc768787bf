"""The ONNX Runtime session of a package: providers, session options, and the graph's I/O checked
against the package's JSON, so that a mismatch is a PackageError at load time and not an ONNX
Runtime failure in the middle of generation."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import packed
from .contract import GENAI_CONFIG_FILE, GRAPH_OPTIMIZATION_LEVEL, MANIFEST_FILE
from .errors import InvalidParameterError, PackageError, ProviderError
from .foreign import HF_CONFIG_FILE
from .package import PackageSpec

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # cache and logits types


def ort_reason(error: Exception) -> str:
    """The useful part of an ONNX Runtime exception: its first line without the status-code prefix,
    the C++ source location and function signature, which mean nothing to a user."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"^(Load model from .*? failed:|Error in execution: )", "", text)
    text = re.sub(r"\S+\.(cc|cpp|h):\d+ (\S+\(.*?\)( const)? )?", "", text)
    return text.split("Status Message: ")[-1].strip()


def resolve_providers(provider: str) -> list[str]:
    available = ort.get_available_providers()
    if provider == "auto":
        return [PROVIDERS["cuda"], PROVIDERS["cpu"]] if PROVIDERS["cuda"] in available else [PROVIDERS["cpu"]]
    if not isinstance(provider, str) or provider not in PROVIDERS:
        raise ProviderError(f"unknown provider {provider!r}; choose one of 'cpu', 'cuda', 'auto'")
    name = PROVIDERS[provider]
    if name not in available:
        raise ProviderError(
            f"provider {provider!r} ({name}) is not available in this onnxruntime build; available: "
            f"{', '.join(available)}. For CUDA install onnxruntime-gpu instead of onnxruntime."
        )
    return [name] if provider == "cpu" else [name, PROVIDERS["cpu"]]


def max_threads() -> int:
    """The most intra-op threads a session may ask for: the CPUs this process may run on. A pool larger than that
    only makes threads wait for each other, and each thread needs a stack: a thousand of them may fail to start
    under a memory limit, where ONNX Runtime then hangs instead of failing."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not every OS has it
        cpus = os.cpu_count() or 1
    return max(1, cpus)


def check_threads(threads: object) -> None:
    """InvalidParameterError unless threads is None or an integer from 1 to max_threads()."""
    if threads is None:
        return
    limit = max_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= limit:
        raise InvalidParameterError(
            f"threads must be an integer from 1 to {limit} (the CPUs this process may use) or None, got {threads!r}"
        )


def open_session(model_path: Path, providers: list[str], threads: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_OPTIMIZATION_LEVEL)  # >= basic
    options.log_severity_level = 3  # errors only: warnings about unused initializers are noise to users
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    prepared = packed.prepare(model_path, options, providers)  # GGUF blocks as stored: native ops or the fallback
    try:
        with reclaiming_read_pages(model_path.parent):
            session = ort.InferenceSession(str(prepared.model_path), options, providers=providers)
    except Exception as e:  # onnxruntime raises its own pybind exception types
        raise PackageError(f"ONNX Runtime cannot load {prepared.model_path.name}: {ort_reason(e)}") from None
    packed.opened(session, prepared)
    _return_freed_heap()
    return session


def _return_freed_heap() -> None:
    """Hand the heap that building the session freed back to the system. Constant folding of compact GGUF
    blocks (export/compact_blocks.py) makes and frees several copies of their weights; glibc keeps such freed
    memory in the process until asked (what that kept: docs/results.md, "Compact storage")."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # another C library: nothing to ask it
        return
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+ *(.*)$")  # maps: a mapping; smaps: its header
_MADV_DONTNEED = 4  # Linux's value, the same on every architecture


def _madvise():
    """libc's madvise(address, length, advice), errno kept; None elsewhere than Linux or with another C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _drop_read_weight_pages(folder: Path) -> None:
    """Let go of the package's file pages that building the session read. ONNX Runtime maps external data into
    memory and prepacks MatMulNBits and MatMul weights into copies of its own; a weight that another node also
    reads stays mapped (a tied embedding gathers rows of the LM head's blocks), with every page the prepacking
    read still resident, though a decode step needs a few of them. A mapping none of whose pages was ever
    written (no Anonymous pages: a write to a private mapping copies the page) holds exactly the file's bytes,
    so dropping its pages changes nothing but the resident size: a later read maps them again from the page
    cache (what this saves: docs/benchmarks.md, "Real sizes: where a K-quant step goes")."""
    madvise = _madvise()
    if madvise is None:
        return
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:  # no procfs: nothing to do
        return
    prefix = str(folder.resolve()) + os.sep
    mapping, clean = None, False
    for line in [*smaps.splitlines(), "0-0 - - - - end"]:
        header = _MAPPING.match(line)
        if header is None:
            if line.startswith("Anonymous:"):  # pages copied on write; a file page not yet written back counts
                # as Private_Dirty though it holds the file's bytes
                clean = clean and line.split()[1] == "0"
            continue
        if mapping is not None and clean:
            madvise(mapping[0], mapping[1] - mapping[0], _MADV_DONTNEED)
        start, end, path = header.groups()
        mapping = (int(start, 16), int(end, 16)) if path.startswith(prefix) else None
        clean = mapping is not None


_MADV_PAGEOUT = 21  # Linux 5.4+, the same value on every architecture


@contextmanager
def reclaiming_read_pages(folder: Path, period: float = 0.02) -> Iterator[None]:
    """Around a session's build: every `period` seconds, ask Linux to reclaim the pages of the package's files that
    the process has mapped (madvise MADV_PAGEOUT on each mapping of a file in `folder`); when the build is done, drop
    what it left resident (`_drop_read_weight_pages`).

    ONNX Runtime maps the weights and prepacks each MatMulNBits' B and scales into copies of its own. It lets B's
    mapping go after, but keeps the scales mapped (is_packed false at int8 compute: the kernel is handed them at
    each run), so every scale page the prepacking read stays resident until the build ends: the package's scales
    on top of all its prepacked copies, and the largest weight's pages while it is packed (4B Q8_0: 0.99 GB of
    file pages at the build's height, 0.26 GB with this; docs/results.md, "Read pages reclaimed while a session
    builds"). Reclaiming never loses data: a file page is read again from the file, and an anonymous page (the
    mapping's address taken by another allocation after ONNX Runtime unmapped it) stays as it is without swap, or
    is swapped out and back. So it may race with ONNX Runtime's mapping and unmapping, which MADV_DONTNEED may not
    (it would zero such a page): that waits for the build's end. The pages reclaimed leave the page cache too, so
    the package's next load reads them from the file again.
    Elsewhere than Linux it does nothing (as `_drop_read_weight_pages`); on a kernel without MADV_PAGEOUT it only
    drops pages after the build."""
    madvise = _madvise()
    if madvise is None:
        yield
        return
    prefix = str(folder.resolve()) + os.sep
    done = threading.Event()

    def reclaim_once() -> bool:
        """One pass over the process's mappings; False when the kernel has no MADV_PAGEOUT (or no /proc)."""
        try:
            with open("/proc/self/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:
            return False
        for line in lines:
            start, end, path = _MAPPING.match(line).groups()
            if path.startswith(prefix):
                start, end = int(start, 16), int(end, 16)
                if madvise(start, end - start, _MADV_PAGEOUT) != 0 and ctypes.get_errno() == errno.EINVAL:
                    return False  # a kernel before 5.4 (ENOMEM, a mapping gone meanwhile, is expected)
        return True

    def reclaim() -> None:
        while not done.wait(period) and reclaim_once():
            pass

    thread = threading.Thread(target=reclaim, name="reclaim-read-pages", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    _drop_read_weight_pages(folder)


@dataclass
class GraphFacts:
    """What the graph itself says, beyond the JSON: read once at load."""

    uses_position_ids: bool
    kv_dtype: type  # np.float32 or np.float16
    logits_dtype: type


def check_io(spec: PackageSpec, session: ort.InferenceSession) -> GraphFacts:
    """The graph's inputs and outputs against the package description."""
    arch, io = spec.arch, spec.io
    name = spec.model_path.name
    described = {"edgelm": MANIFEST_FILE, "genai": GENAI_CONFIG_FILE}.get(spec.kind, HF_CONFIG_FILE)  # the JSON
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    # before building 2 * n_layer names: n_layer may be huge (a hybrid's layer_types is a list the JSON holds);
    # listed: the manifest holds lists of n_layer
    listed = arch.states.layer_types is not None or arch.kv.kv_source is not None
    if (len(arch.cache_kinds()) if listed else 2 * arch.n_layer) > len(inputs):
        raise PackageError(f"{described} says {arch.n_layer} layers, but {name} has only {len(inputs)} inputs")
    past, present = arch.past_names(io), arch.present_names(io)
    needed_in = [io.input_ids, io.attention_mask, *past]
    needed_out = [io.logits, *present]
    missing = [n for n in needed_in if n not in inputs] + [n for n in needed_out if n not in outputs]
    if missing:
        raise PackageError(
            f"{name} does not match {described}: no I/O named "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
        )
    uses_position_ids = io.position_ids is not None and io.position_ids in inputs
    if io.logits_to_keep and io.logits_to_keep not in inputs:
        overridable = {i.name for i in session.get_overridable_initializers()}
        if io.logits_to_keep not in overridable:
            raise PackageError(f"{name} has no input {io.logits_to_keep}, which {described} names logits_to_keep")
    bound = needed_in + ([io.position_ids] if uses_position_ids else [])
    if len(set(bound)) < len(bound) or len(set(needed_out)) < len(needed_out):
        raise PackageError(f"{described} gives two of {name}'s inputs or outputs the same name")
    unbound = sorted(set(inputs) - set(bound))
    if unbound:
        raise PackageError(f"{name} has inputs {described} does not name: {', '.join(unbound[:3])}")
    # fixed axes must agree with the JSON: caches (B, n_kv_head, T, head_dim), logits (B, T, vocab)
    agrees = lambda dim, expected: not isinstance(dim, int) or dim == expected  # a symbolic axis always does
    for n, (layer, kind) in zip(past + present, 2 * arch.cache_layers(), strict=True):
        shape = inputs[n].shape if n in inputs else outputs[n].shape
        if kind not in ("key", "value"):  # a state: (batch, *the manifest's state shape)
            expected = arch.cache_shape(kind, 1)[1:]
            if len(shape) != 1 + len(expected) or not all(map(agrees, shape[1:], expected)):
                raise PackageError(
                    f"{n} in {name} has shape {shape}; {described} says (batch, {', '.join(map(str, expected))})"
                )
            continue
        heads, head_dim = arch.kv_shape(layer)
        if len(shape) != 4 or not (agrees(shape[1], heads) and agrees(shape[3], head_dim)):
            raise PackageError(
                f"{n} in {name} has shape {shape}; {described} says (batch, {heads}, length, {head_dim})"
            )
    shape = outputs[io.logits].shape
    if len(shape) != 3 or not agrees(shape[2], arch.vocab_size):
        raise PackageError(
            f"{io.logits} in {name} has shape {shape}; {described} says (batch, length, {arch.vocab_size})"
        )
    logits_dtype = _ORT_TYPES.get(outputs[io.logits].type)
    if logits_dtype is None:
        raise PackageError(f"unsupported logits type {outputs[io.logits].type}")
    kv_dtype = _ORT_TYPES.get(inputs[past[0]].type)
    if kv_dtype is None:
        raise PackageError(f"unsupported KV-cache type {inputs[past[0]].type}")
    return GraphFacts(uses_position_ids=uses_position_ids, kv_dtype=kv_dtype, logits_dtype=logits_dtype)
