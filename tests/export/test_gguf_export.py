"""`edgelm export model.gguf OUT`: small GGUF files written with llama.cpp's own writer (tests/export/test_gguf.py),
exported, and run with the runtime against transformers' GGUF loader; the kept
MatMulNBits blocks against the GGUF's own weights; a hostile file at the command line."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import folded_graph, quiet  # noqa: E402
from test_gguf import _unpack, write_gguf  # noqa: E402  (pytest puts tests/ on the path)

from edgelm.cli import main  # noqa: E402
from edgelm.export.gguf import read_gguf  # noqa: E402
from edgelm.export.onnx_export import export_package  # noqa: E402
from edgelm.runtime import load  # noqa: E402

GREEDY_TOKENS = 32
PROMPT = [5, 17, 300, 42, 9]
# token_embd Q8_0 (tied: the head MatMulNBits 8 bits, the embedding gathers its blocks); layer 0: Q/K/V all
# 4-bit (Q4_0 and Q4_1: kept), output Q8_0, gate Q4_0 + up Q4_1 (kept), down F16 (float); layer 1: Q8_0 Q
# with 4-bit K/V (bits differ: the node takes 8 bits, the 4-bit values widened exactly)
KEEP_KINDS = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16)


def _transformers_greedy(path) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    model.generation_config.eos_token_id = None  # exactly GREEDY_TOKENS tokens
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False, attention_mask=torch.ones_like(prompt)
        )
    return out[0, len(PROMPT) :].tolist()


def _edgelm_greedy(package) -> list[int]:
    result = load(package).generate(PROMPT, GREEDY_TOKENS, ignore_eos=True)
    return result.token_ids


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_export_greedy_equals_transformers(tmp_path, tied):
    path = write_gguf(tmp_path, "llama", kinds=(Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1), tied=tied)
    manifest = export_package(path, tmp_path / "pkg", dequantize=True, progress=quiet)
    assert manifest["parity"]["max_abs_logit_diff"] <= 1e-4 and manifest["precision"] == "fp32"
    expected = _transformers_greedy(path)
    assert len(set(expected)) > 3, "a degenerate model would not test much"
    assert _edgelm_greedy(tmp_path / "pkg") == expected


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kept")
    path = write_gguf(folder, "llama", kinds=KEEP_KINDS, tied=True)
    manifest = export_package(path, folder / "pkg", accuracy_level=0, progress=quiet)
    return path, folder / "pkg", manifest


def test_kept_blocks_dequantize_to_the_gguf_weights(kept, tmp_path):
    path, package, manifest = kept
    weights = read_gguf(path)
    graph, inits = folded_graph(package, tmp_path)  # the compact blocks as ONNX Runtime unpacks them
    nodes = {n.name: n for n in graph.node if n.op_type == "MatMulNBits"}
    parts = {
        "layers.0.qkv/MatMulNBits": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "layers.0.attention_out/MatMulNBits": ["self_attn.o_proj"],
        "layers.0.mlp.up/MatMulNBits": ["mlp.gate_proj", "mlp.up_proj"],
        "layers.1.qkv/MatMulNBits": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "layers.1.attention_out/MatMulNBits": ["self_attn.o_proj"],
    }
    for name, hf in parts.items():
        node = nodes.get(name) or nodes[f"{name}/blocks"]  # with Q4_1 parts: the integer-zero-point product
        bits = next(a.i for a in node.attribute if a.name == "bits")
        assert len(node.input) == 3, "the default zero point: ONNX Runtime's fast kernels"
        packed, scales = inits[node.input[1]], inits[node.input[2]]
        offsets = inits.get(node.input[1].rsplit(".", 1)[0] + ".weight_block_offsets")  # (K/32, N): Q4_1's minimums
        layer = name.split(".")[1]
        kinds = {weights.quant_type(f"model.layers.{layer}.{part}.weight") for part in hf}
        assert (offsets is not None) == ("Q4_1" in kinds), name
        assert bits == (8 if "Q8_0" in kinds else 4), name
        expected = np.concatenate([weights.tensor(f"model.layers.{layer}.{part}.weight") for part in hf])
        unpacked = _unpack(bits, packed, scales, 32, None if offsets is None else offsets.T)
        np.testing.assert_allclose(unpacked, expected, rtol=1e-6, atol=1e-7)
    head = nodes["logits"]
    assert next(a.i for a in head.attribute if a.name == "bits") == 8 and len(head.input) == 3  # symmetric Q8_0
    packed, scales = inits[head.input[1]], inits[head.input[2]]
    np.testing.assert_array_equal(_unpack(8, packed, scales), weights.tensor("model.embed_tokens.weight"))
    # layer 0's down projection is F16: a float MatMul
    matmuls = {n.name for n in graph.node if n.op_type == "MatMul"}
    assert "layers.0.mlp.down/MatMul" in matmuls
    assert not any(i.name == "lm_head.weight_T" for i in graph.initializer), "the tied table is stored once, as blocks"
    assert manifest["precision"] == "int4"
    assert manifest["recipe"]["mode"] == "gguf" and manifest["recipe"]["lm_head"] == "int8"
    assert manifest["recipe"]["gguf_types"]["embed_tokens"] == {"Q8_0": 1}


def test_kept_package_greedy_equals_transformers(kept):
    path, package, manifest = kept
    assert manifest["parity"]["max_abs_logit_diff"] <= 1e-4  # accuracy_level 0: float activations
    assert _edgelm_greedy(package) == _transformers_greedy(path)


def test_kept_at_accuracy_level_4_is_proved_through_its_float_twin(tmp_path):
    path = write_gguf(tmp_path, "llama", kinds=KEEP_KINDS, tied=True)
    manifest = export_package(path, tmp_path / "pkg", progress=quiet)
    parity = manifest["parity"]
    assert "int8" in parity["activations"] and parity["tolerance"] == 1e-3
    assert parity["max_abs_logit_diff"] <= 1e-4  # the float twin: float32 rounding only
    assert 0 < parity["int8"]["mean_kl"] <= parity["int8"]["max_kl"] <= 2.0
    assert not list((tmp_path / "pkg").glob(".float-twin*")), "the twin is not left in the package"


def test_int8_rounding_past_its_bound_names_the_float_flag_and_its_cost(tmp_path, capsys, monkeypatch):
    """A right graph whose int8 activations move the distributions past the KL bound: the one-line error says the
    graph is right, names --accuracy-level 0 with what it costs, and that flag then exports it."""
    import edgelm.export.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "INT8_MEAN_KL", 1e-12)  # "just over" on this tiny model
    path = write_gguf(tmp_path, "llama", kinds=KEEP_KINDS, tied=True)
    assert main(["export", str(path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "int8 activations change this model's next-token distributions" in err, err
    assert "the graph itself is right" in err and "`edgelm export --accuracy-level 0` keeps activations float" in err
    assert "slower" in err, "the advice says what it costs"
    assert not (tmp_path / "out").exists()
    assert main(["export", str(path), str(tmp_path / "float"), "--accuracy-level", "0"]) == 0


def test_a_wrong_float_twin_names_the_tolerance(tmp_path, capsys, monkeypatch):
    import edgelm.export.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "KEPT_FLOAT_TOLERANCE", 1e-12)
    path = write_gguf(tmp_path, "llama", kinds=KEEP_KINDS, tied=True)
    assert main(["export", str(path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "with float activations the graph's max |logit difference|" in err, err
    assert "accuracy-level" not in err, "no accuracy level makes a wrong graph right"
    tolerance = err.split("`edgelm export --tolerance ")[1].split("`")[0]
    assert main(["export", str(path), str(tmp_path / "int8"), "--tolerance", tolerance]) == 0


def test_over_the_tolerance_in_the_api_names_its_arguments(tmp_path, monkeypatch):
    import edgelm.export.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "PARITY_TOLERANCE", 1e-12)  # a float package
    path = write_gguf(tmp_path, "llama", kinds=(Q.F32,))
    with pytest.raises(RuntimeError, match=r"if the model is right, export_package\(tolerance=\S+\) allows") as info:
        export_package(path, tmp_path / "out", progress=quiet)
    assert "accuracy_level" not in str(info.value)  # nothing kept: the accuracy level changes nothing


# --- rope_freqs.weight: llama.cpp's per-frequency divisors, whatever rule made them ---------------------------

ODD_FACTORS = np.array([1.0, 0.5, 3.0, 1.7, 8.0, 2.5, 40.0, 1.25], np.float32)  # no llama3 parameters make these


@pytest.fixture(scope="module")
def odd_rope(tmp_path_factory):
    """A tiny Llama GGUF with linear scaling 2 and rope_freqs.weight ODD_FACTORS, and the transformers Llama of
    the same weights whose rotary frequencies are divided the same way (llama.cpp's rope with freq_factors)."""
    import torch
    from family_cases import SMALL
    from family_cases import write_gguf as write_model_gguf
    from gguf import GGUFValueType as V
    from helpers import rewrite_gguf, save_random_model

    folder = tmp_path_factory.mktemp("odd-rope")
    hf = save_random_model(folder / "hf", ("LlamaConfig", "LlamaForCausalLM"), SMALL | dict(tie_word_embeddings=True))
    linear = {"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (2.0, V.FLOAT32)}
    path = rewrite_gguf(
        write_model_gguf(hf, folder / "plain.gguf"), folder / "odd.gguf", linear,
        add=lambda writer: writer.add_tensor("rope_freqs.weight", ODD_FACTORS),
    )  # fmt: skip
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    assert head_dim == 2 * len(ODD_FACTORS)
    base = 1.0 / (SMALL["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    hf.model.rotary_emb.inv_freq = base / 2.0 / torch.from_numpy(ODD_FACTORS)
    return hf, path


def _hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.from_numpy(ids)).logits.numpy()


@pytest.mark.parametrize("attention", ["fused", "standard"])
def test_rope_freqs_factors_are_the_files_own(odd_rope, attention, tmp_path):
    hf, path = odd_rope
    manifest = export_package(path, tmp_path / "pkg", attention=attention, progress=quiet)
    assert manifest["architecture"]["details"]["rope_freq_factors"] == ODD_FACTORS.tolist()
    ids = np.array([[5, 99, 1200, 7, 640, 33, 1800, 412, 77, 21, 90]], dtype=np.int64)
    logits, _ = load(tmp_path / "pkg", provider="cpu").forward(ids)
    assert np.abs(logits - _hf_logits(hf, ids)).max() < 1e-4


def test_rope_freqs_factors_in_the_reference_model(odd_rope):
    import torch

    from edgelm.export.source import open_source

    hf, path = odd_rope
    ids = np.array([[5, 99, 1200, 7, 640, 33, 1800, 412, 77, 21, 90]], dtype=np.int64)
    expected = _hf_logits(hf, ids)
    with torch.no_grad():
        ours = open_source(path).model(torch.from_numpy(ids))[0].numpy()
    assert np.abs(ours - expected).max() < 1e-4
    hf.model.rotary_emb.inv_freq = hf.model.rotary_emb.inv_freq * torch.from_numpy(ODD_FACTORS)  # factors left out
    assert np.abs(ours - _hf_logits(hf, ids)).max() > 1e-2, "the factors change these logits"
    hf.model.rotary_emb.inv_freq = hf.model.rotary_emb.inv_freq / torch.from_numpy(ODD_FACTORS)
