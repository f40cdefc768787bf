"""Quantization: every mode gives a package the runtime runs, the trained bundled model meets the
accuracy and size bars of the quantization issue on held-out text, and bad input loses nothing. The hybrids (the
"hybrid-state" cases of tests/family_cases.py): exactly their linears become blocks, their state parts stay float32,
and the quantized packages follow the fp32 one."""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from family_cases import CASES, cases_with
from helpers import BUNDLED_TOKENIZER, quiet
from onnx import numpy_helper

from edgelm.export.onnx_export import export_package
from edgelm.quantize.quantize import quantize_package
from edgelm.runtime import PackageError, load
from edgelm.writers.package_writer import list_files

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "shakespeare"
HELDOUT = REPO / "data" / "shakespeare-heldout.txt"
CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"
EVAL_TOKENS = 12_000  # a fifth of the held-out text: enough for stable ratios, quick on 2 cores

# mode: (max perplexity ratio, min top-1 agreement, max size ratio), from the quantization issue
BARS = {
    "dynamic": (1.01, 0.97, 0.30),
    "static": (1.03, 0.95, 0.30),
    "int4": (1.06, 0.92, 0.20),
}


@pytest.fixture(scope="module")
def fp32_package(tmp_path_factory) -> Path:
    from edgelm.export.onnx_export import export_package

    if not (BUNDLED / "model.safetensors").is_file():
        pytest.fail("the bundled model models/shakespeare is missing")
    out = tmp_path_factory.mktemp("quant") / "fp32"
    export_package(BUNDLED, out, progress=lambda _: None)
    return out


@pytest.fixture(scope="module")
def quantized(fp32_package) -> dict[str, Path]:
    from edgelm.quantize.quantize import quantize_package

    packages = {}
    for mode in ("dynamic", "static", "int4", "fp16"):
        out = fp32_package.parent / mode
        quantize_package(
            fp32_package,
            out,
            mode=mode,
            calibration_text=CALIBRATION,
            calibration_samples=16,
            evaluate=False,
            progress=lambda _: None,
        )
        packages[mode] = out
    return packages


@pytest.fixture(scope="module")
def reports(quantized, fp32_package) -> dict[str, dict]:
    from edgelm.quantize.evaluate import evaluate_package

    return {
        mode: evaluate_package(quantized[mode], HELDOUT, reference=fp32_package, max_tokens=EVAL_TOKENS)
        for mode in BARS
    }


@pytest.mark.parametrize("mode", ["dynamic", "static", "int4"])
def test_perplexity_and_size_bars(mode, reports):
    report = reports[mode]
    max_ratio, _, max_size = BARS[mode]
    summary = json.dumps({k: report[k] for k in ("perplexity_ratio", "top1_agreement", "size_ratio")})
    assert report["perplexity_ratio"] <= max_ratio, summary
    assert report["size_ratio"] <= max_size, summary
    assert report["mean_kl_nats"] < 0.1, summary


@pytest.mark.parametrize("mode", ["dynamic", "static", "int4"])
def test_top1_agreement_bar(mode, reports):
    report = reports[mode]
    assert report["top1_agreement"] >= BARS[mode][1], json.dumps(report)


@pytest.mark.parametrize("mode", ["dynamic", "static", "int4", "fp16"])
def test_quantized_package_generates_and_records_its_recipe(mode, quantized):
    model = load(quantized[mode], provider="cpu")
    manifest = model.spec.manifest
    assert manifest.precision != "fp32"
    assert manifest.recipe["mode"] == mode
    assert set(manifest.files) == set(list_files(quantized[mode]))
    result = model.generate("ROMEO:\n", 24)
    assert len(result.token_ids) > 0
    assert result.text.strip()


@pytest.mark.parametrize("mode", ["dynamic", "static", "int4", "fp16"])
def test_quantized_package_keeps_its_own_weights_in_model_onnx_data(mode, quantized, fp32_package):
    """The quantizers read the source's model.onnx.data; the new package has its own, aligned, listed one,
    and the source folder is left as it was (nothing written beside its model)."""
    import onnx

    from edgelm.runtime.onnx_external import external_data_locations
    from edgelm.writers.onnxfile import ALIGNMENT, INLINE_LIMIT

    package = quantized[mode]
    assert set(external_data_locations(package / "model.onnx")) == {"model.onnx.data"}
    assert "model.onnx.data" in json.loads((package / "edgelm.json").read_text())["files"]
    for tensor in onnx.load(str(package / "model.onnx"), load_external_data=False).graph.initializer:
        entry = {e.key: int(e.value) for e in tensor.external_data if e.key != "location"}
        if not entry:
            assert len(tensor.raw_data) < INLINE_LIMIT, f"{tensor.name} stayed inline"
        elif entry["length"] >= ALIGNMENT:
            assert entry["offset"] % ALIGNMENT == 0, tensor.name
    source_files = json.loads((fp32_package / "edgelm.json").read_text())["files"]
    assert sorted(p.name for p in fp32_package.iterdir()) == sorted([*source_files, "edgelm.json"])
    assert source_files == list_files(fp32_package)
    recipe = json.loads((package / "edgelm.json").read_text())["recipe"]  # the source's weights are named
    assert recipe["source_weights_sha256"] == {"model.onnx.data": source_files["model.onnx.data"]["sha256"]}


def test_static_recipe_keeps_attention_in_float_and_the_head_dynamic(quantized):
    import onnx

    graph = onnx.load(str(quantized["static"] / "model.onnx")).graph
    initializers = {i.name for i in graph.initializer}
    ops = [n.op_type for n in graph.node]
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in initializers}
    # every linear layer of the blocks reads a dequantized int8 weight (QDQ): c_attn, c_proj, c_fc, mlp.c_proj
    assert len([n for n in graph.node if n.op_type == "MatMul" and n.input[1] in dequantized]) == 4 * 4
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in initializers]  # no float linear
    # attention stays one float GroupQueryAttention per layer, fed by float (dequantized) tensors
    assert ops.count("GroupQueryAttention") == 4
    # the LM head: int8 weights, activations quantized at run time
    assert ops.count("DynamicQuantizeLinear") == 1 and ops.count("MatMulInteger") == 1


def _matmul_nbits_bits(graph) -> list[int]:
    return sorted(next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits")


def test_int4_recipe_keeps_the_lm_head_and_embedding_at_8_bits(quantized):
    import onnx

    graph = onnx.load(str(quantized["int4"] / "model.onnx")).graph
    # 4 linear layers per block at 4 bits, the LM head at 8; no float copy of the (n_embd, vocab) table
    assert _matmul_nbits_bits(graph) == [4] * 16 + [8]
    float_tensors = [i for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    tables = [i.name for i in float_tensors if math.prod(i.dims) >= 2048 * 256]
    assert not tables, tables
    recipe = load(quantized["int4"], provider="cpu").spec.manifest.recipe
    assert recipe["lm_head"] == "int8" and recipe["block_size"] == 32


def test_int4_lm_head_option_gathers_the_embedding_from_4_bits(fp32_package, tmp_path):
    """lm_head="int4": the smallest package; the embedding unpacks the head's nibbles, which a wrong
    unpacking would show as a perplexity far off fp32's."""
    import onnx

    from edgelm.quantize.evaluate import evaluate_package
    from edgelm.quantize.quantize import quantize_package

    out = tmp_path / "int4-head4"
    manifest = quantize_package(fp32_package, out, mode="int4", int4_lm_head="int4", progress=lambda _: None)
    assert manifest["recipe"]["lm_head"] == "int4"
    assert _matmul_nbits_bits(onnx.load(str(out / "model.onnx")).graph) == [4] * 17
    report = evaluate_package(out, HELDOUT, reference=fp32_package, max_tokens=2000)
    assert report["perplexity_ratio"] <= BARS["int4"][0], json.dumps(report)
    assert report["size_ratio"] < 0.18, json.dumps(report)


def test_fp16_greedy_matches_fp32(quantized, fp32_package):
    fp32 = load(fp32_package, provider="cpu").generate("JULIET:\n", 16)
    fp16 = load(quantized["fp16"], provider="cpu").generate("JULIET:\n", 16)
    same = sum(a == b for a, b in zip(fp32.token_ids, fp16.token_ids, strict=False))
    assert same >= 12, (fp32.token_ids, fp16.token_ids)


def test_manifest_stores_the_accuracy_report(fp32_package, tmp_path):
    from edgelm.quantize.quantize import quantize_package

    excerpt = tmp_path / "heldout-excerpt.txt"
    excerpt.write_text(HELDOUT.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    manifest = quantize_package(
        fp32_package, tmp_path / "dyn", mode="dynamic", eval_text=excerpt, progress=lambda _: None
    )
    report = manifest["evaluation"]
    assert report["perplexity_ratio"] <= BARS["dynamic"][0]
    assert json.loads((tmp_path / "dyn" / "edgelm.json").read_text())["evaluation"] == report


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(mode="int3"), ValueError, "dynamic, static, int4, int8-weight-only, fp16"),
        (dict(mode="static"), ValueError, "calibration text"),
        (dict(mode="static", calibration_text="/nonexistent.txt"), FileNotFoundError, "nonexistent"),
        (dict(mode="static", calibration_method="magic"), ValueError, "minmax, entropy, percentile"),
        (dict(mode="int4", int4_lm_head="int2"), ValueError, "int8, int4"),
        (dict(mode="int4", block_size=512), ValueError, "does not divide the embedding width 256"),
    ],
)
def test_bad_requests_leave_input_untouched(fp32_package, tmp_path, kwargs, error, message):
    from edgelm.quantize.quantize import quantize_package

    before = _snapshot(fp32_package)
    with pytest.raises(error, match=message):
        quantize_package(fp32_package, tmp_path / "out", progress=lambda _: None, **kwargs)
    assert _snapshot(fp32_package) == before
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_too_short_calibration_text(fp32_package, tmp_path):
    from edgelm.quantize.quantize import quantize_package

    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.")
    with pytest.raises(ValueError, match="too short"):
        quantize_package(fp32_package, tmp_path / "out", mode="static", calibration_text=short, progress=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_already_quantized_and_unreadable_packages(quantized, tmp_path):
    from edgelm.quantize.quantize import quantize_package

    with pytest.raises(PackageError, match="already quantized"):
        quantize_package(quantized["dynamic"], tmp_path / "again", mode="dynamic", progress=lambda _: None)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "edgelm.json").write_text("{not json")
    with pytest.raises(PackageError, match="not valid JSON"):
        quantize_package(broken, tmp_path / "out", mode="dynamic", progress=lambda _: None)
    assert not (tmp_path / "again").exists() and not (tmp_path / "out").exists()


def test_interrupted_quantization_leaves_no_package(fp32_package, tmp_path, monkeypatch):
    from edgelm.quantize import quantize as quantize_module
    from edgelm.quantize import recipes

    def fail(*args, **kwargs):
        raise RuntimeError("simulated crash in the middle of quantization")

    monkeypatch.setattr(recipes, "quantize_weight_only", fail)
    with pytest.raises(RuntimeError):
        quantize_module.quantize_package(fp32_package, tmp_path / "int4", mode="int4", progress=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_cli_quantize_errors_are_one_line(fp32_package, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "edgelm", "quantize", str(fp32_package), str(tmp_path / "x"), "--mode", "int2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgelm quantize: error:") and "dynamic" in lines[0]


def test_cli_eval_json(fp32_package, quantized):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgelm",
            "eval",
            str(quantized["dynamic"]),
            "--text",
            str(HELDOUT),
            "--reference",
            str(fp32_package),
            "--max-tokens",
            "2000",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tokens"] == 2000
    assert 0 < report["bits_per_byte"] < 3
    assert report["top1_agreement"] > 0.9


def test_the_cli_offers_the_modes_table():
    """The CLI's choices are quantize/modes.py's table (which imports nothing), and every mode has a recipe."""
    from edgelm.cli import build_parser
    from edgelm.quantize.modes import EXPORTED, LM_HEADS, MODES
    from edgelm.quantize.quantize import RECIPES

    def choices(command: str, option: str) -> tuple:
        parser = build_parser().commands[command]
        return next(tuple(a.choices) for a in parser._actions if option in a.option_strings)

    assert choices("quantize", "--mode") == tuple(MODES) == tuple(RECIPES)
    assert choices("export", "--quantize") == EXPORTED == ("int4", "int8-weight-only", "fp16")
    assert choices("quantize", "--int4-lm-head") == choices("export", "--int4-lm-head") == LM_HEADS


# ---- hybrids (tests/family_cases.py's "hybrid-state" cases) ------------------------------------------------------
# int4 and int8-weight-only: exactly the linears become MatMulNBits blocks (the attention's, the short convolution's
# or the Gated DeltaNet's projections and gates, the MLP's and the LM head), and what the recurrence and the
# convolution read stays float32 as exported (the depthwise convolution kernels, Qwen3.5's -exp(A_log) and dt_bias,
# every norm). On a wider random model with transformers' own initialization (where the logits do not flip at the
# first rounding) the quantized packages follow the fp32 package: int8 keeps the top token at nearly every position;
# `export --quantize` writes the same nodes.

WIDE = dict(hidden_size=256, intermediate_size=512, initializer_range=0.02)
LINEAR_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)
MIXER_LINEARS = {
    "conv": ["conv.in_proj", "conv.out_proj"],
    "linear_attention": ["delta.in_proj", "delta.z", "delta.b", "delta.a", "delta.out_proj"],
    "full_attention": ["qkv", "attention_out"],
}
HYBRID_RNG = np.random.default_rng(0)
HYBRID_PROMPTS = [[int(x) for x in HYBRID_RNG.integers(3, 2000, n)] for n in (5, 12, 30)]


@pytest.fixture(scope="module", params=cases_with("hybrid-state"))
def hybrid(request, tmp_path_factory) -> dict:
    import transformers

    family = request.param
    root = tmp_path_factory.mktemp(f"quantize-{family}")
    spec = CASES[family]
    config = copy.deepcopy(spec.config) | WIDE | (LINEAR_HEADS if family == "qwen3_5_text" else {})
    torch.manual_seed(0)
    hf = getattr(transformers, spec.classes[1])(getattr(transformers, spec.classes[0])(**config)).eval()
    hf.save_pretrained(root / "hf")
    shutil.copyfile(BUNDLED_TOKENIZER, root / "hf" / "tokenizer.json")
    export_package(root / "hf", root / "fp32", progress=quiet)
    for mode in ("int8-weight-only", "int4"):
        quantize_package(root / "fp32", root / mode, mode=mode, evaluate=False)
    export_package(root / "hf", root / "export-int4", quantize="int4", progress=quiet)
    return {"family": family, "root": root, "layer_types": config["layer_types"]}


def _initializers(package) -> tuple[dict[str, onnx.TensorProto], list[onnx.NodeProto]]:
    model = onnx.load(package / "model.onnx", load_external_data=False)
    onnx.load_external_data_for_model(model, str(package))
    return {tensor.name: tensor for tensor in model.graph.initializer}, model.graph.node


@pytest.mark.parametrize("mode", ["int8-weight-only", "int4"])
@pytest.mark.usefixtures("one_torch_thread")
def test_a_hybrids_linears_are_blocks_and_its_state_parts_stay_float(hybrid, mode):
    initializers, nodes = _initializers(hybrid["root"] / mode)
    blocks = {node.input[1].removesuffix("_Q8").removesuffix("_Q4").removesuffix(".weight") for node in nodes
              if node.op_type == "MatMulNBits"}  # fmt: skip
    expected = {f"layers.{i}.{name}" for i, kind in enumerate(hybrid["layer_types"]) for name in MIXER_LINEARS[kind]}
    expected |= {f"layers.{i}.mlp.{name}" for i in range(len(hybrid["layer_types"])) for name in ("up", "down")}
    assert blocks - {"lm_head", "lm_head.weight_T", "embed"} == expected  # the LM head, untied or tied, too
    assert not [n.name for n in nodes if n.op_type == "MatMul" and n.input[1] in initializers]
    floats, _ = _initializers(hybrid["root"] / "fp32")
    kept = [name for name in floats if name.endswith(("conv.weight", "neg_exp_a_log", "dt_bias", "norm.weight"))]
    assert any(name.endswith("conv.weight") for name in kept) and any(name.endswith("norm.weight") for name in kept)
    assert (hybrid["family"] == "qwen3_5_text") == any(name.endswith("neg_exp_a_log") for name in kept)
    for name in kept:
        assert initializers[name].data_type == onnx.TensorProto.FLOAT, name
        assert np.array_equal(numpy_helper.to_array(initializers[name]), numpy_helper.to_array(floats[name])), name


@pytest.mark.usefixtures("one_torch_thread")
def test_a_hybrids_quantized_packages_follow_its_fp32_package(hybrid):
    base = load(hybrid["root"] / "fp32", provider="cpu", threads=1)
    # (mode, least top-1 agreement, largest error relative to the logits' spread): int4's bounds only catch a
    # broken layout (relative error 1 or more), its top token flips where this random model's margins are thin;
    # int8's agreement is 0.89 on an AVX2-only AMD EPYC (MLAS's AVX2 int8 path) at a relative error of 0.033, 0.9 or
    # more with AVX-512, so the error bound is what catches a wrong int8 layout
    for mode, agreement, error in (("int8-weight-only", 0.85, 0.05), ("int4", 0.4, 0.5)):
        model = load(hybrid["root"] / mode, provider="cpu", threads=1)
        same, relative = [], []
        for prompt in HYBRID_PROMPTS:
            ids = prompt + base.generate(prompt, 16, ignore_eos=True).token_ids
            expected, logits = base.forward(np.array([ids]))[0][0], model.forward(np.array([ids]))[0][0]
            same += list(expected.argmax(-1) == logits.argmax(-1))
            centred = expected - expected.mean(-1, keepdims=True)
            relative.append(np.linalg.norm(logits - expected) / np.linalg.norm(centred))
            assert len(model.generate(prompt, 8, ignore_eos=True).token_ids) == 8
        assert np.mean(same) >= agreement and max(relative) < error, (mode, np.mean(same), max(relative))


@pytest.mark.usefixtures("one_torch_thread")
def test_export_quantize_writes_a_hybrids_same_blocks(hybrid):
    # the same blocks as export then quantize, bit for bit (a tied LM head is named lm_head.weight_T there)
    same = lambda name: name.replace("lm_head.weight_T", "lm_head.weight")  # noqa: E731
    exported, nodes = _initializers(hybrid["root"] / "export-int4")
    quantized, quantized_nodes = _initializers(hybrid["root"] / "int4")
    quantized = {same(name): tensor for name, tensor in quantized.items()}
    blocks = lambda graph: sorted(same(n.input[1]) for n in graph if n.op_type == "MatMulNBits")  # noqa: E731
    assert blocks(nodes) == blocks(quantized_nodes)
    for name in blocks(nodes):
        for array in (name, name.rsplit("_Q", 1)[0] + "_scales"):
            values = numpy_helper.to_array(exported[array]), numpy_helper.to_array(quantized[array])
            assert np.array_equal(*values), array
