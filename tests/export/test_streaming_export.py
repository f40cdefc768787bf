"""Streaming export (export/lazy_weights.py, export/block_quantize.py): a folder's weights are read when used, not
held whole; a sharded bf16 folder exports to the same package as with every weight read into memory first; the
float64 proof computed module by module is the whole-model float64 forward; progress bars appear on the long
steps; `export --quantize` (int4, int8-weight-only, fp16) writes the same weights and logits as `export` then
`quantize`; the fp16 proof's ONNX Runtime session holds one weight's float32 copy at a time, not all of them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import edgelm, quiet

from edgelm.export import onnx_export, source
from edgelm.export.lazy_weights import float64_stream, materialize
from edgelm.export.onnx_export import export_package
from edgelm.export.source import open_source
from edgelm.quantize.quantize import quantize_package
from edgelm.runtime import load

# hidden 64 (two blocks of 32) over 4 query heads of 16 and 2 KV heads; a vocabulary small enough to be quick
QWEN3 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2, initializer_range=0.15,
)  # fmt: skip


@pytest.fixture(scope="module")
def bf16_sharded(tmp_path_factory) -> Path:
    """A random Qwen3 saved by transformers in bf16, in shards of 100 KB."""
    import transformers

    folder = tmp_path_factory.mktemp("qwen3-bf16-sharded")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # transformers makes them one: make them count
                param.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


@pytest.fixture(scope="module")
def streamed(bf16_sharded, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("streamed") / "pkg"
    export_package(bf16_sharded, out, progress=quiet, bars=False)
    return out


def test_opening_a_folder_reads_no_weight(bf16_sharded) -> None:
    model = open_source(bf16_sharded).model
    assert all(p.is_meta for p in model.parameters())  # each read when used, in its own dtype
    assert {p.loader.load().dtype for p in model.parameters()} == {torch.bfloat16}


def test_streamed_export_is_the_export_of_the_whole_model(bf16_sharded, streamed, tmp_path, monkeypatch) -> None:
    """With every weight read into memory as fp32 first (the pre-streaming export), the package is the same."""
    opened = source.open_source

    def whole(path):
        src = opened(path)
        materialize(src.model)
        return src

    monkeypatch.setattr(onnx_export, "open_source", whole)
    export_package(bf16_sharded, tmp_path / "whole", progress=quiet, bars=False)
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "whole" / name).read_bytes() == (streamed / name).read_bytes(), name
    manifests = [json.loads((p / "edgelm.json").read_text()) for p in (tmp_path / "whole", streamed)]
    assert manifests[0]["parity"] == manifests[1]["parity"]


def test_float64_stream_is_the_float64_model(bf16_sharded) -> None:
    lazy = open_source(bf16_sharded).model
    whole = open_source(bf16_sharded).model
    materialize(whole)
    ids = torch.randint(0, QWEN3["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), float64_stream(lazy):
        streamed_logits, _ = lazy(ids)
    whole.double()
    with torch.no_grad():
        expected, _ = whole(ids)
    assert streamed_logits.dtype == torch.float64
    torch.testing.assert_close(streamed_logits, expected, rtol=0, atol=1e-12)


def test_exported_logits_match_transformers(bf16_sharded, streamed) -> None:
    import transformers

    hf = transformers.Qwen3ForCausalLM.from_pretrained(bf16_sharded, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, QWEN3["vocab_size"], (1, 9))
    logits = load(streamed, provider="cpu").forward(ids)[0]
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)


def test_progress_bars_on_the_long_steps(bf16_sharded, tmp_path, capsys) -> None:
    export_package(bf16_sharded, tmp_path / "pkg", progress=quiet, bars=True)
    err = capsys.readouterr().err
    for step in ("checking weights", "writing weights", "ONNX Runtime, then PyTorch float64"):
        assert step in err, step


@pytest.mark.parametrize("mode", ["int4", "int8-weight-only"])
def test_export_quantize_is_export_then_quantize(bf16_sharded, streamed, tmp_path, mode) -> None:
    """The same blocks, bit for bit, and so the same logits (quantize's recipe, ONNX Runtime's kernels)."""
    direct = tmp_path / "direct"
    manifest = export_package(bf16_sharded, direct, quantize=mode, progress=quiet, bars=False)
    assert manifest["precision"] == mode
    assert manifest["recipe"]["lm_head"] == "int8"
    two_step = tmp_path / "two-step"
    quantize_package(streamed, two_step, mode=mode, progress=quiet)
    assert (direct / "model.onnx.data").read_bytes() == (two_step / "model.onnx.data").read_bytes()
    ids = np.random.default_rng(1).integers(0, QWEN3["vocab_size"], (2, 7))
    logits = [load(p, provider="cpu").forward(ids)[0] for p in (direct, two_step)]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_export_quantize_fp16_is_export_then_quantize(bf16_sharded, streamed, tmp_path) -> None:
    """The same graph and weight bytes as quantize --mode fp16 writes from the fp32 package; the proof ran on the
    half-precision graph (its cache and logits float16) and the package generates what the two-step one does."""
    direct = tmp_path / "direct"
    manifest = export_package(bf16_sharded, direct, quantize="fp16", progress=quiet, bars=False)
    two_step = tmp_path / "two-step"
    quantize_package(streamed, two_step, mode="fp16", progress=quiet)
    for name in ("model.onnx", "model.onnx.data"):
        assert (direct / name).read_bytes() == (two_step / name).read_bytes(), name
    expected = json.loads((two_step / "edgelm.json").read_text())
    assert (manifest["precision"], manifest["io"]["kv_dtype"]) == ("fp16", "float16")
    assert manifest["recipe"]["mode"] == expected["recipe"]["mode"] == "fp16"
    assert 0 < manifest["parity"]["max_abs_logit_diff"] <= manifest["parity"]["tolerance"]
    ids = [load(p, provider="cpu").generate([5, 9, 300, 41], 8, ignore_eos=True).token_ids for p in (direct, two_step)]
    assert ids[0] == ids[1]


def test_export_quantize_fp16_from_a_gguf_file(families, tmp_path) -> None:
    """A GGUF file's weights (dequantized where the file holds blocks) converted as written: again quantize's bytes."""
    gguf = families.gguf("qwen3")
    export_package(gguf, tmp_path / "direct", quantize="fp16", progress=quiet, bars=False)
    export_package(gguf, tmp_path / "fp32", progress=quiet, bars=False)
    quantize_package(tmp_path / "fp32", tmp_path / "two-step", mode="fp16", progress=quiet)
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "two-step" / name).read_bytes(), name


def test_export_quantize_needs_the_fused_graph(bf16_sharded, tmp_path) -> None:
    result = edgelm("export", bf16_sharded, tmp_path / "p", "--quantize", "int4", "--attention", "standard")
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "fused" in result.stderr


PEAK_GROWTH = """
import sys
import numpy as np
from edgelm.export.parity import _session
def status(field):  # KB
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here: not the imports'
before = status("VmRSS:")
session = _session(sys.argv[1], half=sys.argv[2] == "half")
session.run(None, {"x": np.ones((1, 2048), np.float16)})
print((status("VmHWM:") - before) // 1024)  # MB
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures the peak with Linux's VmHWM")
@pytest.mark.parametrize("half", [True, False])
def test_fp16_proof_holds_one_float32_weight_at_a_time(tmp_path, half) -> None:
    """The fp16 proof's session (export/parity.py _session, half) runs a float16 graph with at most one weight's
    float32 copy alive: 16 float16 MatMul weights of 8 MB (16 MB in float32) grow the peak by about their 128 MB
    and one 16 MB copy (153 MB measured), where the session as the runtime makes it holds a float32 copy of each
    (322 to 370 MB)."""
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array((rng.standard_normal((2048, 2048)) * 0.02).astype(np.float16), f"w{i}")
        for i in range(16)
    ]
    nodes = [helper.make_node("MatMul", [f"h{i}" if i else "x", f"w{i}"], [f"h{i + 1}"]) for i in range(16)]
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 2048])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 2048])],
        weights,
    )
    path = tmp_path / "chain.onnx"
    onnx.save(helper.make_model(graph), path, save_as_external_data=True, location="chain.onnx.data")
    script = [sys.executable, "-c", PEAK_GROWTH, str(path), "half" if half else "runtime"]
    growth = int(subprocess.run(script, capture_output=True, text=True, check=True).stdout)
    if half:
        assert growth < 128 + 96, growth  # the float16 weights, a float32 copy or two, working memory (not 16)
    else:
        assert growth > 256, growth  # every weight's float32 copy: what the half session avoids
