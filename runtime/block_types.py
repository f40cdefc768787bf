"""llama.cpp's block types as numpy knows them, for the runtime: one row per type (FORMATS, by ggml type number) with
its sizes, the MatMulNBits bits and block size that hold it exactly, and the function that unpacks its blocks into
centred integer values and the file's factors; MatMulNBits' arrays computed from them (`nbits_arrays`). Export's
table (export/gguf_blocks.py) is derived from this one; the runtime's fallback (runtime/packed.py) converts a
package's raw blocks with it where the native kernels (runtime/csrc/) cannot run. Each unpacker's docstring gives
the type's w, its c and its offset (s is the run's scale d * sc). Layouts:
https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h (block_q4_0 ... block_q6_K).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


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


def _half(raw: np.ndarray) -> np.ndarray:
    """Two bytes per row (the last axis) as float16 (..., 1)."""
    return np.ascontiguousarray(raw).view(np.float16)


def _bits_of(raw: np.ndarray, count: int) -> np.ndarray:
    """(..., count / 8) bytes -> (..., count) bits, little end first (element j is bit j % 8 of byte j // 8)."""
    return np.unpackbits(raw, axis=-1, bitorder="little")[..., :count]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes of a 32-run -> (..., 32): element j in the low nibble of byte j, j + 16 in its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q4_0, blocks of 32: w = d (q - 8); c = q - 8, no offset."""
    return _nibbles(blocks[:, 2:18]).astype(np.int8) - 8, Factors(_half(blocks[:, 0:2]), None, None, None, 0)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q4_1, blocks of 32: w = d q + m; c = q - 8, offset m + 8 d (-m kept as dmin)."""
    d, m = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:20]).astype(np.int8) - 8, Factors(d, None, -m, None, 8)


def _five_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0 / Q5_1's 32 values: the 32-bit qh at `start` (bit j is element j's fifth bit), then the nibbles."""
    high = _bits_of(blocks[:, start : start + 4], 32)
    return _nibbles(blocks[:, start + 4 : start + 20]) | (high << 4)


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q5_0, blocks of 32: w = d (q - 16); c = q - 16, no offset."""
    return _five_bits(blocks, 2).astype(np.int8) - 16, Factors(_half(blocks[:, 0:2]), None, None, None, 0)


def _q5_1(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q5_1, blocks of 32: w = d q + m; c = q - 16, offset m + 16 d (-m kept as dmin)."""
    d, m = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    return _five_bits(blocks, 4).astype(np.int8) - 16, Factors(d, None, -m, None, 16)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q8_0, blocks of 32: w = d q; c = q, no offset."""
    return blocks[:, 2:].view(np.int8), Factors(_half(blocks[:, 0:2]), None, None, None, 0)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 signed 6-bit run scales: the low 4 bits in bytes 0-7 (runs 0-7 low nibbles,
    8-15 high), the high 2 bits in bytes 8-11 (run r at bits 2 (r // 4) of byte 8 + r % 4)."""
    low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=-1)  # (B, 16)
    high = (packed[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)) & 0x03  # (B, 4 bytes, 4 shifts)
    high = high.transpose(0, 2, 1).reshape(-1, 16)  # run r = 4 * shift + byte
    return (low | (high << 4)).astype(np.int16) - 32


def _q2_k(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q2_K, super-blocks of 256, runs of 16: w = d sc q - dmin mn; c = q - 2, offset 2 s - dmin mn.
    Layout: scales[16] | qs[64] | d | dmin."""
    n = blocks.shape[0]
    sc, qs, d, dmin = blocks[:, :16], blocks[:, 16:80], _half(blocks[:, 80:82]), _half(blocks[:, 82:84])
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
    return q.reshape(n, 256).astype(np.int8) - 2, Factors(d, sc & 0x0F, dmin, sc >> 4, 2)


def _q3_k(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q3_K, super-blocks of 256, runs of 16: w = d (sc - 32) q; c = q (-4 .. 3), no offset.
    Layout: hmask[32] | qs[64] | scales[12] | d."""
    n = blocks.shape[0]
    hmask, qs, d = blocks[:, :32], blocks[:, 32:96], _half(blocks[:, 108:110])
    low = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
    high = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01  # (B, 1, 8, 32)
    q = low.reshape(n, 256).astype(np.int8) - 4 * (1 - high.reshape(n, 256).astype(np.int8))  # set bit: no -4
    return q, Factors(d, _q3_k_scales(blocks[:, 96:108]).astype(np.int8), None, None, 0)


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit run scales and 8 minimums: runs 0-3 in the low 6 bits of bytes 0-3
    (scales) and 4-7 (minimums); runs 4-7 in the nibbles of bytes 8-11 (low: scale, high: minimum) with their top
    two bits in the top bits of bytes 0-3 (scales) and 4-7 (minimums)."""
    d, m, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _q4_k_q5_k(blocks: np.ndarray, *, five: bool) -> tuple[np.ndarray, Factors]:
    """Q4_K / Q5_K: d | dmin | scales[12] (6-bit scale and minimum of 8 runs of 32) | [qh[32]] | qs[128]."""
    n = blocks.shape[0]
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])  # (B, 8) each
    qs = blocks[:, -128:]
    q = ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(n, 256)
    middle = 8
    if five:
        high = (blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01  # (B, 8, 32)
        q, middle = q | (high.reshape(n, 256) << 4), 16
    return q.astype(np.int8) - middle, Factors(d, sc.astype(np.uint8), dmin, mn.astype(np.uint8), middle)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q4_K, super-blocks of 256, runs of 32: w = d sc q - dmin mn; c = q - 8, offset 8 s - dmin mn."""
    return _q4_k_q5_k(blocks, five=False)


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q5_K, super-blocks of 256, runs of 32: w = d sc q - dmin mn; c = q - 16, offset 16 s - dmin mn."""
    return _q4_k_q5_k(blocks, five=True)


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, Factors]:
    """Q6_K, super-blocks of 256, runs of 16: w = d sc (q - 32); c = q - 32, no offset.
    Layout: ql[128] | qh[64] | scales[16] int8 | d."""
    n = blocks.shape[0]
    ql, qh, d = blocks[:, :128], blocks[:, 128:192], _half(blocks[:, 208:210])
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # (B, 2, 2, 64)
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # (B, 2, 4, 32)
    q = low.reshape(n, 256) | (high.reshape(n, 256) << 4)
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
    return q.astype(np.int8) - 32, Factors(d, sc, None, None, 0)


@dataclass(frozen=True)
class BlockFormat:
    """One llama.cpp block type: its ggml number and sizes, and how MatMulNBits holds it."""

    number: int  # ggml_type
    name: str
    elems: int  # weights a block
    bytes: int  # bytes a block
    bits: int  # MatMulNBits bits that hold its values: 4 or 8
    block_size: int  # MatMulNBits block size: the type's run of one scale, 16 or 32
    value_bits: int  # the bits of its values c, at most `bits` (5 for Q5_0)
    unpack: Callable[[np.ndarray], tuple[np.ndarray, Factors]]  # uint8 (B, bytes) -> int8 values (B, elems), factors


FORMATS: dict[int, BlockFormat] = {
    row.number: row
    for row in (
        BlockFormat(2, "Q4_0", 32, 18, bits=4, block_size=32, value_bits=4, unpack=_q4_0),
        BlockFormat(3, "Q4_1", 32, 20, bits=4, block_size=32, value_bits=4, unpack=_q4_1),
        BlockFormat(6, "Q5_0", 32, 22, bits=8, block_size=32, value_bits=5, unpack=_q5_0),
        BlockFormat(7, "Q5_1", 32, 24, bits=8, block_size=32, value_bits=5, unpack=_q5_1),
        BlockFormat(8, "Q8_0", 32, 34, bits=8, block_size=32, value_bits=8, unpack=_q8_0),
        BlockFormat(10, "Q2_K", 256, 84, bits=4, block_size=16, value_bits=2, unpack=_q2_k),
        BlockFormat(11, "Q3_K", 256, 110, bits=4, block_size=16, value_bits=3, unpack=_q3_k),
        BlockFormat(12, "Q4_K", 256, 144, bits=4, block_size=32, value_bits=4, unpack=_q4_k),
        BlockFormat(13, "Q5_K", 256, 176, bits=8, block_size=32, value_bits=5, unpack=_q5_k),
        BlockFormat(14, "Q6_K", 256, 210, bits=8, block_size=16, value_bits=6, unpack=_q6_k),
    )
}


def row_bytes(number: int, k: int) -> int:
    """Bytes of a row of k weights of ggml type `number`."""
    row = FORMATS[number]
    assert k % row.elems == 0, f"{row.name} rows hold multiples of {row.elems} weights, not {k}"
    return k // row.elems * row.bytes


def unpacked(number: int, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw rows uint8 (N, row bytes) -> int8 centred values (N, K), float32 scales and offsets (N, K / run; None: no
    offsets) in the type's own runs (its MatMulNBits block size)."""
    row = FORMATS[number]
    n = rows.shape[0]
    values, factors = row.unpack(np.ascontiguousarray(rows).reshape(-1, row.bytes))
    factors = Factors(*(a.reshape(n, -1, a.shape[-1]) if isinstance(a, np.ndarray) else a for a in factors))
    scales, offsets = scales_offsets(factors)
    runs = k // row.block_size
    return (
        np.ascontiguousarray(values.reshape(n, k).astype(np.int8)),
        np.ascontiguousarray(scales.reshape(n, runs)),
        None if offsets is None else np.ascontiguousarray(offsets.reshape(n, runs)),
    )


def pack(values: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """int8 (N, K) centred values -> MatMulNBits' B, uint8 (N, K / block_size, block_size * bits / 8): stored
    value + 2^(bits-1); 4 bits: element 2i in the low nibble of byte i, 2i + 1 in its high nibble."""
    n, k = values.shape
    stored = (values.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8).reshape(n, k // block_size, block_size)
    if bits == 8:
        return stored
    return (stored[..., 0::2] | (stored[..., 1::2] << 4)).astype(np.uint8)
