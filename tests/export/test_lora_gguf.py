"""LoRA on a GGUF base whose quantized blocks are kept: the linears an adapter changes are written as fp32 (the
file's dequantized weights plus the adapter) and the rest keep their blocks; run-time slots work on such a base.
Both give the --dequantize merged package's logits (float activations: 1e-3, as for kept blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from helpers import quiet  # noqa: E402
from test_gguf import HEADS, HIDDEN, INNER, KV_HEADS, LAYERS, write_gguf  # noqa: E402
from test_gguf_export import KEEP_KINDS  # noqa: E402

from edgelm.export.lora import SlotSpec, convert_adapter  # noqa: E402
from edgelm.export.onnx_export import export_package  # noqa: E402
from edgelm.runtime import load  # noqa: E402

PROMPT = [5, 17, 300, 42, 9, 1000]
HEAD_DIM = HIDDEN // HEADS
SHAPES = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
          "mlp.down_proj": (HIDDEN, INNER)}  # fmt: skip


def write_adapter(folder: Path, *, rank: int = 4, seed: int = 0) -> Path:
    """A PEFT LoRA folder written directly (the layout peft saves), for a model with no transformers folder."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, (out, inner) in SHAPES.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.standard_normal((rank, inner)).astype(np.float32) * 0.2
            tensors[f"{name}.lora_B.weight"] = rng.standard_normal((out, rank)).astype(np.float32) * 0.2
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-gguf")
    return {"gguf": write_gguf(root, "llama", kinds=KEEP_KINDS, tied=True), "adapter": write_adapter(root / "lora"),
            "root": root}  # fmt: skip


def _logits(package: Path, adapter: Path | None = None) -> np.ndarray:
    model = load(package, provider="cpu")
    name = model.load_adapter(adapter) if adapter else None
    return model.forward(np.array([PROMPT]), adapter=name)[0][0]


def test_merge_into_kept_blocks_writes_those_linears_fp32(files):
    root = files["root"]
    kw = dict(accuracy_level=0, progress=quiet)
    plain = export_package(files["gguf"], root / "plain", **kw)
    merged = export_package(files["gguf"], root / "merged", lora=[(files["adapter"], 1.0)], **kw)
    reference = export_package(files["gguf"], root / "deq", dequantize=True, lora=[(files["adapter"], 1.0)], **kw)
    assert merged["precision"] != "fp32" and reference["precision"] == "fp32"
    assert merged["recipe"]["float_linears"] > plain["recipe"]["float_linears"]  # qkv and down of each layer
    expected = _logits(root / "deq")
    assert np.abs(_logits(root / "merged") - expected).max() < 1e-3
    assert np.abs(_logits(root / "plain") - expected).max() > 1e-2  # the adapter matters


def test_slots_on_kept_blocks(files):
    root = files["root"]
    export_package(files["gguf"], root / "slots", lora_slots=SlotSpec(["q_proj", "v_proj", "down_proj"], 8),
                   accuracy_level=0, progress=quiet)  # fmt: skip
    adapter = convert_adapter(files["adapter"], root / "slots", root / "lora.onnx_adapter")
    if not (root / "deq").exists():
        export_package(files["gguf"], root / "deq", dequantize=True, lora=[(files["adapter"], 1.0)], progress=quiet)
    assert np.abs(_logits(root / "slots", adapter) - _logits(root / "deq")).max() < 1e-3


def test_lm_head_adapter_on_a_tied_gguf(files, tmp_path):
    """An lm_head LoRA on a tied file: the head is untied (fp32, with the adapter), the embedding keeps the file's
    values: the kept-blocks package gives the --dequantize one's logits, and those are the base's with only the
    head changed (the same prompt's logits through a head-only delta)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    folder = tmp_path / "head"
    folder.mkdir()
    export_package(files["gguf"], tmp_path / "deq-base", dequantize=True, accuracy_level=0, progress=quiet)
    vocab = load(tmp_path / "deq-base", provider="cpu").vocab_size
    a = rng.standard_normal((2, HIDDEN)).astype(np.float32) * 0.2
    b = rng.standard_normal((vocab, 2)).astype(np.float32) * 0.2
    save_file({"base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": b},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["lm_head"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    kw = dict(accuracy_level=0, progress=quiet, lora=[(folder, 1.0)])
    export_package(files["gguf"], tmp_path / "kept", **kw)
    export_package(files["gguf"], tmp_path / "deq", dequantize=True, **kw)
    merged = _logits(tmp_path / "deq")
    assert np.abs(_logits(tmp_path / "kept") - merged).max() < 1e-3
    # a head-only change adds hidden @ A.T @ B.T: every position's difference lies in B's 2 columns' span (a changed
    # embedding would move the hidden states, and the difference would span the head's own columns)
    difference = (merged - _logits(tmp_path / "deq-base")).astype(np.float64)  # (T, V) = hidden @ A.T @ B.T
    coefficients, *_ = np.linalg.lstsq(b.astype(np.float64), difference.T, rcond=None)
    assert np.abs(b @ coefficients - difference.T).max() < 1e-3 < np.abs(difference).max()
