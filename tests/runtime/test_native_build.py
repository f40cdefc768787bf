"""Building the native kernels (runtime/native.py): into the cache under a lock, once, however many processes ask at
the same time; a clear reason, and the fallback, where no compiler or no headers can be had."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgelm.runtime import native, packed

BUILD = (
    "import sys; from edgelm.runtime import native; lib = native.ops_library(); "
    "print(lib); print(native.kernel_library()._name)"
)


@pytest.mark.slow  # processes compiling the kernels at once
def test_processes_racing_build_one_library(tmp_path):
    try:
        include = native.ort_include()  # the headers the normal cache holds (fetched once)
    except native.NativeUnavailable as error:
        pytest.skip(f"no ONNX Runtime headers here: {error}")
    env = dict(os.environ, EDGELM_CACHE=str(tmp_path), EDGELM_ORT_INCLUDE=str(include))
    runs = [subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, text=True) for _ in "ab"]
    outputs = [run.communicate(timeout=300)[0].split() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert outputs[0] == outputs[1]  # one library of each, the same paths
    built = sorted(p.name for p in (tmp_path / "native").rglob("*.so"))
    assert built == ["libedgelm_blocks.so", "libedgelm_ops.so"]
    assert not list((tmp_path / "native").rglob(".libedgelm*"))  # no staged leftovers


def test_no_compiler_is_a_reason_and_the_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGELM_CACHE", str(tmp_path))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    native.ops_library.cache_clear()
    try:
        with pytest.raises(native.NativeUnavailable, match="no C compiler"):
            native.ops_library()
    finally:
        native.ops_library.cache_clear()


def test_bad_header_folder_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGELM_ORT_INCLUDE", str(tmp_path))
    with pytest.raises(native.NativeUnavailable, match="holds no onnxruntime_c_api.h"):
        native.ort_include()


def test_packed_types_are_what_the_kernels_read():
    """runtime/packed.py's list (what export packs) is the C table's (runtime/csrc/blocks.c)."""
    try:
        native.kernel_library()
    except native.NativeUnavailable as error:
        pytest.skip(f"native kernels not built: {error}")
    read = [number for number in range(40) if native.block_shape(number) is not None]
    assert read == list(packed.PACKED_TYPES)
