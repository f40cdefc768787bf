"""benchmarks/state_memory.py's byte counts, against transformers' own cache after the same tokens: per attention
layer the same keys and values per position, per state layer the same recurrent state and a convolution state one
column shorter (transformers keeps the kernel's width, the runtime kernel - 1, as onnxruntime-genai does); the
fused graph holds each state twice (past and present buffers) and its snapshots whole states."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgelm.runtime import load
from edgelm.runtime.kvcache import make_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from state_memory import array_bytes, formula  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GRAPHS = [(case, graph) for case in ("lfm2", "qwen3_5_text") for graph in ("fused", "standard")]


def transformers_bytes(hf, ids: list[int]) -> dict[str, int]:
    """fp32 bytes of transformers' cache after `ids`, the conv states cut to kernel - 1 columns."""
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    kv = state = 0
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):
            states = [t[..., 1:] for t in layer.conv_states.values()] + list(layer.recurrent_states.values())
            state += sum(t.numel() for t in states if t is not None) * 4  # LFM2 has no recurrent state
        else:
            kv += (layer.keys.numel() + layer.values.numel()) * 4
    return {"kv": kv, "state": state, "total": kv + state}


@pytest.mark.parametrize(("case", "graph"), GRAPHS, ids=["-".join(g) for g in GRAPHS])
def test_cache_bytes_equal_transformers_cache(families, case, graph):
    model = load(families.package(case, graph), provider="cpu", threads=1)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 2000, size=24)]
    expected = transformers_bytes(families.model(case)[0], ids)
    assert expected["kv"] and expected["state"]
    assert formula(model.spec, len(ids)) == expected
    cache = make_cache(model.runner(None), [[0]], capacity=8)  # as a Conversation makes it, then grown
    cache.rewind(0)
    for turn in (ids[:8], ids[8:16], ids[16:]):
        cache.extend(turn)
    held = array_bytes(cache)
    fused = graph == "fused"
    capacity = cache.capacity if fused else len(ids)  # the shared buffers double: 8 -> 16 -> 32
    assert held["kv"] == expected["kv"] * capacity // len(ids)
    assert held["state"] == expected["state"] * (2 if fused else 1)
    assert held["snapshots"] == expected["state"] * len(cache.snapshots)  # 0, 8, 16, 24
    assert len(cache.snapshots) == 4
