"""The fused graph's nodes on a GGUF file's kept quantized blocks (export/decoder.py NBits): a Linear that
carries them becomes a com.microsoft MatMulNBits node on them (plus a MatMul of x's block sums by the blocks'
offsets for Q4_1's w = d * q + m), its arrays written as MatMulNBits' own or, compact, as bit planes and factors
unpacked at load (export/compact_blocks.py); and an embedding table kept as blocks (the head's, when tied; Gemma
4's per-layer table) is a stand-in Gather rewired to gather rows of them (writers/nbits_gather.py), through
initializers of its own naming the head's bytes (SameBytes) where the head's pages should not stay resident.
Packed (runtime/packed.py): the file's rows as they are, an ai.edgelm MatMulPacked node on them (GatherPacked for the
embedding); the fallback graph beside it is the plain form with its block arrays named for the runtime to compute.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from edgelm.runtime.block_types import row_bytes
from edgelm.runtime.packed import DOMAIN, PACKED_TYPES
from edgelm.writers.nbits_gather import gather_from_nbits
from edgelm.writers.onnxfile import SameBytes, placeholder

from .compact_blocks import write_blocks
from .decoder import Decoder
from .graph_nodes import MS_DOMAIN, _Nodes
from .lazy_weights import LazyArray
from .linear import NBits


def _nbits_names(prefix: str, nbits: NBits) -> tuple[str, str, str | None]:
    """MatMulNBits' B and scales, and the block offsets (None: the blocks have none)."""
    offsets = f"{prefix}.weight_block_offsets" if nbits.has_offsets else None
    return f"{prefix}.weight_Q{nbits.bits}", f"{prefix}.weight_scales", offsets


SLICED_WEIGHTS = 1 << 25  # a kept table of more weights is unpacked and written this many (about) at a time


class _NBitsArrays:
    """A linear's MatMulNBits arrays from one unpacking of its blocks, which is let go once all `uses` are read."""

    def __init__(self, nbits: NBits, uses: int):
        self.nbits, self.uses, self.parts = nbits, uses, None

    def _take(self, array: str) -> np.ndarray:
        if self.parts is None:
            self.parts = self.nbits.parts
        value = getattr(NBits(self.nbits.bits, self.nbits.block_size, self.parts), array)
        self.uses -= 1
        if self.uses == 0:
            self.parts = None
        return value

    def packed(self) -> np.ndarray:
        return self._take("packed")

    def scales(self) -> np.ndarray:
        return self._take("scales")

    def block_offsets(self) -> np.ndarray:
        return self._take("block_offsets")


def packed_names(prefix: str, parts: list) -> list[str]:
    """The raw rows' initializers of a linear's parts (one per run of parts of one type)."""
    return [f"{prefix}.weight_packed" + (f"{i}" if len(parts) > 1 else "") for i in range(len(parts))]


class _BlockNodes(_Nodes):
    """MatMulNBits on kept blocks; the builder's accuracy_level and compact choose how. packed: the file's own rows
    under ai.edgelm MatMulPacked; fallback_plan (a dict): the plain arrays, recorded there as made from those rows,
    for the fallback graph (runtime/packed.py), never written."""

    packed = False
    fallback_plan: dict | None = None

    def _raw_parts(self, nbits: NBits) -> list | None:
        return nbits.raw_parts(PACKED_TYPES) if self.packed or self.fallback_plan is not None else None

    def packed_rows(self, prefix: str, nbits: NBits) -> list[tuple[str, int, int]]:
        """The raw rows of each part as initializers: (name, ggml type, rows)."""
        parts, k = self._raw_parts(nbits), nbits.shape[0]
        named = []
        for name, (kind, n, read) in zip(packed_names(prefix, parts), parts, strict=True):
            self.constant(name, LazyArray((n, row_bytes(kind, k)), read, np.uint8))
            named.append((name, kind, n))
        return named

    def matmul_packed(self, x: str, prefix: str, nbits: NBits, output: str) -> str:
        """x @ W on the file's rows: one MatMulPacked a part of one type, concatenated along the outputs."""
        k = nbits.shape[0]
        rows = self.packed_rows(prefix, nbits)
        products = []
        for i, (name, kind, n) in enumerate(rows):
            product = output if len(rows) == 1 else f"{output}/part{i}"
            node = helper.make_node(
                "MatMulPacked", [x, name], [product], name=product, domain=DOMAIN, packed_type=kind, N=n, K=k
            )
            self.nodes.append(node)
            products.append(self.float_output(product, ["batch_size", "sequence_length", n]))
        return output if len(products) == 1 else self.op("Concat", products, output, axis=-1)

    def _record_fallback(self, prefix: str, nbits: NBits, names: tuple[str, str, str | None]) -> None:
        parts = self._raw_parts(nbits)
        sources = [
            {"tensor": name, "type": kind, "rows": n}
            for name, (kind, n, _) in zip(packed_names(prefix, parts), parts, strict=True)
        ]
        for array, name in zip(("B", "scales", "offsets"), names, strict=True):
            if name is not None:
                self.fallback_plan[name] = {
                    "array": array, "bits": nbits.bits, "block_size": nbits.block_size, "k": nbits.shape[0],
                    "parts": sources,
                }  # fmt: skip

    def embedding_blocks(self, prefix: str, nbits: NBits) -> None:
        """An untied embedding's blocks: the file's rows (packed) or MatMulNBits' arrays."""
        if self.packed and self._raw_parts(nbits) is not None:
            self.packed_rows(prefix, nbits)
        else:
            self.nbits_weights(prefix, nbits)

    def nbits_weights(self, prefix: str, nbits: NBits) -> tuple[str, str, str | None]:
        """MatMulNBits' B and scales and the block offsets (None: none), as initializers or, compact, as the
        outputs of nodes that compute them from smaller ones."""
        packed, scales, offsets = _nbits_names(prefix, nbits)
        if self.fallback_plan is not None and self._raw_parts(nbits) is not None:
            self._record_fallback(prefix, nbits, (packed, scales, offsets))
        if self.compact:
            write_blocks(self, nbits, packed=packed, scales=scales, offsets=offsets)
        else:  # unpacked (or quantized) when written, once for the three arrays (save_model writes them in turn)
            k, n = nbits.shape
            runs = k // nbits.block_size
            arrays = _NBitsArrays(nbits, 3 if offsets is not None else 2)
            # a large table whose file rows are its own (Gemma 4's per-layer table: 2.3B weights) is unpacked and
            # written a slice of rows at a time; the offsets' (runs, N) layout is not in rows, so not with them
            sliced = offsets is None and nbits.by_rows and n * k > SLICED_WEIGHTS
            step = max(1, SLICED_WEIGHTS // k)

            def chunks(array: str):
                return (
                    (lambda: (getattr(nbits.rows(i, min(i + step, n)), array) for i in range(0, n, step)))
                    if sliced
                    else None
                )

            shape = (n, runs, nbits.block_size * nbits.bits // 8)
            self.constant(packed, LazyArray(shape, arrays.packed, np.uint8, chunks=chunks("packed")))
            self.constant(scales, LazyArray((n, runs), arrays.scales, chunks=chunks("scales")))
            if offsets is not None:
                self.constant(offsets, LazyArray((runs, n), arrays.block_offsets))
        return packed, scales, offsets

    def matmul_nbits(self, x: str, prefix: str, nbits: NBits, output: str) -> str:
        """x @ W on the blocks; with block offsets (Q4_1's w = d * q + m) the integer-zero-point product
        plus (block sums of x) @ offsets, which keeps ONNX Runtime on its fast kernels."""
        if self.packed and self._raw_parts(nbits) is not None:
            return self.matmul_packed(x, prefix, nbits, output)
        k, n = nbits.shape
        packed, scales, offsets = self.nbits_weights(prefix, nbits)
        product = output if offsets is None else f"{output}/blocks"
        self.nodes.append(
            helper.make_node(
                "MatMulNBits",
                [x, packed, scales],
                [product],
                name=product,
                domain=MS_DOMAIN,
                K=k,
                N=n,
                bits=nbits.bits,
                block_size=nbits.block_size,
                accuracy_level=self.accuracy_level,
            )
        )
        self.float_output(product, ["batch_size", "sequence_length", n])
        if offsets is None:
            return product
        split = np.array([0, 0, k // nbits.block_size, nbits.block_size], dtype=np.int64)
        shape = self.small_constant(f"{prefix}/block_shape", split)
        blocks = self.op("Reshape", [x, shape], f"{prefix}/Reshape")  # (B, S, K / block_size, block_size)
        axis = self.small_constant(f"{prefix}/block_axis", np.array([-1], dtype=np.int64))
        sums = self.op("ReduceSum", [blocks, axis], f"{prefix}/ReduceSum", keepdims=0)  # (B, S, K / block_size)
        correction = self.op("MatMul", [sums, offsets], f"{prefix}/offsets")  # (B, S, N)
        return self.op("Add", [product, correction], output)


def _gather_packed(model: onnx.ModelProto, node: str, rows: str, kind: int, k: int) -> None:
    """Rewire the stand-in Gather `node` (a tied table's columns then Transpose, or a table's rows) into one
    ai.edgelm GatherPacked on the raw rows `rows`."""
    graph = model.graph
    gather = next(n for n in graph.node if n.name == node)
    index = list(graph.node).index(gather)
    out = gather.output[0]
    if any(a.name == "axis" and a.i == 1 for a in gather.attribute):
        transpose = next(n for n in graph.node if n.input and n.input[0] == out and n.op_type == "Transpose")
        out = transpose.output[0]
        graph.node.remove(transpose)
    graph.node.remove(gather)
    packed = helper.make_node(
        "GatherPacked", [rows, gather.input[1]], [out], name=f"{node}/packed", domain=DOMAIN, packed_type=kind, K=k
    )
    graph.node.insert(index, packed)
    graph.value_info.append(
        helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, ["batch_size", "sequence_length", k])
    )


def _gather_embedding_blocks(
    model: onnx.ModelProto, d: Decoder, weights: dict, *, compact: bool, packed: bool = False
) -> None:
    """Rewire the embedding's stand-in Gather to gather rows of blocks (the head's, when tied), if there are any.
    Tied plain blocks are gathered through initializers of their own that point at the head's bytes (SameBytes):
    ONNX Runtime maps them apart from the ones MatMulNBits prepacks and lets go, so the head's pages need not stay
    resident for the few rows a step gathers (runtime/session.py drops them; compact blocks are computed at load,
    and the gather reads the computed tensors)."""
    table, prefix = (d.head_nbits, "lm_head") if d.tied else (d.embedding_nbits, "embed")
    parts = table.raw_parts(PACKED_TYPES) if packed and table is not None else None
    if parts is not None and len(parts) == 1:
        _gather_packed(model, "embed/Gather", packed_names(prefix, parts)[0], parts[0][0], table.shape[0])
    elif table is not None:
        _gather_blocks(model, "embed/Gather", prefix, table, weights if d.tied and not compact else None)


def _gather_blocks(model: onnx.ModelProto, node: str, prefix: str, table: NBits, weights: dict | None = None) -> None:
    """Rewire the stand-in Gather `node` to gather rows of the blocks written under `prefix`; with `weights`,
    through initializers of their own naming the same bytes (the tied head's, above)."""
    gather = next(n for n in model.graph.node if n.name == node)
    packed, scales, offsets = _nbits_names(prefix, table)  # offsets: (K / block, V)
    if weights is not None:
        for name in filter(None, (packed, scales, offsets)):
            model.graph.initializer.append(placeholder(f"{name}/rows", weights[name]))
            weights[f"{name}/rows"] = SameBytes(name)
        packed, scales, offsets = (None if name is None else f"{name}/rows" for name in (packed, scales, offsets))
    n_blocks = table.shape[0] // table.block_size
    gather_from_nbits(
        model, gather, packed, scales, bits=table.bits, block_size=table.block_size, n_blocks=n_blocks, offsets=offsets
    )
