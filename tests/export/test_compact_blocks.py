"""Kept GGUF blocks stored compactly (export/compact_blocks.py): ONNX Runtime's constant folding turns the bit
planes and factors back into exactly the MatMulNBits inputs a plain package holds, so the session runs the
same graph. Every block type alone and in mixed packed linears, node by node (folded tensors equal the plain
arrays bit for bit, outputs identical at accuracy levels 0 and 4), and whole packages (logits and greedy ids
identical to a package written the plain way, and smaller)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import folded_graph, genai_greedy, quiet  # noqa: E402
from test_gguf_blocks import FIXTURES, MIXED, random_blocks, write_llama  # noqa: E402

from edgelm.export.compact_blocks import PLANES, bit_planes  # noqa: E402
from edgelm.export.families import kept_blocks  # noqa: E402
from edgelm.export.gguf_blocks import BLOCK_TYPES, to_runs  # noqa: E402
from edgelm.export.graph import MS_DOMAIN, _GraphBuilder  # noqa: E402
from edgelm.export.onnx_export import export_package  # noqa: E402
from edgelm.runtime import load  # noqa: E402

K = 512
TYPES = sorted(BLOCK_TYPES, key=lambda kind: kind.name)
# packed linears of mixed types: 4 and 8 bits, runs of 16 and 32, with and without offsets
MIXES = [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q2_K, Q.Q3_K, Q.Q4_1), (Q.Q5_0, Q.Q5_1, Q.Q8_0), (Q.Q4_0, Q.Q5_K, Q.Q6_K)]


def _nbits(kinds: tuple[Q, ...], seed: int, *, rows: int = 32):
    rng = np.random.default_rng(seed)
    parts = {f"w{i}": to_runs(kind, random_blocks(kind, rows * (i + 1), K, rng), K) for i, kind in enumerate(kinds)}
    return kept_blocks(parts.get, list(parts))


def _model(nbits, *, accuracy_level: int, compact: bool) -> onnx.ModelProto:
    """x (B, T, K) -> y (B, T, N): one kept linear as export/graph.py writes it."""
    g = _GraphBuilder(accuracy_level=accuracy_level, compact=compact)
    g.matmul_nbits("x", "w", nbits, "y")
    k, n = nbits.shape
    inits = [numpy_helper.from_array(np.asarray(array), name) for name, array in g.weights.items()]
    graph = helper.make_graph(
        g.weight_nodes + g.nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _session(model: onnx.ModelProto, optimized: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # as runtime/session.py
    if optimized is not None:
        options.optimized_model_filepath = optimized
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("value_bits", [2, 3, 5, 6])
def test_bit_planes_hold_every_bit(value_bits):
    values = np.random.default_rng(value_bits).integers(-(2 ** (value_bits - 1)), 2 ** (value_bits - 1), (4, 64))
    planes = bit_planes(values.astype(np.int8), value_bits=value_bits)
    assert [plane.width for plane in planes] == list(PLANES[value_bits])
    assert sum(plane.packed.size for plane in planes) * 8 == values.size * value_bits  # no bit wasted
    u = np.zeros(values.size, np.int64)
    for plane in planes:
        shifted = plane.packed[:, None] >> (np.arange(8 // plane.width) * plane.width).astype(np.uint8)
        u += ((shifted % (1 << plane.width)).reshape(-1).astype(np.int64)) << plane.offset
    np.testing.assert_array_equal(u - 2 ** (value_bits - 1), values.reshape(-1))


@pytest.mark.parametrize("kinds", [(kind,) for kind in TYPES] + MIXES, ids=lambda ks: "+".join(k.name for k in ks))
def test_folded_inputs_equal_plain_arrays_and_outputs_are_identical(kinds, tmp_path):
    nbits = _nbits(kinds, seed=sum(int(kind) for kind in kinds))
    optimized = tmp_path / "optimized.onnx"
    x = np.random.default_rng(0).standard_normal((1, 3, K)).astype(np.float32)
    for level in (0, 4):
        compact = _session(_model(nbits, accuracy_level=level, compact=True), str(optimized))
        plain = _session(_model(nbits, accuracy_level=level, compact=False))
        np.testing.assert_array_equal(compact.run(None, {"x": x})[0], plain.run(None, {"x": x})[0])
    graph = onnx.load(str(optimized)).graph
    assert {n.op_type for n in graph.node} <= {"MatMulNBits", "Reshape", "ReduceSum", "MatMul", "Add"}, "all folded"
    folded = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    expected = {f"w.weight_Q{nbits.bits}": nbits.packed, "w.weight_scales": nbits.scales}
    if nbits.block_offsets is not None:
        expected["w.weight_block_offsets"] = nbits.block_offsets
    for name, array in expected.items():
        assert folded[name].dtype == array.dtype and folded[name].shape == array.shape, name
        np.testing.assert_array_equal(folded[name].view(np.uint8), array.view(np.uint8), err_msg=name)  # bit for bit


def test_compact_stores_fewer_bytes_than_plain():
    for kind in TYPES:
        nbits = _nbits((kind,), seed=1, rows=512)
        sizes = [
            sum(np.asarray(a).nbytes for a in _graph_weights(nbits, compact=compact).values())
            for compact in (True, False)
        ]
        bits_a_weight = 8 * sizes[0] / (nbits.shape[0] * nbits.shape[1])
        size_a_block, weights_a_block = gguf.GGML_QUANT_SIZES[kind][1], gguf.GGML_QUANT_SIZES[kind][0]
        assert sizes[0] < sizes[1] or kind in (Q.Q4_0,), kind  # Q4_0: 4 bits and an fp16 scale either way
        # within a bit of the file (Q2_K's 4-bit sc and mn take a byte each here)
        assert bits_a_weight <= 8 * size_a_block / weights_a_block + 1, (kind, bits_a_weight)
        assert BLOCK_TYPES[kind].value_bits <= BLOCK_TYPES[kind].bits


def _graph_weights(nbits, *, compact: bool) -> dict[str, np.ndarray]:
    g = _GraphBuilder(accuracy_level=4, compact=compact)
    g.matmul_nbits("x", "w", nbits, "y")
    return g.weights


# --- whole packages ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("files")
    untied = {"token_embd": Q.Q4_K, "output": Q.Q6_K, "0.attn_v": Q.Q5_1, "0.ffn_down": Q.Q3_K}
    return {
        "mixed": write_llama(folder / "mixed.gguf", MIXED),
        "untied": write_llama(folder / "untied.gguf", untied, layers=1, tied=False, seed=4),
        **{path.stem.split(".")[1]: path for path in sorted(FIXTURES.glob("tiny-llama.*.gguf"))},
    }


@pytest.mark.parametrize("name", ["mixed", "untied", "Q2_K", "Q4_K_M", "Q5_K_M"])
@pytest.mark.parametrize("level", [0, 4])
def test_compact_package_runs_exactly_as_the_plain_one(files, name, level, tmp_path):
    path = files[name]
    manifests = {}
    for compact in (True, False):
        manifests[compact] = export_package(
            path, tmp_path / str(compact), accuracy_level=level, compact_blocks=compact, progress=quiet
        )
    sizes = {compact: sum(f["bytes"] for f in m["files"].values()) for compact, m in manifests.items()}
    assert sizes[True] < 0.8 * sizes[False], sizes
    prompt = [5, 17, 300, 42, 9, 100, 77]
    compact, plain = load(tmp_path / "True"), load(tmp_path / "False")
    np.testing.assert_array_equal(compact.forward(np.array([prompt]))[0], plain.forward(np.array([prompt]))[0])
    ids = compact.generate(prompt, 12, ignore_eos=True).token_ids
    assert ids == plain.generate(prompt, 12, ignore_eos=True).token_ids
    assert manifests[True]["recipe"]["storage"] == "compact" and manifests[False]["recipe"]["storage"] == "plain"


def test_runtime_folds_the_unpacking_away(files, tmp_path):
    """The runtime's session options keep constant folding on: every MatMulNBits reads constant blocks."""
    package = tmp_path / "pkg"
    export_package(files["mixed"], package, accuracy_level=0, progress=quiet)
    model = load(package)
    level = model.session.get_session_options().graph_optimization_level
    assert level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    graph, inits = folded_graph(package, tmp_path, level="all")
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 9 and all(n.input[1] in inits and n.input[2] in inits for n in nodes)
    assert not any(n.op_type == "BitShift" for n in graph.node)


@pytest.mark.parametrize("level, compact", [(0, True), (4, True), (4, False)])
def test_onnxruntime_genai_runs_a_compact_package(files, level, compact, tmp_path):
    """onnxruntime-genai folds the unpacking too (its sessions optimize at "all" unless told otherwise): llama.cpp's
    Q4_K_M (a Q6_K value beside Q4_K query and key, a Q6_K tied table) gives edgelm's greedy ids; plain, the
    embedding gathers the tied table through names of its own for the head's bytes (writers/onnxfile.py SameBytes)."""
    export_package(files["Q4_K_M"], tmp_path / "pkg", accuracy_level=level, compact_blocks=compact, progress=quiet)
    genai_options = json.loads((tmp_path / "pkg" / "genai_config.json").read_text())["model"]["decoder"]
    assert genai_options["session_options"]["graph_optimization_level"] == "ORT_ENABLE_ALL"  # folds the blocks
    prompt = [5, 17, 300, 42, 9, 100, 77]
    ids = load(tmp_path / "pkg").generate(prompt, 16, ignore_eos=True).token_ids
    assert len(set(ids)) > 3, "a degenerate model would not test much"
    genai = genai_greedy(tmp_path / "pkg", prompt, 16)  # stops at an EOS id, which edgelm was told to ignore
    assert len(genai) > 3 and genai == ids[: len(genai)]


@pytest.mark.parametrize(
    "option, storage", [([], "plain"), (["--plain-blocks"], "plain"), (["--compact-blocks"], "compact")]
)
def test_storage_at_the_command_line(files, tmp_path, option, storage):
    """Plain blocks are the default: compact ones load several times slower, at a peak of several copies of the
    weights (docs/benchmarks.md, "Real sizes")."""
    from edgelm.cli import main

    assert main(["export", str(files["Q2_K"]), str(tmp_path / "pkg"), *option]) == 0
    graph = onnx.load(str(tmp_path / "pkg" / "model.onnx"), load_external_data=False).graph
    plain = "lm_head.weight_Q8" in {i.name for i in graph.initializer} and graph.node[0].op_type != "BitShift"
    assert plain == (storage == "plain")
    assert f'"storage": "{storage}"' in (tmp_path / "pkg" / "edgelm.json").read_text()
