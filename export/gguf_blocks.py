"""llama.cpp's quantized blocks as ONNX Runtime MatMulNBits blocks, without requantizing; BLOCK_TYPES has one
row per block type, and every list of types (those kept, those read, the CLI's help) is derived from it.

Every block type llama.cpp's presets write stores a weight as w = scale * c + offset over short runs of
consecutive inputs, with c a small integer. MatMulNBits (com.microsoft, 4 or 8 bits, block_size a power of
two >= 16) computes w = (q - zero_point) * scale per block, so each type maps onto it exactly: its row gives
the MatMulNBits bits and block size that hold it, the bits of its values c, and the function that unpacks a
block (whose docstring gives the type's w, its c and its offset; s is the run's scale d * sc). The stored
value is c + 2^(bits - 1), so the zero point is always MatMulNBits' default and the graph needs no
zero-point input; the offset is added beside the node as (block sums of x) @ offsets (export/graph.py).
5- and 6-bit values take 8-bit blocks; 2- and 3-bit values 4-bit ones. Offsets are centred on the run's
middle value, so its two terms cancel less than d q and m would. Each type also keeps the numbers its scales
and offsets come from (`Factors`), which export/compact_blocks.py stores instead of the float32 results, its
values as bit planes of the row's `planes` widths. Layouts:
https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h (block_q4_0 ... block_q6_K).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

Q = GGMLQuantizationType


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


def _q4_k_q5_k(blocks: np.ndarray, *, five: bool) -> tuple[np.ndarray, Factors]:
    """Q4_K / Q5_K: d | dmin | scales[12] (6-bit scale and minimum of 8 runs of 32) | [qh[32]] | qs[128]."""
    n = blocks.shape[0]
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # gguf-py's unpacking of the 12 scale bytes, (B, 8) each
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
class BlockType:
    """One llama.cpp block type kept as MatMulNBits blocks."""

    kind: Q
    bits: int  # MatMulNBits bits that hold its values: 4 or 8
    block_size: int  # MatMulNBits block size: the type's run of one scale, 16 or 32
    value_bits: int  # the bits of its values c, at most `bits` (5 for Q5_0)
    unpack: Callable[[np.ndarray], tuple[np.ndarray, Factors]]  # uint8 (B, bytes a block) -> int8 values, factors

    @property
    def planes(self) -> tuple[int, ...]:
        """export/compact_blocks.py's bit planes of a value, widest (lowest bits) first: its bits in powers of
        two, so each plane packs whole bytes (5 bits: 4 + 1; 6: 4 + 2; 3: 2 + 1)."""
        return tuple(1 << i for i in reversed(range(4)) if self.value_bits >> i & 1)


BLOCK_TYPES: dict[Q, BlockType] = {
    row.kind: row
    for row in (
        BlockType(Q.Q4_0, bits=4, block_size=32, value_bits=4, unpack=_q4_0),
        BlockType(Q.Q4_1, bits=4, block_size=32, value_bits=4, unpack=_q4_1),
        BlockType(Q.Q5_0, bits=8, block_size=32, value_bits=5, unpack=_q5_0),
        BlockType(Q.Q5_1, bits=8, block_size=32, value_bits=5, unpack=_q5_1),
        BlockType(Q.Q8_0, bits=8, block_size=32, value_bits=8, unpack=_q8_0),
        BlockType(Q.Q2_K, bits=4, block_size=16, value_bits=2, unpack=_q2_k),
        BlockType(Q.Q3_K, bits=4, block_size=16, value_bits=3, unpack=_q3_k),
        BlockType(Q.Q4_K, bits=4, block_size=32, value_bits=4, unpack=_q4_k),
        BlockType(Q.Q5_K, bits=8, block_size=32, value_bits=5, unpack=_q5_k),
        BlockType(Q.Q6_K, bits=8, block_size=16, value_bits=6, unpack=_q6_k),
    )
}
KEPT_TYPE_NAMES = tuple(kind.name for kind in BLOCK_TYPES)  # "Q4_0", ...: the types kept as blocks
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# codebook types (the IQ and TQ families): read, dequantized by gguf-py, but with no exact MatMulNBits form
CODEBOOK_TYPES = tuple(kind for kind in Q if kind.name.startswith(("IQ", "TQ")))
SUPPORTED_TYPES = frozenset((*FLOAT_TYPES, *BLOCK_TYPES, *CODEBOOK_TYPES))  # what export/gguf.py reads


def to_runs(kind: Q, rows: np.ndarray, n_in: int) -> Runs | None:
    """A stored 2-D tensor (rows: uint8 (N, bytes per row)) as Runs; None for a type that has none (F32, F16,
    BF16: float already; the IQ and TQ families: their values come from a codebook, not from scale * c)."""
    row = BLOCK_TYPES.get(kind)
    if row is None:
        return None
    bits, block_size = row.bits, row.block_size
    n_out = rows.shape[0]
    blocks = np.asarray(rows).reshape(-1, GGML_QUANT_SIZES[kind][1])  # (B, bytes per block)
    values, factors = row.unpack(blocks)
    factors = Factors(*(a.reshape(n_out, -1, a.shape[-1]) if isinstance(a, np.ndarray) else a for a in factors))
    scales, offsets = scales_offsets(factors)
    runs = n_in // block_size
    return Runs(
        bits,
        block_size,
        np.ascontiguousarray(values.reshape(n_out, n_in).astype(np.int8)),
        np.ascontiguousarray(scales.reshape(n_out, runs)),
        None if offsets is None else np.ascontiguousarray(offsets.reshape(n_out, runs)),
        row.value_bits,
        factors,
    )


@dataclass(frozen=True)
class LazyRuns:
    """A weight's Runs before they are unpacked: what the graph needs to plan for them (bits, block size, shape,
    whether they have offsets) and `load()`, which unpacks them from the file when the graph writes them."""

    bits: int
    block_size: int
    shape: tuple[int, int]  # (N, K)
    has_offsets: bool
    load: Callable[[], Runs]
    rows: Callable[[int, int], Runs] | None = None  # output rows [start, stop) alone; None: only the whole

    def with_load(self, load: Callable[[], Runs], rows: Callable[[int, int], Runs] | None = None) -> LazyRuns:
        return LazyRuns(self.bits, self.block_size, self.shape, self.has_offsets, load, rows)


def lazy_runs(
    kind: Q, rows: np.ndarray, n_in: int, change: Callable[[np.ndarray], np.ndarray] | None
) -> LazyRuns | None:
    """to_runs of a stored tensor, deferred (`change`: a reordering of the output rows, by_rows); None where
    to_runs gives None. Whether the type has offsets is read off its first block."""
    row = BLOCK_TYPES.get(kind)
    if row is None:
        return None

    def load() -> Runs:
        runs = to_runs(kind, rows, n_in)
        return runs if change is None else by_rows(runs, change)

    first = to_runs(kind, rows[:1], n_in)
    some = None if change is not None else lambda start, stop: to_runs(kind, rows[start:stop], n_in)
    return LazyRuns(row.bits, row.block_size, (rows.shape[0], n_in), first.offsets is not None, load, some)


def load_runs(runs: Runs | LazyRuns) -> Runs:
    return runs.load() if isinstance(runs, LazyRuns) else runs


def runs_shape(runs: Runs | LazyRuns) -> tuple[int, int]:
    return runs.shape if isinstance(runs, LazyRuns) else runs.values.shape


def runs_have_offsets(runs: Runs | LazyRuns) -> bool:
    return runs.has_offsets if isinstance(runs, LazyRuns) else runs.offsets is not None


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
