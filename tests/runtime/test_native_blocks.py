"""The native kernels (runtime/csrc/blocks.c) against their scalar reference, bit for bit, on every block type and
ISA this CPU runs, random and real blocks and odd shapes; and the reference against float64 weights dequantized by
gguf-py, within the error that quantizing the activations to int8 allows."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from edgelm.runtime import native

Q = GGMLQuantizationType
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
HALVES = {  # where each type's float16 factors are in a block (d, then m or dmin)
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip


@pytest.fixture(scope="module")
def kernels():
    try:
        return native.kernel_library()
    except native.NativeUnavailable as error:
        pytest.skip(f"native kernels not built: {error}")


def isas() -> list[str]:
    library = native.kernel_library()
    return [name for level, name in enumerate(native.ISAS) if level and library.eb_isa_supported(level)]


def emulated() -> list:
    """The AVX-512 VNNI source run with its VNNI instructions emulated on AVX2 (native.emulated_vnni_library), where
    this CPU cannot run the real one; else nothing (the real one is checked)."""
    if "avx512vnni" in isas() or "avx2" not in isas():
        return []
    return [native.emulated_vnni_library()]


def random_rows(kind: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of random blocks with finite float16 factors (of either sign, some zero)."""
    elems, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (n * k // elems, size), dtype=np.uint8)
    for at in HALVES[kind]:
        half = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16)
        half[rng.random(len(blocks)) < 0.05] = 0
        blocks[:, at : at + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def activation_bound(kind: Q, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """|y - x W^T| allowed by int8 activations: half a step of each block's scale, times |w|, plus float32 noise."""
    block = 32  # every type's activations are quantized in groups of 32
    m, k = x.shape
    step = np.abs(x).reshape(m, k // block, block).max(axis=2) / 127  # (M, blocks)
    abs_w = np.abs(w).reshape(w.shape[0], k // block, block).sum(axis=2)  # (N, blocks)
    return 0.5 * step @ abs_w.T * 1.0001 + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-30


def check_rows(kind: Q, rows: np.ndarray, x: np.ndarray) -> None:
    k = x.shape[1]
    reference = native.matmul(kind, rows, x, isa="scalar")
    paths = [(isa, isa, None) for isa in isas()]
    paths += [("avx512vnni (emulated on AVX2)", "avx512vnni", library) for library in emulated()]
    for name, isa, library in paths:
        fast = native.matmul(kind, rows, x, isa=isa, library=library)
        assert np.array_equal(bits(fast), bits(reference)), (
            f"{kind.name} {name} differs from the scalar reference at "
            f"{np.argwhere(bits(fast) != bits(reference))[:3].tolist()}"
        )
    w = dequantize(rows, kind).astype(np.float64).reshape(rows.shape[0], k)
    exact = x.astype(np.float64) @ w.T
    error, bound = np.abs(reference - exact), activation_bound(kind, w, x.astype(np.float64))
    assert np.all(error <= bound), f"{kind.name}: error {error.max():.3g} over bound at {np.argmax(error - bound)}"
    assert np.all(np.isfinite(reference))


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 9, 16, 17, 21])  # a row; 16-row tiles: short, one, one and 1, one and 5
def test_random_blocks_match_reference(kernels, kind: Q, m: int):
    rng = np.random.default_rng([int(kind), m])
    elems = GGML_QUANT_SIZES[kind][0]
    k = elems * (3 if elems == 256 else 19)  # a legacy K that is not a multiple of 256; N odd
    rows = random_rows(kind, 37, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, : elems // 2] *= 40  # a block with an outlier
    check_rows(kind, rows, x)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(kernels, kind: Q):
    rng = np.random.default_rng(int(kind))
    elems = GGML_QUANT_SIZES[kind][0]
    rows = random_rows(kind, 5, elems * 2, rng)
    ours = native.dequantize(kind, rows, elems * 2)
    theirs = dequantize(rows, kind).reshape(5, -1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_edge_activations(kernels):
    """Zero rows, a single huge value, and equal magnitudes (ties of the rounding) stay exact and finite."""
    rng = np.random.default_rng(0)
    for kind in TYPES:
        k = GGML_QUANT_SIZES[kind][0] * 2
        rows = random_rows(kind, 9, k, rng)
        x = np.zeros((4, k), np.float32)
        x[1, 5] = 3e4
        x[2] = np.where(np.arange(k) % 2, 1.0, -0.5)  # x / d lands on halves: round half to even
        x[3] = rng.standard_normal(k) * 1e-20
        check_rows(kind, rows, x)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_extreme_sums(kernels, kind: Q):
    """Every weight at its largest magnitude against activations of +-127: the prompt tiles add several maddubs'
    int16 pair sums before widening (blocks_simd.h lane_dots), and this is where they would overflow."""
    k = 512
    rows = random_rows(kind, 5, k, np.random.default_rng(1))
    size = GGML_QUANT_SIZES[kind][1]
    halves = {at + i for at in HALVES[kind] for i in (0, 1)}
    body = [i for i in range(size) if i not in halves]  # every byte but the float16 factors
    blocks = rows.reshape(-1, size)
    blocks[:, body] = 0x80 if kind == Q.Q8_0 else 0xFF  # Q8_0: -128; the others: every value, scale, bit at its top
    x = np.ones((19, k), np.float32)  # a tile of 16 rows and 3 more
    x[1::2] = -1.0
    check_rows(kind, blocks.reshape(rows.shape), x)


def test_bad_shapes_are_refused(kernels):
    rows = np.zeros((4, 18), np.uint8)
    with pytest.raises(ValueError, match="not K=64"):
        native.matmul(Q.Q4_0, rows, np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="not one the native kernels read"):
        native.matmul(Q.IQ2_XS, rows, np.zeros((1, 32), np.float32))


def real_tensors(path, wanted: int = 48):
    """(type, rows, K) of the first tensor of each kept block type in a GGUF file, `wanted` rows of it."""
    seen = {}
    for tensor in GGUFReader(path).tensors:
        kind = Q(tensor.tensor_type)
        if kind in TYPES and kind not in seen and len(tensor.shape) == 2:
            rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)
            seen[kind] = (tensor.name, np.array(rows[:wanted]), int(tensor.shape[0]))
    return seen


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_real_blocks_match_reference(kernels, fixture, request):
    tensors = real_tensors(request.getfixturevalue(fixture))
    expected = {"smollm2_gguf": {Q.Q4_1, Q.Q8_0}, "gemma3_gguf": {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0}}[fixture]
    assert expected <= set(tensors), f"{fixture} holds {sorted(t.name for t in tensors)}"
    rng = np.random.default_rng(7)
    for kind, (_name, rows, k) in tensors.items():
        x = rng.standard_normal((3, k)).astype(np.float32)
        check_rows(kind, rows, x)
