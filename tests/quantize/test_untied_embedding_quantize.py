"""int4 and int8-weight-only on an untied embedding (`export --quantize`, `quantize`): the token table becomes blocks
at the LM head's bits, its rows gathered from them, so no float (V, C) table is left in the package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import genai_greedy, quiet, save_random_model
from onnx import helper, numpy_helper

from edgelm.export.onnx_export import export_package
from edgelm.quantize.quantize import quantize_package
from edgelm.runtime import load

VOCAB = 2048  # the bundled tokenizer's
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, initializer_range=0.15,
)  # fmt: skip
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
IDS = np.random.default_rng(1).integers(0, VOCAB, (2, 7))


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per family: (its Hugging Face folder, its fp32 package)."""
    made = {}
    for name, classes in MODELS.items():
        root = tmp_path_factory.mktemp(f"untied-{name}")
        save_random_model(root / "hf", classes, SHAPE)
        export_package(root / "hf", root / "fp32", progress=quiet, bars=False)
        made[name] = (root / "hf", root / "fp32")
    return made


def _float_tables(package: Path) -> list[str]:
    """Float (V, C) or (C, V) initializers: an embedding or LM head table."""
    model = onnx.load(package / "model.onnx", load_external_data=False)
    return [
        i.name
        for i in model.graph.initializer
        if i.data_type == onnx.TensorProto.FLOAT and sorted(i.dims) == sorted([VOCAB, SHAPE["hidden_size"]])
    ]


def _logits(package: Path) -> np.ndarray:
    return load(package, provider="cpu").forward(IDS)[0]


@pytest.mark.parametrize(("family", "mode"), [("llama", "int4"), ("llama", "int8-weight-only"), ("qwen3", "int4")])
def test_export_quantize_is_export_then_quantize(untied, tmp_path, family, mode) -> None:
    """export --quantize (its own parity check against the reference on the same blocks passes) writes the bytes
    export then quantize writes; neither keeps a float embedding."""
    hf, fp32 = untied[family]
    assert "embed.weight" in _float_tables(fp32)
    direct, two_step = tmp_path / "direct", tmp_path / "two-step"
    manifest = export_package(hf, direct, quantize=mode, progress=quiet, bars=False)
    assert manifest["parity"]["max_abs_logit_diff"] < manifest["parity"]["tolerance"]
    expected = quantize_package(fp32, two_step, mode=mode, progress=quiet)
    assert manifest["recipe"]["embedding"] == expected["recipe"]["embedding"] == "int8"  # the head's bits
    for package in (direct, two_step):
        assert _float_tables(package) == [], package.name
    assert (direct / "model.onnx.data").read_bytes() == (two_step / "model.onnx.data").read_bytes()
    np.testing.assert_array_equal(_logits(direct), _logits(two_step))


def _with_float_table(package: Path, bits: int) -> onnx.ModelProto:
    """The quantized package's graph with its embedding gathered from a float table holding what its blocks hold:
    (q - zero point) * scale, dequantized here in numpy (4-bit values two a byte, low nibble first)."""
    model = onnx.load(package / "model.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    packed, scales = inits[f"embed.weight_Q{bits}"], inits["embed.weight_scales"]  # (V, blocks, blob), (V, blocks)
    if bits == 4:
        packed = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*scales.shape, -1)
    table = ((packed.astype(np.float32) - 2 ** (bits - 1)) * scales[..., None]).reshape(VOCAB, -1)
    ours = [n for n in model.graph.node if n.name.startswith(f"embed/Gather_int{bits}_")]
    rows = next(n for n in ours if n.name == f"embed/Gather_int{bits}_rows")
    ids = next(n for n in ours if n.op_type == "Gather" and n.input[0] == f"embed.weight_Q{bits}").input[1]
    index = list(model.graph.node).index(ours[0])
    for node in ours:
        model.graph.node.remove(node)
    model.graph.node.insert(index, helper.make_node("Gather", ["embed.weight", ids], [rows.output[0]], axis=0))
    model.graph.initializer.append(numpy_helper.from_array(table, "embed.weight"))
    return model


@pytest.mark.parametrize(
    ("mode", "head", "bits"), [("int4", "int8", 8), ("int8-weight-only", "int8", 8), ("int4", "int4", 4)]
)
def test_quantized_embedding_is_its_dequantized_blocks(untied, tmp_path, mode, head, bits) -> None:
    """quantize's embedding takes the LM head's bits; its logits are those of the same graph gathering from a float
    table of the blocks' values, and onnxruntime-genai runs the package to the same greedy tokens."""
    package = tmp_path / "q"
    manifest = quantize_package(untied["llama"][1], package, mode=mode, int4_lm_head=head, progress=quiet)
    assert (manifest["recipe"]["lm_head"], manifest["recipe"]["embedding"]) == (f"int{bits}", f"int{bits}")
    runtime = load(package, provider="cpu")
    quantized = runtime.forward(IDS)[0]
    reference = _with_float_table(package, bits)
    table = numpy_helper.to_array(next(i for i in reference.graph.initializer if i.name == "embed.weight"))
    original = numpy_helper.to_array(
        next(i for i in onnx.load(untied["llama"][1] / "model.onnx").graph.initializer if i.name == "embed.weight")
    )
    scales = numpy_helper.to_array(next(i for i in reference.graph.initializer if i.name == "embed.weight_scales"))
    step = np.abs(np.repeat(scales, 32, axis=1))  # the recipe's blocks of 32 along C
    # within a step of its block (onnxruntime's kernel puts the largest magnitude at -2^(bits-1): +max clips)
    assert (np.abs(table - original) <= step * (1 + 1e-5)).all()
    assert np.abs(table - original).mean() < step.mean() / 3  # rounded to nearest, not truncated or misplaced
    runtime.session = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(quantized, runtime.forward(IDS)[0])
    runtime = load(package, provider="cpu")
    prompt = [5, 17, 99, 3]
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(runtime.forward(np.array([tokens]))[0][0, -1].argmax()))
    assert genai_greedy(package, prompt, 6) == tokens[len(prompt) :]
