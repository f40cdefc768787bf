"""Every family streams its weights (export/lazy_weights.py), not only Llama's: opening a folder or GGUF file reads
no weight; an export holds a few weights at a time, not the model; and it writes the same package as with every
weight read into memory first (the export before streaming).

The memory is counted as the bytes of the weights read from the folder and still held (in memory, not mapped): the
export before streaming held them all."""

from __future__ import annotations

import weakref

import pytest
import torch
from family_cases import CASES
from helpers import quiet, save_random_model

from edgelm.export import checkpoint, lazy_weights, onnx_export, source
from edgelm.export.families import FAMILIES
from edgelm.export.lazy_weights import materialize
from edgelm.export.onnx_export import export_package
from edgelm.export.source import open_source

# one case of each row whose module does its own work on the state dict or its own reference model
pytestmark = pytest.mark.slow  # every family case exported while its weights stream


STREAMED = ["smollm3", "granite", "granitemoehybrid", "phi3-longrope-short", "lfm2", "qwen3_5_text", "gemma3_text"]
LAYERS = 8  # many layers of wide MLPs: no single weight is a large part of the model


def _deep(case: str) -> dict:
    config = CASES[case].config | dict(num_hidden_layers=LAYERS, intermediate_size=512)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:2] * (LAYERS // 2)
    if case == "granitemoehybrid":
        config["shared_intermediate_size"] = 512
    return config


@pytest.fixture(scope="module")
def deep_folders(tmp_path_factory):
    made = {}

    def folder(case: str):
        if case not in made:
            made[case] = tmp_path_factory.mktemp(case)
            save_random_model(made[case], CASES[case].classes, _deep(case))
        return made[case]

    return folder


@pytest.mark.parametrize("case", sorted(c for c, spec in CASES.items() if not spec.image_text_of))
def test_opening_reads_no_weight(families, case) -> None:
    assert FAMILIES[CASES[case].model_type].lazy_weights
    model = open_source(families.model(case)[1]).model
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("case", ["phi3-longrope-short", "lfm2", "granite", "smollm3"])
def test_opening_a_gguf_file_reads_no_weight(families, case) -> None:
    """Phi-3's packed tensors split and LFM2's squeezed kernels reshaped as loaders, before anything is read."""
    model = open_source(families.gguf(case)).model
    assert all(p.is_meta for p in model.parameters())


class Held:
    """The bytes of weights read from a folder and not yet let go, and their peak: each weight read is made a numpy
    array whose release (a weak reference) ends its count."""

    def __init__(self, monkeypatch):
        self.now = self.peak = 0
        load = checkpoint._load_safetensor

        def counted(path, name):
            array = load(path, name).numpy().copy()
            self.now += array.nbytes
            self.peak = max(self.peak, self.now)
            weakref.finalize(array, self._release, array.nbytes)
            return torch.from_numpy(array)

        monkeypatch.setattr(checkpoint, "_load_safetensor", counted)

    def _release(self, nbytes: int) -> None:
        self.now -= nbytes


@pytest.mark.parametrize("case", STREAMED)
def test_export_holds_a_few_weights_and_writes_the_whole_models_package(
    deep_folders, case, tmp_path, monkeypatch
) -> None:
    folder = deep_folders(case)
    weights = sum(p.numel() * 4 for p in open_source(folder).model.parameters())  # float32 files
    largest = max(p.numel() * 4 for p in open_source(folder).model.parameters())
    monkeypatch.setattr(lazy_weights, "SMALL_BYTES", 0)  # every weight lazy, however small the test model
    held = Held(monkeypatch)
    export_package(folder, tmp_path / "streamed", progress=quiet, bars=False)
    assert held.now == 0
    # at most the largest weight beside a layer's worth (a packed linear's parts, Q, K and V, are read together)
    assert held.peak <= largest + weights / LAYERS, (held.peak, weights)

    opened = source.open_source

    def whole(path):
        src = opened(path)
        materialize(src.model)
        return src

    monkeypatch.setattr(onnx_export, "open_source", whole)
    export_package(folder, tmp_path / "whole", progress=quiet, bars=False)
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name
