"""A loaded package keeps none of its weight file's pages resident (runtime/session.py): ONNX Runtime maps the
external data and prepacks MatMulNBits weights into copies of its own, and a tied head's blocks, which the
embedding also gathers from, stay mapped with every page the prepacking read."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import quiet  # noqa: E402
from test_gguf_blocks import PROMPT, write_llama  # noqa: E402

from edgelm.export.onnx_export import export_package  # noqa: E402
from edgelm.runtime import load  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def resident_kb(folder: Path) -> int:
    """Resident kB of this process's mappings of files inside `folder`."""
    prefix, total, inside = str(folder.resolve()) + "/", 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):  # a mapping's header line
            inside = len(fields) >= 6 and fields[5].startswith(prefix)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_loaded_plain_package_drops_the_pages_prepacking_read(tmp_path):
    path = write_llama(tmp_path / "q6k.gguf", {"token_embd": Q.Q6_K, "0.ffn_down": Q.Q4_K}, layers=1, seed=3)
    package = tmp_path / "pkg"
    export_package(path, package, accuracy_level=4, compact_blocks=False, progress=quiet)
    stored = {
        i.name: {e.key: e.value for e in i.external_data}
        for i in onnx.load(package / "model.onnx", load_external_data=False).graph.initializer
    }
    for name in ("lm_head.weight_Q8", "lm_head.weight_scales"):  # the gather's names for the head's bytes
        assert stored[f"{name}/rows"] == stored[name] and int(stored[name]["length"]) > 0
    model = load(package, provider="cpu")
    head_kb = 2048 * 256 * (1 + 4 / 16) / 1024  # the tied Q6_K head: 8-bit values, a float32 scale per 16
    # prepacking read it whole, and it stays mapped for the gather; left: the few pages load's checks touch
    assert resident_kb(package) < head_kb / 2
    ids = model.generate(PROMPT, 8, ignore_eos=True).token_ids  # gathering pages back in from the file
    logits, _ = model.forward(np.array([PROMPT]))
    again = load(package, provider="cpu")
    assert again.generate(PROMPT, 8, ignore_eos=True).token_ids == ids
    np.testing.assert_array_equal(again.forward(np.array([PROMPT]))[0], logits)
