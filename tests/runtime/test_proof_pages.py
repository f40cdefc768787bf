"""A session's build lets go of the package's pages it read (runtime/session.py reclaiming_read_pages): ONNX Runtime
keeps MatMulNBits' scales mapped after prepacking them, so without this every scale page it read stays resident
beside the prepacked copies until the build ends, 0.7-1 GB at 4B (docs/results.md, "Read pages reclaimed while a
session builds"). Used by the runtime's sessions and by export's prepacked proof."""

from __future__ import annotations

import ctypes
import mmap
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import quiet  # noqa: E402
from test_gguf_blocks import write_llama  # noqa: E402

from edgelm.export import parity  # noqa: E402
from edgelm.export.onnx_export import export_package  # noqa: E402
from edgelm.runtime import session  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and MADV_PAGEOUT")


def _resident(folder: Path) -> int:
    """Bytes of the files in `folder` resident in this process's mappings."""
    total, inside = 0, False
    prefix = str(folder.resolve()) + "/"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) == 6 and fields[5].startswith(prefix)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def _no_drop_after(monkeypatch) -> None:
    monkeypatch.setattr(session, "_drop_read_weight_pages", lambda folder: None)


@pytest.mark.parametrize("reclaim", [True, False])
def test_mapped_package_pages_are_reclaimed_while_inside_and_keep_their_bytes(tmp_path, monkeypatch, reclaim) -> None:
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    (tmp_path / "model.onnx.data").write_bytes(data.tobytes())
    _no_drop_after(monkeypatch)
    if not reclaim:  # the control: MADV_NORMAL, a hint that changes nothing
        monkeypatch.setattr(session, "_MADV_PAGEOUT", 0)
    with open(tmp_path / "model.onnx.data", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with session.reclaiming_read_pages(tmp_path, period=0.01):
            view = np.frombuffer(mapped, dtype=np.uint8)
            assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page read
            time.sleep(0.3)  # passes of the reclaiming thread
            resident = _resident(tmp_path)
            assert np.array_equal(view, data)  # read again from the file: the same bytes
            del view
    if reclaim:
        assert resident < 256 << 10, f"{resident} bytes of the mapped file still resident"
    else:
        assert resident >= 4 << 20


def test_pageout_keeps_an_anonymous_page_as_it_is() -> None:
    """What makes reclaiming safe beside ONNX Runtime's own unmapping: an address it let go of and that another
    allocation took is paged out (or, without swap, left alone), never zeroed as MADV_DONTNEED would."""
    anonymous = mmap.mmap(-1, 1 << 20)
    anonymous.write(b"\x5a" * (1 << 20))
    address = ctypes.addressof(ctypes.c_char.from_buffer(anonymous))
    madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(address, 1 << 20, session._MADV_PAGEOUT)
    assert anonymous[:] == b"\x5a" * (1 << 20)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pages")
    path = write_llama(folder / "q8.gguf", {"token_embd": Q.Q6_K}, layers=2, seed=5)
    export_package(path, folder / "pkg", progress=quiet)  # kept blocks at accuracy level 4: a prepacked proof
    return folder / "pkg"


def _logits(built) -> np.ndarray:
    """Logits of one token from an empty cache."""
    feed = {}
    for info in built.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in info.shape]
        if "past" in info.name:
            shape[2] = 0
        dtype = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(info.type, np.float32)
        feed[info.name] = np.ones(shape, dtype=dtype)
    return built.run(None, feed)[0]


def test_the_proof_session_holds_none_of_the_pages_it_read_and_computes_the_same(package, monkeypatch) -> None:
    onnx_path = package / "model.onnx"
    reclaimed = parity._session(onnx_path, prepacking=True)
    assert _resident(package) == 0, "the package's read pages stayed resident after the proof's session build"
    _no_drop_after(monkeypatch)
    monkeypatch.setattr(session, "_MADV_PAGEOUT", 0)
    plain = parity._session(onnx_path, prepacking=True)
    assert _resident(package) > 64 << 10  # the scales it read: the check above can fail
    np.testing.assert_array_equal(_logits(reclaimed), _logits(plain))
