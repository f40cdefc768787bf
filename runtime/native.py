"""edgelm's native kernels (runtime/csrc/*.c): GGUF blocks read as the file stores them, built with the machine's
C compiler on first use into a cache and loaded from there; and whether a package runs through them or through the
fallback (runtime/packed_fallback.py).

Two libraries are built from the same sources: `libedgelm_blocks.so`, the kernels alone (blocks.h's C API, for
ctypes: tests and the gather), and `libedgelm_ops.so`, the kernels plus ONNX Runtime custom ops in the `ai.edgelm`
domain (ort_ops.c; `SessionOptions.register_custom_ops_library`). ONNX Runtime's C headers are not in its wheel:
the build takes them from Debian sid's `libonnxruntime-dev` (`apt-get download`, then `dpkg-deb -x`), once, into
the cache, or from `EDGELM_ORT_INCLUDE` (a folder holding onnxruntime_c_api.h). The C API is append-only and the ops
ask for version 17 (ParallelFor), so a build against 1.23's headers runs on any ONNX Runtime from 1.17 on.

Cache: `$EDGELM_CACHE/native` (default ~/.cache/edgelm/native), one folder per sha256 of the sources, the headers'
version and the compiler's, built under a file lock so that two processes do not race. `EDGELM_NATIVE=0` turns the
kernels off (the fallback runs); `EDGELM_NATIVE_ISA=scalar|avx2|avx512vnni` caps the instruction set.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "csrc"
KERNEL_SOURCES = ("blocks.h", "blocks.c", "blocks_simd.h")
OPS_SOURCES = (*KERNEL_SOURCES, "ort_ops.c")
DOMAIN = "ai.edgelm"  # the custom ops' domain; their contract is com.microsoft.MatMulPacked / GatherPacked's
ORT_DEB = "libonnxruntime-dev"  # Debian sid's package of ONNX Runtime's headers (1.23.2 when written)
DEBIAN_SOURCE = "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main"
CFLAGS = ("-O2", "-std=c11", "-fPIC", "-shared", "-fvisibility=hidden", "-ffp-contract=off", "-fno-fast-math")


class NativeUnavailable(RuntimeError):
    """The native library cannot be had here; the message says why (no compiler, no headers, turned off)."""


def enabled() -> bool:
    return os.environ.get("EDGELM_NATIVE", "1").strip() not in ("0", "off", "false", "no")


def cache_root() -> Path:
    base = os.environ.get("EDGELM_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "edgelm") / "native"


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)


class _Lock:
    """An exclusive lock on a file (fcntl.flock; without fcntl, none: builds land by rename either way)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w")  # noqa: SIM115 - held until __exit__
        try:
            import fcntl
        except ImportError:
            return self
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.file.close()  # releases the flock


def _compiler() -> tuple[str, str]:
    """The C compiler (CC, else gcc, else cc) and its version line."""
    for name in filter(None, (os.environ.get("CC"), "gcc", "cc")):
        path = shutil.which(name)
        if path is not None:
            try:
                version = _run([path, "--version"]).stdout.splitlines()[:1]
            except (OSError, subprocess.SubprocessError):
                continue
            return path, version[0] if version else name
    raise NativeUnavailable("no C compiler (gcc or cc) on PATH")


def _headers_version(include: Path) -> str:
    text = (include / "onnxruntime_c_api.h").read_text(errors="replace")
    line = next((x for x in text.splitlines() if x.startswith("#define ORT_API_VERSION")), "unknown")
    return line.split()[-1]


def ort_include() -> Path:
    """The folder holding onnxruntime_c_api.h: EDGELM_ORT_INCLUDE, or Debian's headers fetched into the cache."""
    given = os.environ.get("EDGELM_ORT_INCLUDE")
    if given:
        if not (Path(given) / "onnxruntime_c_api.h").is_file():
            raise NativeUnavailable(f"EDGELM_ORT_INCLUDE={given} holds no onnxruntime_c_api.h")
        return Path(given)
    root = cache_root() / "headers"
    include = root / "usr" / "include" / "onnxruntime"
    if (include / "onnxruntime_c_api.h").is_file():
        return include
    with _Lock(cache_root() / "headers.lock"):
        if (include / "onnxruntime_c_api.h").is_file():  # another process fetched them meanwhile
            return include
        _fetch_debian_headers(root)
    return include


def _fetch_debian_headers(root: Path) -> None:
    """apt-get download Debian sid's libonnxruntime-dev (its own sources file and lists, nothing of the system's
    changed), then dpkg-deb -x it into `root`."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise NativeUnavailable(
            "ONNX Runtime's C headers are not installed and there is no apt-get/dpkg-deb to fetch Debian's "
            f"{ORT_DEB}; set EDGELM_ORT_INCLUDE to a folder with onnxruntime_c_api.h"
        )
    with tempfile.TemporaryDirectory(prefix="edgelm-ort-headers-") as work:
        work = Path(work)
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "sid.list").write_text(DEBIAN_SOURCE + "\n")
        apt = [
            "apt-get",
            "-q",
            f"-o=Dir::Etc::sourcelist={work / 'sid.list'}",
            "-o=Dir::Etc::sourceparts=-",
            f"-o=Dir::State::Lists={work / 'lists'}",
            "-o=APT::Sandbox::User=root" if os.geteuid() == 0 else "-o=Debug::NoLocking=1",
        ]
        for step in (["update"], ["download", ORT_DEB]):
            done = _run([*apt, *step], cwd=work)
            if done.returncode != 0:
                reason = (done.stderr.strip().splitlines() or ["failed"])[-1]
                raise NativeUnavailable(f"cannot fetch Debian's {ORT_DEB} ({' '.join(step)}): {reason}")
        debs = sorted(work.glob(f"{ORT_DEB}_*.deb"))
        if not debs:
            raise NativeUnavailable(f"apt-get download {ORT_DEB} left no .deb")
        staged = Path(tempfile.mkdtemp(prefix="headers.", dir=root.parent if root.parent.exists() else None))
        done = _run(["dpkg-deb", "-x", str(debs[0]), str(staged)])
        if done.returncode != 0:
            shutil.rmtree(staged, ignore_errors=True)
            raise NativeUnavailable(f"dpkg-deb -x {debs[0].name} failed: {done.stderr.strip()}")
        (staged / "SOURCE").write_text(debs[0].name + "\n")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(staged, root)


def _build(name: str, sources: tuple[str, ...], include: Path | None, defines: tuple[str, ...] = ()) -> Path:
    """runtime/csrc's `sources` compiled into cache_root()/<hash>/`name` (built once, under a lock)."""
    compiler, version = _compiler()
    digest = hashlib.sha256(version.encode() + "".join(f" -D{d}" for d in defines).encode())
    for source in sources:
        digest.update(source.encode() + b"\0" + (SOURCE_DIR / source).read_bytes())
    if include is not None:
        digest.update(b"ort-api " + _headers_version(include).encode())
    folder = cache_root() / digest.hexdigest()[:24]
    library = folder / name
    if library.is_file():
        return library
    with _Lock(folder / f"{name}.lock"):
        if library.is_file():
            return library
        staged = folder / f".{name}.{os.getpid()}"
        command = [compiler, *CFLAGS, *(f"-D{d}" for d in defines), f"-I{SOURCE_DIR}"]
        if include is not None:
            command.append(f"-I{include}")
        command += [str(SOURCE_DIR / s) for s in sources if s.endswith(".c")] + ["-o", str(staged), "-lm"]
        done = _run(command)
        if done.returncode != 0:
            raise NativeUnavailable(f"building {name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(staged, library)
    return library


def _kernels(library: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    i64, ptr = c.c_int64, c.c_void_p
    library.eb_block_shape.argtypes = [c.c_int, c.POINTER(c.c_int), c.POINTER(c.c_int)]
    library.eb_best_isa.restype = c.c_int
    library.eb_isa_supported.argtypes = [c.c_int]
    library.eb_isa_name.restype = c.c_char_p
    library.eb_isa_name.argtypes = [c.c_int]
    library.eb_matmul.argtypes = [c.c_int, c.c_int, ptr, i64, i64, ptr, i64, ptr]
    library.eb_dequantize_row.argtypes = [c.c_int, ptr, i64, ptr]
    return library


@cache
def kernel_library() -> ctypes.CDLL:
    """The kernels alone (no ONNX Runtime headers needed), for ctypes; NativeUnavailable where they cannot be built."""
    if not sys.platform.startswith("linux"):
        raise NativeUnavailable(f"the native kernels are built on Linux only, not {sys.platform}")
    return _kernels(ctypes.CDLL(str(_build("libedgelm_blocks.so", KERNEL_SOURCES, None))))


@cache
def emulated_vnni_library() -> ctypes.CDLL:
    """Tests only: the kernels with their AVX-512 VNNI source compiled for AVX2 (its two VNNI instructions emulated
    exactly, runtime/csrc/blocks.c EB_EMULATED_VNNI), so a CPU without AVX-512 checks that path against the
    reference too; "avx512vnni" there runs wherever AVX2 does. Never loaded by the runtime."""
    if not sys.platform.startswith("linux"):
        raise NativeUnavailable(f"the native kernels are built on Linux only, not {sys.platform}")
    library = _build("libedgelm_blocks_emulated_vnni.so", KERNEL_SOURCES, None, ("EB_EMULATED_VNNI",))
    return _kernels(ctypes.CDLL(str(library)))


@cache
def ops_library() -> Path:
    """libedgelm_ops.so's path, for SessionOptions.register_custom_ops_library; NativeUnavailable with the reason
    where it is turned off (EDGELM_NATIVE=0) or cannot be built."""
    if not enabled():
        raise NativeUnavailable("turned off by EDGELM_NATIVE=0")
    if not sys.platform.startswith("linux"):
        raise NativeUnavailable(f"the native kernels are built on Linux only, not {sys.platform}")
    _compiler()  # no compiler: say so before fetching headers it could not use
    return _build("libedgelm_ops.so", OPS_SOURCES, ort_include())


ISAS = ("scalar", "avx2", "avx512vnni")  # blocks.h's enum eb_isa, in order


@cache
def best_isa() -> str:
    return ISAS[kernel_library().eb_best_isa()]


def block_shape(kind: int) -> tuple[int, int] | None:
    """(weights, bytes) of one block of ggml type `kind`; None for a type the kernels do not read."""
    elems, size = ctypes.c_int(), ctypes.c_int()
    if kernel_library().eb_block_shape(int(kind), ctypes.byref(elems), ctypes.byref(size)) != 0:
        return None
    return elems.value, size.value


def _checked_rows(kind: int, rows, k: int):
    import numpy as np

    shape = block_shape(kind)
    if shape is None:
        raise ValueError(f"ggml type {kind} is not one the native kernels read")
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    if k <= 0 or k % shape[0] or rows.ndim != 2 or rows.shape[1] != k // shape[0] * shape[1]:
        raise ValueError(f"rows {rows.shape} are not K={k} weights of ggml type {kind} a row ({shape} a block)")
    return rows


def matmul(kind: int, rows, x, *, isa: str | None = None, library: ctypes.CDLL | None = None):
    """y = x · Wᵀ, float32 (M, N), through the kernels on one thread: rows uint8 (N, row bytes) of ggml type `kind`,
    x float32 (M, K); `isa` one of ISAS (None: the best this CPU runs); `library` kernel_library() unless given
    (tests: emulated_vnni_library())."""
    import numpy as np

    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be (M, K), got shape {x.shape}")
    rows = _checked_rows(kind, rows, x.shape[1])
    level = ISAS.index(isa or best_isa())
    y = np.empty((x.shape[0], rows.shape[0]), np.float32)
    library = library or kernel_library()
    if not library.eb_isa_supported(level):
        raise NativeUnavailable(f"this CPU does not run {ISAS[level]}")
    status = library.eb_matmul(int(kind), level, x.ctypes.data, x.shape[0], x.shape[1], rows.ctypes.data,
                               rows.shape[0], y.ctypes.data)  # fmt: skip
    assert status == 0, f"eb_matmul refused checked arguments ({kind}, {x.shape}, {rows.shape})"
    return y


def dequantize(kind: int, rows, k: int):
    """float32 (N, K): the weights the kernels read, w = d * sc * c + offset in float32."""
    import numpy as np

    rows = _checked_rows(kind, rows, k)
    out = np.empty((rows.shape[0], k), np.float32)
    for n in range(rows.shape[0]):
        kernel_library().eb_dequantize_row(int(kind), rows[n].ctypes.data, k, out[n].ctypes.data)
    return out


def main() -> int:
    """`python -m edgelm.runtime.native`: build both libraries now (what first use would), print where they are."""
    try:
        print(f"kernels: {kernel_library()._name} ({best_isa()})")
        print(f"ONNX Runtime custom ops: {ops_library()} (headers {ort_include()})")
    except NativeUnavailable as error:
        print(f"native kernels unavailable: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
