"""A GGUF file's large tensors are dequantized a slice of rows at a time where export reads them whole otherwise:
the finiteness check and the proof's float64 reference (export/lazy_weights.py row_slices). A 1B model's tied
head whole is 1 GB of float32, and gguf-py's dequantizers take about twice that again beside it: what made the
peak of a kept-block export (docs/results.md, "Scale: export memory")."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf_blocks import HIDDEN, PROMPT, VOCAB, write_llama  # noqa: E402

from edgelm.export import lazy_weights  # noqa: E402
from edgelm.export.checkpoint import CheckpointError, check_finite  # noqa: E402
from edgelm.export.gguf import GGUFModel  # noqa: E402
from edgelm.export.lazy_weights import float64_stream, materialize  # noqa: E402
from edgelm.export.source import open_source  # noqa: E402

HEAD_BYTES = VOCAB * HIDDEN * 4  # the tied Q6_K head in float32


@pytest.fixture
def q6k_head(tmp_path, monkeypatch):
    """A tiny Llama GGUF whose tied head is Q6_K, slices of 64 KB (float64) and every whole read recorded."""
    path = write_llama(tmp_path / "q6k.gguf", {"token_embd": Q.Q6_K}, layers=1, seed=3)
    monkeypatch.setattr(lazy_weights, "SLICE_BYTES", 64 << 10)
    whole, ranges = [], []
    tensor, row_range = GGUFModel.tensor, GGUFModel.row_range
    monkeypatch.setattr(GGUFModel, "tensor", lambda self, name: whole.append(name) or tensor(self, name))
    monkeypatch.setattr(
        GGUFModel, "row_range", lambda self, name, a, b: ranges.append(name) or row_range(self, name, a, b)
    )
    return path, whole, ranges


def _check_finite_peak(model, name: str) -> int:
    """Bytes of numpy arrays (gguf-py's dequantizers' and the slices') held at once while check_finite runs."""
    tracemalloc.start()
    try:
        check_finite(model, name)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_check_finite_reads_the_head_in_slices(q6k_head) -> None:
    path, whole, ranges = q6k_head
    model = open_source(path).model
    whole.clear()
    peak = _check_finite_peak(model, path.name)
    assert "model.embed_tokens.weight" not in whole and ranges.count("model.embed_tokens.weight") > 8
    # the largest other weight, read whole (a permuted attention projection), is 256 KB of float32
    assert peak < HEAD_BYTES / 2, f"{peak} bytes held at once; the head alone is {HEAD_BYTES}"
    embedding = model.model.embed_tokens.weight
    embedding.loader = dataclasses.replace(embedding.loader, row_range=None)  # as before: read whole
    assert _check_finite_peak(model, path.name) > HEAD_BYTES


def test_a_nan_in_one_slice_is_counted(q6k_head, monkeypatch) -> None:
    path, _, _ = q6k_head
    model = open_source(path).model
    row_range = GGUFModel.row_range

    def poisoned(self, name, start, stop):
        rows = row_range(self, name, start, stop)
        if name == "model.embed_tokens.weight" and start <= 1000 < stop:
            rows[1000 - start, :3] = np.nan
        return rows

    monkeypatch.setattr(GGUFModel, "row_range", poisoned)
    said = rf"embed_tokens.weight.*holds 3 NaN or inf value\(s\) of {VOCAB * HIDDEN}"  # the whole tensor's count
    with pytest.raises(CheckpointError, match=said):
        check_finite(model, path.name)


def test_float64_reference_in_slices_is_the_whole_model(q6k_head) -> None:
    path, whole, ranges = q6k_head
    ids = torch.tensor([PROMPT])
    mask, positions = torch.ones_like(ids), torch.arange(len(PROMPT))[None]
    exact = open_source(path).model
    materialize(exact)  # every weight read whole, then the whole model in float64
    with torch.no_grad(), float64_stream(exact):
        expected = exact(ids, mask, positions)[0]
    streamed = open_source(path).model
    whole.clear()
    ranges.clear()
    with torch.no_grad(), float64_stream(streamed):
        logits = streamed(ids, mask, positions)[0]
    assert "model.embed_tokens.weight" not in whole and ranges.count("model.embed_tokens.weight") > 8
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)


def test_a_large_kept_table_is_written_a_slice_of_rows_at_a_time(q6k_head, tmp_path, monkeypatch) -> None:
    """The kept Q6_K head unpacked and written in slices of rows (export/graph_blocks.py SLICED_WEIGHTS; Gemma 4's
    2.3B-weight per-layer table whole was 9 GB of temporaries) gives the bytes of the whole-table write."""
    from edgelm.export import graph_blocks
    from edgelm.export.decoder import NBits
    from edgelm.export.onnx_export import export_package

    path, _, _ = q6k_head
    export_package(path, tmp_path / "whole", progress=lambda _: None)
    sliced, rows = [], NBits.rows
    monkeypatch.setattr(NBits, "rows", lambda self, a, b: sliced.append((a, b)) or rows(self, a, b))
    monkeypatch.setattr(graph_blocks, "SLICED_WEIGHTS", 4096)
    export_package(path, tmp_path / "sliced", progress=lambda _: None)
    assert len(sliced) > 8  # the head's rows, in slices, for its values and for its scales
    whole, parts = ((tmp_path / d / "model.onnx.data").read_bytes() for d in ("whole", "sliced"))
    assert parts == whole


def test_export_quantize_makes_a_gguf_head_a_slice_of_columns_at_a_time(q6k_head, tmp_path, monkeypatch) -> None:
    """`export FILE.gguf OUT --quantize int4`: the tied head's new 8-bit blocks are made from the embedding's rows
    a slice at a time (export/block_quantize.py _nbits), never the whole float32 table, and give the same bytes."""
    from edgelm.export import graph_blocks
    from edgelm.export.decoder import NBits
    from edgelm.export.onnx_export import export_package

    path, _, _ = q6k_head
    export_package(path, tmp_path / "whole", quantize="int4", progress=lambda _: None)
    sliced, rows = [], NBits.rows
    monkeypatch.setattr(NBits, "rows", lambda self, a, b: sliced.append((a, b)) or rows(self, a, b))
    monkeypatch.setattr(graph_blocks, "SLICED_WEIGHTS", 4096)
    export_package(path, tmp_path / "sliced", quantize="int4", progress=lambda _: None)
    assert len(sliced) > 8
    whole, parts = ((tmp_path / d / "model.onnx.data").read_bytes() for d in ("whole", "sliced"))
    assert parts == whole
