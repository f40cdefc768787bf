"""The weights as the fused graph builder takes them (export/graph.py): a Linear in MatMul layout (a float weight,
or a GGUF file's own quantized blocks as NBits, for com.microsoft MatMulNBits) and a Norm. Every part of a Decoder
(export/decoder.py) and every mechanism (export/mechanisms/) is made of these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .gguf_blocks import LazyRuns, Runs, load_runs, pack, runs_have_offsets, runs_shape, widen


@dataclass
class NBits:
    """A weight kept in ONNX Runtime's MatMulNBits blocks (com.microsoft): W[k, n] = (q - 2^(bits - 1)) * scale +
    offset for the block of `block_size` consecutive k in column n, from a GGUF file's own quantized blocks
    (export/gguf_blocks.py), part after part along the outputs (Q, K and V of a packed linear), unpacked only
    when the graph writes them (export/gguf_blocks.py LazyRuns). The graph
    writes them compactly (export/compact_blocks.py) or as the arrays below, and adds the offsets as (block
    sums of x) @ block_offsets beside the MatMulNBits node."""

    bits: int  # 4 or 8
    block_size: int  # 16 or 32
    sources: list[Runs | LazyRuns]  # along the outputs; a LazyRuns is unpacked from its file when `parts` is read

    @property
    def parts(self) -> list[Runs]:
        """The parts in these bits and block size, unpacked now (each read makes them anew: the graph reads
        them once, when it writes this linear, and lets them go)."""
        return [widen(load_runs(part), self.bits, self.block_size) for part in self.sources]

    @property
    def by_rows(self) -> bool:
        """Whether `rows` can unpack some output rows alone: one part, from a file whose rows are the weight's."""
        return len(self.sources) == 1 and isinstance(self.sources[0], LazyRuns) and self.sources[0].rows is not None

    def rows(self, start: int, stop: int) -> NBits:
        """Output rows [start, stop) alone (by_rows must hold): what writes a large table a slice at a time."""
        return NBits(self.bits, self.block_size, [self.sources[0].rows(start, stop)])

    def raw_parts(self, kinds: tuple[int, ...]) -> list[tuple[int, int, Callable[[], np.ndarray]]] | None:
        """The file's own blocks along the outputs as (ggml type, rows, read: uint8 (rows, row bytes)), neighbouring
        parts of one type joined; None unless every part has them, of a type in `kinds` (runtime/packed.py)."""
        if not all(isinstance(p, LazyRuns) and p.raw is not None and p.kind in kinds for p in self.sources):
            return None
        groups: list[tuple[int, list[LazyRuns]]] = []
        for part in self.sources:
            if groups and groups[-1][0] == part.kind:
                groups[-1][1].append(part)
            else:
                groups.append((part.kind, [part]))

        def read(parts: list[LazyRuns]) -> Callable[[], np.ndarray]:
            return parts[0].raw if len(parts) == 1 else lambda: np.concatenate([p.raw() for p in parts])

        return [(kind, sum(p.shape[0] for p in parts), read(parts)) for kind, parts in groups]

    @property
    def shape(self) -> tuple[int, int]:
        """(in, out), as a Linear's weight."""
        shapes = [runs_shape(part) for part in self.sources]
        return shapes[0][1], sum(n for n, _ in shapes)

    @property
    def has_offsets(self) -> bool:
        return any(runs_have_offsets(part) for part in self.sources)

    @property
    def packed(self) -> np.ndarray:
        """MatMulNBits' B: uint8 (N, K / block_size, block_size * bits / 8), out features first."""
        return pack(np.concatenate([part.values for part in self.parts]), self.bits, self.block_size)

    @property
    def scales(self) -> np.ndarray:
        """float32 (N, K / block_size)."""
        return np.concatenate([part.scales for part in self.parts])

    @property
    def block_offsets(self) -> np.ndarray | None:
        """float32 (K / block_size, N): the types' minimums (0 for a part without them); None: all 0."""
        if not self.has_offsets:
            return None
        pieces = [part.offsets if part.offsets is not None else np.zeros_like(part.scales) for part in self.parts]
        return np.ascontiguousarray(np.concatenate(pieces).T)


@dataclass
class Linear:
    weight: np.ndarray | None  # (in, out): MatMul's layout, the transpose of nn.Linear's; None when nbits is set
    bias: np.ndarray | None = None  # (out,)
    nbits: NBits | None = None  # set: the graph multiplies by these blocks (MatMulNBits), not a float weight
    lora: tuple[str, str] | None = None  # a LoRA slot: the graph adds x @ A @ B, A and B inputs named so

    def __post_init__(self) -> None:
        assert (self.weight is None) != (self.nbits is None), "a Linear has a float weight or nbits blocks"


@dataclass
class Norm:
    weight: np.ndarray  # (C,)
    bias: np.ndarray | None = None  # (C,); None for RMSNorm
