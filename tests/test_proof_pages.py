"""The proof's prepacked session lets go of the package's pages it read (export/parity.py _reclaiming_read_pages):
ONNX Runtime keeps MatMulNBits' scales mapped after prepacking them, so without this every scale page stays
resident beside the prepacked copies, 0.7-1 GB at 4B (docs/results.md, "The proof's session: read pages
reclaimed")."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import quiet  # noqa: E402
from test_gguf_blocks import write_llama  # noqa: E402

from edgelm.export import parity  # noqa: E402
from edgelm.export.onnx_export import export_package  # noqa: E402

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


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pages")
    path = write_llama(folder / "q8.gguf", {"token_embd": Q.Q6_K}, layers=2, seed=5)
    export_package(path, folder / "pkg", progress=quiet)  # kept blocks at accuracy level 4: a prepacked proof
    return folder / "pkg"


def _logits(session) -> np.ndarray:
    names = {i.name: i for i in session.get_inputs()}
    feed = {}
    for name, info in names.items():
        shape = [d if isinstance(d, int) else 1 for d in info.shape]
        if "past" in name:
            shape = [1 if i == 0 else (0 if i == 2 else d) for i, d in enumerate(shape)]
        dtype = np.int64 if "int64" in info.type else (np.int32 if "int32" in info.type else np.float32)
        feed[name] = np.ones(shape, dtype=dtype)
    return session.run(None, feed)[0]


def test_the_prepacked_session_holds_none_of_the_package_pages_it_read(package, monkeypatch) -> None:
    onnx_path = package / "model.onnx"
    kept = parity._session(onnx_path, prepacking=True)
    assert _resident(package) == 0, "the package's read pages stayed resident after the proof's session build"
    # the same session without reclaiming holds the scales it read: the check above can fail
    monkeypatch.setattr(parity, "_MADV_PAGEOUT", 0)  # MADV_NORMAL: a hint that changes nothing
    plain = parity._session(onnx_path, prepacking=True)
    assert _resident(package) > 64 << 10
    np.testing.assert_array_equal(_logits(kept), _logits(plain))  # and it computes the same, to the bit
