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
values as bit planes of the row's `planes` widths. The unpacking of each type and the table's numbers live in
runtime/block_types.py (the runtime's fallback converts raw blocks with them); this table is derived from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from edgelm.runtime.block_types import FORMATS, Factors, scales_offsets
from edgelm.runtime.block_types import pack as pack  # export's modules import it from here

Q = GGMLQuantizationType


class Runs(NamedTuple):
    """A weight as w[n, k] = scales[n, k // block_size] * values[n, k] + offsets[n, k // block_size]."""

    bits: int  # MatMulNBits bits: 4 or 8
    block_size: int  # 16 or 32
    values: np.ndarray  # int8 (N, K): centred, within [-2^(value_bits-1), 2^(value_bits-1))
    scales: np.ndarray  # float32 (N, K / block_size)
    offsets: np.ndarray | None  # float32 (N, K / block_size); None: all 0
    value_bits: int  # the type's own bits a value (5 for Q5_0), at most `bits`
    factors: Factors  # what scales and offsets are computed from


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


BLOCK_TYPES: dict[Q, BlockType] = {  # the runtime's table of block types (runtime/block_types.py), by Q
    Q(row.number): BlockType(Q(row.number), row.bits, row.block_size, row.value_bits, row.unpack)
    for row in FORMATS.values()
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
    kind: int | None = None  # the file's ggml type of `raw`'s blocks
    raw: Callable[[], np.ndarray] | None = None  # the file's blocks, uint8 (N, row bytes) in Hugging Face row order

    def with_load(self, load: Callable[[], Runs], rows: Callable[[int, int], Runs] | None = None) -> LazyRuns:
        """The same weight read through `load` (the file's pages let go after, say); its raw blocks stay."""
        return LazyRuns(self.bits, self.block_size, self.shape, self.has_offsets, load, rows, self.kind, self.raw)

    def changed(self, load: Callable[[], Runs]) -> LazyRuns:
        """Runs that `load` computes differently from the file's rows (a family's reordering): no raw blocks."""
        return LazyRuns(self.bits, self.block_size, self.shape, self.has_offsets, load)


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

    def raw() -> np.ndarray:
        return np.asarray(rows) if change is None else np.ascontiguousarray(change(np.asarray(rows)))

    first = to_runs(kind, rows[:1], n_in)
    some = None if change is not None else lambda start, stop: to_runs(kind, rows[start:stop], n_in)
    shape = (rows.shape[0], n_in)
    return LazyRuns(row.bits, row.block_size, shape, first.offsets is not None, load, some, int(kind), raw)


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
