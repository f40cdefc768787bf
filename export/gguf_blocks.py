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
are centred on the run's middle value, so its two terms cancel less than d q and m would. Layouts:
https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h (block_q4_0 ... block_q6_K).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

Q = GGMLQuantizationType
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


class Runs(NamedTuple):
    """A weight as w[n, k] = scales[n, k // block_size] * values[n, k] + offsets[n, k // block_size]."""

    bits: int  # MatMulNBits bits: 4 or 8
    block_size: int  # 16 or 32
    values: np.ndarray  # int8 (N, K): centred, within [-2^(bits-1), 2^(bits-1))
    scales: np.ndarray  # float32 (N, K / block_size)
    offsets: np.ndarray | None  # float32 (N, K / block_size); None: all 0


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per row (the last axis) as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _bits_of(raw: np.ndarray, count: int) -> np.ndarray:
    """(..., count / 8) bytes -> (..., count) bits, little end first (element j is bit j % 8 of byte j // 8)."""
    return np.unpackbits(raw, axis=-1, bitorder="little")[..., :count]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes of a 32-run -> (..., 32): element j in the low nibble of byte j, j + 16 in its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _legacy(kind: Q, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q4_0 .. Q8_0: (values (B, 32), scales (B, 1), offsets (B, 1) or None) for B blocks of 32."""
    d = _f16(blocks[:, 0:2])[:, None]
    if kind == Q.Q8_0:
        return blocks[:, 2:].view(np.int8), d, None
    if kind == Q.Q4_0:
        return _nibbles(blocks[:, 2:18]).astype(np.int8) - 8, d, None
    if kind == Q.Q4_1:
        return _nibbles(blocks[:, 4:20]).astype(np.int8) - 8, d, _f16(blocks[:, 2:4])[:, None] + 8 * d
    start = 2 if kind == Q.Q5_0 else 4  # Q5_1 has m after d
    high = _bits_of(blocks[:, start : start + 4], 32)  # bit j of the 32-bit qh is element j's fifth bit
    q = _nibbles(blocks[:, start + 4 : start + 20]) | (high << 4)
    if kind == Q.Q5_0:
        return q.astype(np.int8) - 16, d, None
    return q.astype(np.int8) - 16, d, _f16(blocks[:, 2:4])[:, None] + 16 * d


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 signed 6-bit run scales: the low 4 bits in bytes 0-7 (runs 0-7 low nibbles,
    8-15 high), the high 2 bits in bytes 8-11 (run r at bits 2 (r // 4) of byte 8 + r % 4)."""
    low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=-1)  # (B, 16)
    high = (packed[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)) & 0x03  # (B, 4 bytes, 4 shifts)
    high = high.transpose(0, 2, 1).reshape(-1, 16)  # run r = 4 * shift + byte
    return (low | (high << 4)).astype(np.int16) - 32


def _k_quant(kind: Q, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q2_K .. Q6_K: (values (B, 256), run scales (B, runs), run offsets (B, runs) or None) for B blocks of 256."""
    n = blocks.shape[0]
    if kind == Q.Q2_K:  # scales[16] | qs[64] | d | dmin
        sc, qs, d, dmin = blocks[:, :16], blocks[:, 16:80], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
        scale = d[:, None] * (sc & 0x0F).astype(np.float32)  # (B, 16)
        return q.reshape(n, 256).astype(np.int8) - 2, scale, 2 * scale - dmin[:, None] * (sc >> 4).astype(np.float32)
    if kind == Q.Q3_K:  # hmask[32] | qs[64] | scales[12] | d
        hmask, qs, d = blocks[:, :32], blocks[:, 32:96], _f16(blocks[:, 108:110])
        low = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
        high = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01  # (B, 1, 8, 32)
        q = low.reshape(n, 256).astype(np.int8) - 4 * (1 - high.reshape(n, 256).astype(np.int8))  # set bit: no -4
        return q, d[:, None] * _q3_k_scales(blocks[:, 96:108]).astype(np.float32), None
    if kind == Q.Q6_K:  # ql[128] | qh[64] | scales[16] int8 | d
        ql, qh, d = blocks[:, :128], blocks[:, 128:192], _f16(blocks[:, 208:210])
        low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # (B, 2, 2, 64)
        high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
        q = low.reshape(n, 256) | (high.reshape(n, 256) << 4)
        return q.astype(np.int8) - 32, d[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32), None
    # Q4_K, Q5_K: d | dmin | scales[12] (6-bit scale and minimum of 8 runs of 32) | [qh[32]] | qs[128]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # gguf-py's unpacking of the 12 scale bytes, (B, 8) each
    qs = blocks[:, -128:]
    q = ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(n, 256)
    middle = 8
    if kind == Q.Q5_K:
        high = (blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01  # (B, 8, 32)
        q, middle = q | (high.reshape(n, 256) << 4), 16
    scale = d[:, None] * sc.astype(np.float32)
    return q.astype(np.int8) - middle, scale, middle * scale - dmin[:, None] * mn.astype(np.float32)


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


def to_runs(kind: Q, rows: np.ndarray, n_in: int) -> Runs | None:
    """A stored 2-D tensor (rows: uint8 (N, bytes per row)) as Runs; None for a type that has none (F32, F16,
    BF16: float already; the IQ and TQ families: their values come from a codebook, not from scale * c)."""
    if kind not in LAYOUT:
        return None
    bits, block_size = LAYOUT[kind]
    n_out = rows.shape[0]
    blocks = np.asarray(rows).reshape(-1, GGML_QUANT_SIZES[kind][1])  # (B, bytes per block)
    values, scales, offsets = _k_quant(kind, blocks) if kind in K_TYPES else _legacy(kind, blocks)
    runs = n_in // block_size
    return Runs(
        bits,
        block_size,
        np.ascontiguousarray(values.reshape(n_out, n_in).astype(np.int8)),
        np.ascontiguousarray(scales.reshape(n_out, runs), dtype=np.float32),
        None if offsets is None else np.ascontiguousarray(offsets.reshape(n_out, runs), dtype=np.float32),
    )


def widen(runs: Runs, bits: int, block_size: int) -> Runs:
    """The same weights in blocks of more bits and / or shorter runs: exact (a value fits a wider block; a
    run of 32 is two runs of 16 with its scale and offset)."""
    assert bits >= runs.bits and runs.block_size % block_size == 0, f"cannot narrow {runs.bits}/{runs.block_size}"
    factor = runs.block_size // block_size
    offsets = None if runs.offsets is None else np.repeat(runs.offsets, factor, axis=1)
    return Runs(bits, block_size, runs.values, np.repeat(runs.scales, factor, axis=1), offsets)


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
