"""int4 and int8-weight-only quantization of hybrid packages (LFM2, Qwen3.5): exactly the linears become
MatMulNBits blocks (the attention's, the short convolution's or the Gated DeltaNet's projections and gates, the
MLP's and the LM head), and what the recurrence and the convolution read stays float32 as exported (the depthwise
convolution kernels, Qwen3.5's -exp(A_log) and dt_bias, every norm). On a wider random model with transformers'
own initialization (where the logits do not flip at the first rounding) the quantized packages follow the fp32
package: int8 keeps the top token at nearly every position; `export --quantize` writes the same nodes."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import onnx
import pytest
import torch
from family_cases import CASES
from helpers import BUNDLED_TOKENIZER, quiet
from onnx import numpy_helper

from edgelm.export.onnx_export import export_package
from edgelm.quantize.quantize import quantize_package
from edgelm.runtime import load

pytestmark = pytest.mark.usefixtures("one_torch_thread")
WIDE = dict(hidden_size=256, intermediate_size=512, initializer_range=0.02)
LINEAR_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)
MIXER_LINEARS = {
    "conv": ["conv.in_proj", "conv.out_proj"],
    "linear_attention": ["delta.in_proj", "delta.z", "delta.b", "delta.a", "delta.out_proj"],
    "full_attention": ["qkv", "attention_out"],
}
RNG = np.random.default_rng(0)
PROMPTS = [[int(x) for x in RNG.integers(3, 2000, n)] for n in (5, 12, 30)]


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5_text"])
def case(request, tmp_path_factory) -> dict:
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
def test_the_linears_are_blocks_and_the_state_parts_stay_float(case, mode):
    initializers, nodes = _initializers(case["root"] / mode)
    blocks = {node.input[1].removesuffix("_Q8").removesuffix("_Q4").removesuffix(".weight") for node in nodes
              if node.op_type == "MatMulNBits"}  # fmt: skip
    expected = {f"layers.{i}.{name}" for i, kind in enumerate(case["layer_types"]) for name in MIXER_LINEARS[kind]}
    expected |= {f"layers.{i}.mlp.{name}" for i in range(len(case["layer_types"])) for name in ("up", "down")}
    assert blocks - {"lm_head", "lm_head.weight_T", "embed"} == expected  # the LM head, untied or tied, too
    assert not [n.name for n in nodes if n.op_type == "MatMul" and n.input[1] in initializers]
    floats, _ = _initializers(case["root"] / "fp32")
    kept = [name for name in floats if name.endswith(("conv.weight", "neg_exp_a_log", "dt_bias", "norm.weight"))]
    assert any(name.endswith("conv.weight") for name in kept) and any(name.endswith("norm.weight") for name in kept)
    assert (case["family"] == "qwen3_5_text") == any(name.endswith("neg_exp_a_log") for name in kept)
    for name in kept:
        assert initializers[name].data_type == onnx.TensorProto.FLOAT, name
        assert np.array_equal(numpy_helper.to_array(initializers[name]), numpy_helper.to_array(floats[name])), name


def test_the_quantized_packages_follow_the_fp32_package(case):
    base = load(case["root"] / "fp32", provider="cpu", threads=1)
    # (mode, least top-1 agreement, largest error relative to the logits' spread): int4's bounds only catch a
    # broken layout (relative error 1 or more), its top token flips where this random model's margins are thin
    for mode, agreement, error in (("int8-weight-only", 0.9, 0.05), ("int4", 0.4, 0.5)):
        model = load(case["root"] / mode, provider="cpu", threads=1)
        same, relative = [], []
        for prompt in PROMPTS:
            ids = prompt + base.generate(prompt, 16, ignore_eos=True).token_ids
            expected, logits = base.forward(np.array([ids]))[0][0], model.forward(np.array([ids]))[0][0]
            same += list(expected.argmax(-1) == logits.argmax(-1))
            centred = expected - expected.mean(-1, keepdims=True)
            relative.append(np.linalg.norm(logits - expected) / np.linalg.norm(centred))
            assert len(model.generate(prompt, 8, ignore_eos=True).token_ids) == 8
        assert np.mean(same) >= agreement and max(relative) < error, mode


def test_export_quantize_writes_the_same_blocks(case):
    # the same blocks as export then quantize, bit for bit (a tied LM head is named lm_head.weight_T there)
    same = lambda name: name.replace("lm_head.weight_T", "lm_head.weight")  # noqa: E731
    exported, nodes = _initializers(case["root"] / "export-int4")
    quantized, quantized_nodes = _initializers(case["root"] / "int4")
    quantized = {same(name): tensor for name, tensor in quantized.items()}
    blocks = lambda graph: sorted(same(n.input[1]) for n in graph if n.op_type == "MatMulNBits")  # noqa: E731
    assert blocks(nodes) == blocks(quantized_nodes)
    for name in blocks(nodes):
        for array in (name, name.rsplit("_Q", 1)[0] + "_scales"):
            values = numpy_helper.to_array(exported[array]), numpy_helper.to_array(quantized[array])
            assert np.array_equal(*values), array
