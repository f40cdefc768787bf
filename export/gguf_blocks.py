"""llama.cpp's quantized blocks as ONNX Runtime MatMulNBits blocks, without requantizing.

Every block type llama.cpp's presets write stores a weight as w = scale * c + offset over short runs of
consecutive inputs, with c a small integer. MatMulNBits (com.microsoft, 4 or 8 bits, block_size a power of
two >= 16) computes w = (q - zero_point) * scale per block, so each type maps onto it exactly:

    type   its w                         here: bits  block  c (centred value)   offset
    Q4_0   d (q - 8)                           4     32     q - 8               -
    Q4_1   d q + m                             4     32     q - 8               m + 8 d
    Q5_0   d (q - 16)                          8     32     q - 16              -
    Q5_1   d q + m                             8     32     q - 16              m + 16 d
    Q8_0   d q                                 8     32     q                   -
    Q2_K   d sc q - dmin mn, 16-runs           4     16     q - 2               2 s - dmin mn
    Q3_K   d (sc - 32) q, 16-runs              4     16     q (-4 .. 3)         -
    Q4_K   d sc q - dmin mn, 32-runs           4     32     q - 8               8 s - dmin mn
    Q5_K   d sc q - dmin mn, 32-runs           8     32     q - 16              16 s - dmin mn
    Q6_K   d sc (q - 32), 16-runs              8     16     q - 32              -

(s: the run's scale d * sc.) The stored value is c + 2^(bits - 1), so the zero point is always MatMulNBits'
default and the graph needs no zero-point input; the offset is added beside the node as (block sums of x) @
offsets (export/graph.py). 5- and 6-bit values take 8-bit blocks; 2- and 3-bit values 4-bit ones. Offsets
are centred on the run's middle value, so its two terms cancel less than d q and m would. Each type also
keeps the numbers its scales and offsets come from (`Factors`), which export/compact_blocks.py stores instead
of the float32 results. Layouts:
https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h (block_q4_0 ... block_q6_K).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

Q = GGMLQuantizationType
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


class Factors(NamedTuple):
    """A weight's run scales and offsets as the file holds them, for G groups of runs in each of N rows (a legacy
    block of 32: one run; a K-quant super-block of 256: 8 or 16): scale = d * sc, offset = middle * scale - dmin
    * mn, in float32 and in that order (`scales_offsets`; export/compact_blocks.py has the package compute them
    the same way at load)."""

    d: np.ndarray  # float16 (N, G, 1), or (N, G, runs) for a legacy block split into shorter runs
    sc: np.ndarray | None  # int8 or uint8 (N, G, runs): K-quants' sub-block scales; None: 1
    dmin: np.ndarray | None  # float16 like d: K-quants' dmin, minus a legacy type's m; None: no offsets
    mn: np.ndarray | None  # uint8 (N, G, runs): K-quants' sub-block minimums; None: 1
    middle: int  # the run's middle value, the offset's multiple of the scale (see the table above)


def scales_offsets(factors: Factors) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 (N, G, runs) scales and offsets (None: all 0) from the file's factors."""
    scale = factors.d.astype(np.float32)
    if factors.sc is not None:
        scale = scale * factors.sc.astype(np.float32)
    if factors.dmin is None:
        return scale, None
    low = factors.dmin.astype(np.float32)
    if factors.mn is not None:
        low = low * factors.mn.astype(np.float32)
    return scale, factors.middle * scale - low


class Runs(NamedTuple):
    """A weight as w[n, k] = scales[n, k // block_size] * values[n, k] + offsets[n, k // block_size]."""

    bits: int  # MatMulNBits bits: 4 or 8
    block_size: int  # 16 or 32
    values: np.ndarray  # int8 (N, K): centred, within [-2^(value_bits-1), 2^(value_bits-1))
    scales: np.ndarray  # float32 (N, K / block_size)
    offsets: np.ndarray | None  # float32 (N, K / block_size); None: all 0
    value_bits: int  # the type's own bits a value (5 for Q5_0), at most `bits`
    factors: Factors  # what scales and offsets are computed from


def _half(raw: np.ndarray) -> np.ndarray:
    """Two bytes per row (the last axis) as float16 (..., 1)."""
    return np.ascontiguousarray(raw).view(np.float16)


def _bits_of(raw: np.ndarray, count: int) -> np.ndarray:
    """(..., count / 8) bytes -> (..., count) bits, little end first (element j is bit j % 8 of byte j // 8)."""
    return np.unpackbits(raw, axis=-1, bitorder="little")[..., :count]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes of a 32-run -> (..., 32): element j in the low nibble of byte j, j + 16 in its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _legacy(kind: Q, blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q4_0 .. Q8_0: (values (B, 32), factors) for B blocks of 32; Q4_1 and Q5_1 keep -m as dmin."""
    d = _half(blocks[:, 0:2])  # (B, 1)
    plain = Factors(d, None, None, None, 0)
    if kind == Q.Q8_0:
        return blocks[:, 2:].view(np.int8), plain
    if kind == Q.Q4_0:
        return _nibbles(blocks[:, 2:18]).astype(np.int8) - 8, plain
    if kind == Q.Q4_1:
        return _nibbles(blocks[:, 4:20]).astype(np.int8) - 8, Factors(d, None, -_half(blocks[:, 2:4]), None, 8)
    start = 2 if kind == Q.Q5_0 else 4  # Q5_1 has m after d
    high = _bits_of(blocks[:, start : start + 4], 32)  # bit j of the 32-bit qh is element j's fifth bit
    q = _nibbles(blocks[:, start + 4 : start + 20]) | (high << 4)
    if kind == Q.Q5_0:
        return q.astype(np.int8) - 16, plain
    return q.astype(np.int8) - 16, Factors(d, None, -_half(blocks[:, 2:4]), None, 16)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 signed 6-bit run scales: the low 4 bits in bytes 0-7 (runs 0-7 low nibbles,
    8-15 high), the high 2 bits in bytes 8-11 (run r at bits 2 (r // 4) of byte 8 + r % 4)."""
    low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=-1)  # (B, 16)
    high = (packed[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)) & 0x03  # (B, 4 bytes, 4 shifts)
    high = high.transpose(0, 2, 1).reshape(-1, 16)  # run r = 4 * shift + byte
    return (low | (high << 4)).astype(np.int16) - 32


def _k_quant(kind: Q, blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q2_K .. Q6_K: (values (B, 256), factors) for B blocks of 256."""
    n = blocks.shape[0]
    if kind == Q.Q2_K:  # scales[16] | qs[64] | d | dmin
        sc, qs, d, dmin = blocks[:, :16], blocks[:, 16:80], _half(blocks[:, 80:82]), _half(blocks[:, 82:84])
        q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
        return q.reshape(n, 256).astype(np.int8) - 2, Factors(d, sc & 0x0F, dmin, sc >> 4, 2)
    if kind == Q.Q3_K:  # hmask[32] | qs[64] | scales[12] | d
        hmask, qs, d = blocks[:, :32], blocks[:, 32:96], _half(blocks[:, 108:110])
        low = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
        high = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01  # (B, 1, 8, 32)
        q = low.reshape(n, 256).astype(np.int8) - 4 * (1 - high.reshape(n, 256).astype(np.int8))  # set bit: no -4
        return q, Factors(d, _q3_k_scales(blocks[:, 96:108]).astype(np.int8), None, None, 0)
    if kind == Q.Q6_K:  # ql[128] | qh[64] | scales[16] int8 | d
        ql, qh, d = blocks[:, :128], blocks[:, 128:192], _half(blocks[:, 208:210])
        low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # (B, 2, 2, 64)
        high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
        q = low.reshape(n, 256) | (high.reshape(n, 256) << 4)
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
        return q.astype(np.int8) - 32, Factors(d, sc, None, None, 0)
    # Q4_K, Q5_K: d | dmin | scales[12] (6-bit scale and minimum of 8 runs of 32) | [qh[32]] | qs[128]
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # gguf-py's unpacking of the 12 scale bytes, (B, 8) each
    qs = blocks[:, -128:]
    q = ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(n, 256)
    middle = 8
    if kind == Q.Q5_K:
        high = (blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01  # (B, 8, 32)
        q, middle = q | (high.reshape(n, 256) << 4), 16
    return q.astype(np.int8) - middle, Factors(d, sc.astype(np.uint8), dmin, mn.astype(np.uint8), middle)


# type -> (bits, block_size) of the MatMulNBits blocks that hold it
LAYOUT = {
    Q.Q4_0: (4, 32),
    Q.Q4_1: (4, 32),
    Q.Q5_0: (8, 32),
    Q.Q5_1: (8, 32),
    Q.Q8_0: (8, 32),
    Q.Q2_K: (4, 16),
    Q.Q3_K: (4, 16),
    Q.Q4_K: (4, 32),
    Q.Q5_K: (8, 32),
    Q.Q6_K: (8, 16),
}
LAYOUT_NAMES = tuple(kind.name for kind in LAYOUT)  # "Q4_0", ...: the types kept as blocks
KEPT_TYPE_NAMES = LAYOUT_NAMES
# type -> the bits of its values (c above), which export/compact_blocks.py stores
VALUE_BITS = {
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q5_0: 5,
    Q.Q5_1: 5,
    Q.Q8_0: 8,
    Q.Q2_K: 2,
    Q.Q3_K: 3,
    Q.Q4_K: 4,
    Q.Q5_K: 5,
    Q.Q6_K: 6,
}


def to_runs(kind: Q, rows: np.ndarray, n_in: int) -> Runs | None:
    """A stored 2-D tensor (rows: uint8 (N, bytes per row)) as Runs; None for a type that has none (F32, F16,
    BF16: float already; the IQ and TQ families: their values come from a codebook, not from scale * c)."""
    if kind not in LAYOUT:
        return None
    bits, block_size = LAYOUT[kind]
    n_out = rows.shape[0]
    blocks = np.asarray(rows).reshape(-1, GGML_QUANT_SIZES[kind][1])  # (B, bytes per block)
    values, factors = _k_quant(kind, blocks) if kind in K_TYPES else _legacy(kind, blocks)
    factors = Factors(*(a.reshape(n_out, -1, a.shape[-1]) if isinstance(a, np.ndarray) else a for a in factors))
    scales, offsets = scales_offsets(factors)
    runs = n_in // block_size
    return Runs(
        bits,
        block_size,
        np.ascontiguousarray(values.reshape(n_out, n_in).astype(np.int8)),
        np.ascontiguousarray(scales.reshape(n_out, runs)),
        None if offsets is None else np.ascontiguousarray(offsets.reshape(n_out, runs)),
        VALUE_BITS[kind],
        factors,
    )


def by_rows(runs: Runs, change: Callable[[np.ndarray], np.ndarray]) -> Runs:
    """The runs with `change` (a reordering of the output rows) applied to each of their arrays."""
    either = lambda a: change(a) if isinstance(a, np.ndarray) else a
    factors = Factors(*map(either, runs.factors))
    return runs._replace(
        values=change(runs.values), scales=change(runs.scales), offsets=either(runs.offsets), factors=factors
    )


def widen(runs: Runs, bits: int, block_size: int) -> Runs:
    """The same weights in blocks of more bits and / or shorter runs: exact (a value fits a wider block; a
    run of 32 is two runs of 16 with its scale and offset)."""
    assert bits >= runs.bits and runs.block_size % block_size == 0, f"cannot narrow {runs.bits}/{runs.block_size}"
    factor = runs.block_size // block_size
    offsets = None if runs.offsets is None else np.repeat(runs.offsets, factor, axis=1)
    scales = np.repeat(runs.scales, factor, axis=1)
    return Runs(bits, block_size, runs.values, scales, offsets, runs.value_bits, _split_runs(runs.factors, factor))


def _split_runs(factors: Factors, factor: int) -> Factors:
    """Factors for runs `factor` times shorter: each run's factors repeated (a K-quant's super-block d and
    dmin stay as they are)."""
    if factor == 1:
        return factors
    repeat = lambda a: None if a is None else np.repeat(a, factor, axis=-1)
    if factors.sc is not None:
        return factors._replace(sc=repeat(factors.sc), mn=repeat(factors.mn))
    return factors._replace(d=repeat(factors.d), dmin=repeat(factors.dmin))


def dequantized(runs: Runs) -> np.ndarray:
    """float32 (N, K): what the blocks hold (for tests and error messages)."""
    n, k = runs.values.shape
    w = runs.values.reshape(n, -1, runs.block_size).astype(np.float32) * runs.scales[..., None]
    if runs.offsets is not None:
        w = w + runs.offsets[..., None]
    return w.reshape(n, k)


def pack(values: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """int8 (N, K) centred values -> MatMulNBits' B, uint8 (N, K / block_size, block_size * bits / 8): stored
    value + 2^(bits-1); 4 bits: element 2i in the low nibble of byte i, 2i + 1 in its high nibble."""
    n, k = values.shape
    stored = (values.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8).reshape(n, k // block_size, block_size)
    if bits == 8:
        return stored
    return (stored[..., 0::2] | (stored[..., 1::2] << 4)).astype(np.uint8)
