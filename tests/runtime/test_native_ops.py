"""The ai.edgelm custom ops (runtime/csrc/ort_ops.c) inside ONNX Runtime: MatMulPacked equals the kernels' scalar
reference bit for bit on one thread and on ONNX Runtime's pool, GatherPacked the kernels' dequantized rows; a bad
attribute or input is an ONNX Runtime error naming the op, never a crash."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGML_QUANT_SIZES
from onnx import TensorProto, helper, numpy_helper
from test_native_blocks import TYPES, bits, random_rows

from edgelm.runtime import native


@pytest.fixture(scope="module")
def library():
    try:
        return str(native.ops_library())
    except native.NativeUnavailable as error:
        pytest.skip(f"native ops not built: {error}")


def session(node, inputs, outputs, initializers, library: str, threads: int = 2) -> ort.InferenceSession:
    graph = helper.make_graph([node], "g", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def matmul_session(kind, rows, k, library, threads=2, **attributes):
    n = rows.shape[0]
    node = helper.make_node(
        "MatMulPacked", ["A", "B"], ["Y"], domain=native.DOMAIN, packed_type=int(kind), N=n, K=k, **attributes
    )
    return session(
        node,
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["batch", "sequence", "features"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rows, "B")],
        library,
        threads,
    )


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_packed_matches_reference(library, kind, threads):
    rng = np.random.default_rng(int(kind))
    elems = GGML_QUANT_SIZES[kind][0]
    k, n = elems * (2 if elems == 256 else 9), 101  # more rows than one task of the pool
    rows = random_rows(kind, n, k, rng)
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    (y,) = matmul_session(kind, rows, k, library, threads).run(None, {"A": a})
    assert y.shape == (2, 3, n)
    reference = native.matmul(kind, rows, a.reshape(6, k), isa="scalar").reshape(2, 3, n)
    assert np.array_equal(bits(y), bits(reference))
    (one,) = matmul_session(kind, rows, k, library, threads).run(None, {"A": a[:1, :1]})  # a decode step
    assert np.array_equal(bits(one), bits(reference[:1, :1]))


def test_matmul_packed_refuses_bad_input(library):
    kind = TYPES[0]
    rows = random_rows(kind, 4, 64, np.random.default_rng(0))
    with pytest.raises(Exception, match="K=48 must be a positive multiple of 32"):
        matmul_session(kind, rows, 48, library)
    with pytest.raises(Exception, match="packed_type 99"):
        node = helper.make_node("MatMulPacked", ["A", "B"], ["Y"], domain=native.DOMAIN, packed_type=99, N=4, K=64)
        session(
            node,
            [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 64])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(rows, "B")],
            library,
        ).run(None, {"A": np.zeros((1, 64), np.float32)})
    good = matmul_session(kind, rows, 64, library)
    with pytest.raises(Exception, match="last axis must be K=64"):
        good.run(None, {"A": np.zeros((1, 1, 32), np.float32)})


def gather_session(kind, rows, k, library):
    node = helper.make_node("GatherPacked", ["data", "ids"], ["out"], domain=native.DOMAIN, packed_type=int(kind), K=k)
    return session(
        node,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rows, "data")],
        library,
    )


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_gather_packed_rows(library, kind):
    elems = GGML_QUANT_SIZES[kind][0]
    k = elems * 2
    rows = random_rows(kind, 11, k, np.random.default_rng(1))
    ids = np.array([[0, 10, 3], [-1, 5, 5]], np.int64)
    (out,) = gather_session(kind, rows, k, library).run(None, {"ids": ids})
    table = native.dequantize(kind, rows, k)
    assert np.array_equal(out, table[ids])
    with pytest.raises(Exception, match="index 11 is out of range for 11 rows"):
        gather_session(kind, rows, k, library).run(None, {"ids": np.array([[11]], np.int64)})
