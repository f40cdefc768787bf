"""edgelm.writers.onnxfile.save_model: weights in model.onnx.data (large tensors at page offsets, small ones in the
gaps, shape constants inline), from placeholders streamed one array at a time or from a whole model, and
read back identically by onnx and ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelm.writers.onnxfile import (
    ALIGNMENT,
    INLINE_LIMIT,
    SMALL_ALIGNMENT,
    _layout,
    data_file,
    placeholder,
    save_model,
)

# (name, shape): large (at least 4 KiB as float32), small (1 KiB .. 4 KiB) and tiny (inline) tensors, mixed
SHAPES = [("w0", (96, 200)), ("b0", (300,)), ("w1", (200, 170)), ("s0", (3,)), ("b1", (170,)), ("w2", (170, 96))]


def arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES}


def chain(initializers: list[TensorProto]) -> onnx.ModelProto:
    """y = ((x @ w0) @ w1 + b1) @ w2 for x (1, 96); b0 and s0 are passed through to outputs of their own."""
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h0"]),
        helper.make_node("MatMul", ["h0", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["y"]),
        helper.make_node("Identity", ["b0"], ["b0_out"]),
        helper.make_node("Identity", ["s0"], ["s0_out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 96])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 96]),
            helper.make_tensor_value_info("b0_out", TensorProto.FLOAT, [300]),
            helper.make_tensor_value_info("s0_out", TensorProto.FLOAT, [3]),
        ],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def expected(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    return ((x @ weights["w0"]) @ weights["w1"] + weights["b1"]) @ weights["w2"]


def external_entries(path) -> dict[str, dict[str, str]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return {t.name: {e.key: e.value for e in t.external_data} for t in graph.initializer}


@pytest.mark.parametrize("how", ["streamed", "whole"])
def test_weights_go_to_the_data_file_aligned_and_read_back_the_same(tmp_path, how):
    weights = arrays()
    if how == "streamed":
        model = chain([placeholder(name, array) for name, array in weights.items()])
        location = save_model(model, tmp_path / "model.onnx", weights=dict(weights))
    else:
        model = chain([numpy_helper.from_array(array, name) for name, array in weights.items()])
        location = save_model(model, tmp_path / "model.onnx")
    assert location == "model.onnx.data" and data_file(tmp_path / "model.onnx") == tmp_path / location
    entries = external_entries(tmp_path / "model.onnx")
    assert entries["s0"] == {}, "a 12-byte constant stays inline"
    spans = []
    for name, array in weights.items():
        if array.nbytes < INLINE_LIMIT:
            continue
        entry = entries[name]
        offset, length = int(entry["offset"]), int(entry["length"])
        assert entry["location"] == location and length == array.nbytes
        assert offset % (ALIGNMENT if length >= ALIGNMENT else SMALL_ALIGNMENT) == 0, (name, offset)
        spans.append((offset, offset + length))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), f"tensors overlap: {spans}"
    assert (tmp_path / location).stat().st_size == spans[-1][1]
    loaded = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "model.onnx")).graph.initializer}
    for name, array in weights.items():
        np.testing.assert_array_equal(loaded[name], array, err_msg=name)
    x = np.random.default_rng(1).standard_normal((1, 96)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    y, b0, s0 = session.run(None, {"x": x})
    np.testing.assert_allclose(y, expected(weights, x), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(b0, weights["b0"])
    np.testing.assert_array_equal(s0, weights["s0"])


def test_streaming_pops_each_array_and_converts_floats(tmp_path):
    weights = arrays()
    given = {name: array.astype(np.float64) for name, array in weights.items()}  # written as float32
    model = chain([placeholder(name, array) for name, array in given.items()])
    save_model(model, tmp_path / "model.onnx", weights=given)
    assert given == {}, "each array is dropped from the dict once written"
    loaded = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "model.onnx")).graph.initializer}
    assert all(loaded[name].dtype == np.float32 for name in weights)
    np.testing.assert_array_equal(loaded["w1"], weights["w1"])


def test_a_model_of_small_constants_has_no_data_file(tmp_path):
    (tmp_path / "model.onnx.data").write_bytes(b"stale")  # from an earlier save: removed, not left behind
    small = {"s0": np.arange(3, dtype=np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Identity", ["s0"], ["y"])],
        "small",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(small["s0"], "s0")],
    )
    assert save_model(helper.make_model(graph), tmp_path / "model.onnx") is None
    assert not (tmp_path / "model.onnx.data").exists()


def test_layout_fills_the_alignment_gaps_with_small_tensors():
    big, small = ALIGNMENT + 100, ALIGNMENT // 4
    offsets = _layout([big, small, big, small])
    assert offsets[0] == 0 and offsets[2] == 2 * ALIGNMENT  # big ones aligned
    assert big <= offsets[1] and offsets[1] + small <= 2 * ALIGNMENT  # the small one sits in the gap
    assert offsets[3] == offsets[1] + small + (-small % SMALL_ALIGNMENT)  # and the next one after it


def test_a_model_still_pointing_at_external_data_is_refused(tmp_path):
    weights = arrays()
    save_model(chain([placeholder(n, a) for n, a in weights.items()]), tmp_path / "model.onnx", weights=weights)
    unloaded = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    with pytest.raises(ValueError, match="external data"):
        save_model(unloaded, tmp_path / "other.onnx")
