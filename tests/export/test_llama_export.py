"""Llama-family packages beyond parity with transformers (tests/export/test_families.py, on the same tiny models of
tests/family_cases.py: GQA ratio 3, rope_theta 1e5, llama3 rope scaling, tied and untied heads, Qwen2 biases):
onnxruntime-genai runs the standard graph too; every quantization mode works on a Llama package and a tied
embedding stays one table; a genai-only folder with fewer KV heads loads; a folder written by
onnxruntime-genai's own model builder runs in edgelm's runtime; bad folders fail cleanly."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from family_cases import EOS, NEW_TOKENS, PROMPTS, SMALL
from helpers import genai_greedy, quiet

from edgelm.export.checkpoint import CheckpointError
from edgelm.export.onnx_export import export_package
from edgelm.runtime import load

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"
HELDOUT = REPO / "data" / "shakespeare-heldout.txt"
TOLERANCE = 1e-4
LLAMA = "llama-llama3-tied"  # tests/family_cases.py; each row's parity with transformers: tests/export/test_families.py

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_onnxruntime_genai_runs_the_standard_graph(families):
    package = families.package(LLAMA, "standard")
    assert json.loads((package / "genai_config.json").read_text())["model"]["decoder"]["num_key_value_heads"] == 2
    for prompt, tokens in zip(PROMPTS[:2], families.expected(LLAMA)[:2], strict=True):
        assert EOS not in tokens  # else genai would stop early, by design
        assert genai_greedy(package, prompt, NEW_TOKENS) == tokens


# ---- quantization of a Llama package ----


def vocab_tables(onnx_path: Path, *, vocab: int, width: int) -> list[str]:
    """Initializers large enough to be an embedding or LM head: at least half a (vocab, width) table in
    elements (int4 packs two weights a byte); every per-layer matrix here is far smaller."""
    import onnx

    graph = onnx.load(str(onnx_path)).graph
    return [i.name for i in graph.initializer if math.prod(i.dims) >= vocab * width // 2]


@pytest.fixture(scope="module")
def quantized(families, tmp_path_factory) -> dict[str, Path]:
    from edgelm.quantize.quantize import quantize_package

    root = tmp_path_factory.mktemp("llama-quant")
    excerpt = root / "heldout-excerpt.txt"  # about 1,500 tokens: the whole held-out text takes minutes here
    excerpt.write_text(HELDOUT.read_text(encoding="utf-8")[:EXCERPT_CHARS], encoding="utf-8")
    source = families.package(LLAMA, "fused")
    out = {}
    for mode in ("dynamic", "static", "int4", "fp16"):
        out[mode] = root / mode
        quantize_package(
            source, out[mode], mode=mode, calibration_text=CALIBRATION, calibration_samples=8,
            eval_text=excerpt, progress=quiet,
        )  # fmt: skip
    return out


# Bars for random weights: (min top-1 agreement with the fp32 package, max mean KL in nats). A random
# model's logits are flat (std about 1.5 over 2048 tokens), so the top token flips easily: fake-quantizing
# this model's weights in PyTorch (symmetric blocks of 32, embedding at 8 bits) gives agreement 0.92 at
# 8 bits and 0.32 (KL 0.33) at 4 bits, on 4,600 held-out tokens; the packages measured 0.79 (dynamic,
# which also quantizes activations per tensor), 0.67 (static) and 0.35 (int4, KL 0.28).
BARS = {"dynamic": (0.65, 0.05), "static": (0.5, 0.12), "int4": (0.22, 0.45)}
EXCERPT_CHARS = 4000


@pytest.mark.parametrize("mode", ["dynamic", "static", "int4", "fp16"])
def test_quantized_llama_loads_generates_and_reports(mode, quantized, families):
    model = load(quantized[mode], provider="cpu")
    manifest = model.spec.manifest
    assert manifest.recipe["mode"] == mode and model.spec.arch.n_kv_head == 2
    result = model.generate(PROMPTS[0], NEW_TOKENS, temperature=0, ignore_eos=True)
    assert len(result.token_ids) == NEW_TOKENS
    if mode == "fp16":
        same = sum(a == b for a, b in zip(result.token_ids, families.expected(LLAMA)[0], strict=True))
        print(f"fp16: {same} of {NEW_TOKENS} greedy tokens equal fp32's")
        assert same >= NEW_TOKENS * 3 // 4, result.token_ids
        return
    report = manifest.evaluation
    assert report is not None, "quantize_package wrote no evaluation report"
    summary = {k: report[k] for k in ("perplexity_ratio", "top1_agreement", "mean_kl_nats", "size_ratio", "tokens")}
    print(f"{mode}: {json.dumps(summary)}")
    min_agreement, max_kl = BARS[mode]
    assert report["top1_agreement"] >= min_agreement, report
    assert report["mean_kl_nats"] <= max_kl, report
    assert abs(report["perplexity_ratio"] - 1) < 0.05, report
    assert report["size_ratio"] < 0.5, report


@pytest.mark.parametrize("mode", ["fp32", "dynamic", "static", "int4", "fp16"])
def test_tied_embedding_is_stored_once(mode, quantized, families):
    folder = families.package(LLAMA, "fused") if mode == "fp32" else quantized[mode]
    tables = vocab_tables(folder / "model.onnx", vocab=SMALL["vocab_size"], width=SMALL["hidden_size"])
    assert len(tables) == 1, tables


def test_untied_head_is_a_second_table(families):
    tables = vocab_tables(
        families.package("qwen2-biases-untied", "fused") / "model.onnx",
        vocab=SMALL["vocab_size"],
        width=SMALL["hidden_size"],
    )
    assert len(tables) == 2, tables


# ---- a genai folder (no edgelm.json) with fewer KV heads than query heads ----


def test_genai_only_folder_with_grouped_query_attention(families, tmp_path):
    genai_only = tmp_path / "genai-only"
    shutil.copytree(families.package(LLAMA, "fused"), genai_only)
    (genai_only / "edgelm.json").unlink()
    model = load(genai_only, provider="cpu", verify=False)
    assert model.spec.kind == "genai"
    assert (model.spec.arch.n_head, model.spec.arch.n_kv_head) == (6, 2)
    batch = model.generate_batch(PROMPTS, NEW_TOKENS, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in batch] == families.expected(LLAMA)


# ---- a folder written by onnxruntime-genai's own model builder ----


def test_onnxruntime_genai_builder_folder_runs(families, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    hf, folder = families.model(LLAMA)
    out = tmp_path / "builder"
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(out)]
    command += ["-p", "fp32", "-e", "cpu", "-c", str(tmp_path / "cache")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if run.returncode != 0 or not (out / "genai_config.json").is_file():
        lines = (run.stderr or run.stdout).strip().splitlines()
        pytest.skip(f"onnxruntime-genai's builder failed here: {lines[-1] if lines else run.returncode}")
    model = load(out, provider="cpu", verify=False)
    assert model.spec.kind == "genai" and model.spec.arch.n_kv_head == 2
    ids = np.array([PROMPTS[2]], dtype=np.int64)
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids)).logits.numpy()
    difference = float(np.abs(model.forward(ids)[0] - reference).max())
    print(f"onnxruntime-genai builder folder: max |logit difference| {difference:.2e}")
    assert difference < TOLERANCE
    batch = model.generate_batch(PROMPTS, NEW_TOKENS, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in batch] == families.expected(LLAMA)
    assert genai_greedy(out, PROMPTS[0], NEW_TOKENS) == families.expected(LLAMA)[0]


# ---- bad folders: one-line errors, nothing written ----


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _drop_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


BAD_FOLDERS = {
    "unknown model_type": (lambda f: _edit_config(f, model_type="falcon"), CheckpointError, "model_type 'falcon'"),
    "rope_scaling yarn": (
        lambda f: _edit_config(f, rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
        (CheckpointError, ValueError),
        "yarn",
    ),
    "rope_parameters yarn": (  # transformers 5 writes theta and scaling in one dict
        lambda f: _edit_config(f, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e5}),
        (CheckpointError, ValueError),
        "yarn",
    ),
    "missing tensor": (_drop_tensor, CheckpointError, "missing 1 tensor"),
}


@pytest.mark.parametrize("problem", sorted(BAD_FOLDERS))
def test_bad_folder_is_one_line_error_and_writes_nothing(problem, families, tmp_path):
    damage, error, message = BAD_FOLDERS[problem]
    folder = tmp_path / "checkpoint"
    shutil.copytree(families.model(LLAMA)[1], folder)
    damage(folder)
    out = tmp_path / "pkg"
    with pytest.raises(error, match=message) as caught:
        export_package(folder, out, progress=quiet)
    assert "\n" not in str(caught.value)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]  # no staging folder left beside it
