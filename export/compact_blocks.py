"""A kept GGUF weight stored about as compactly as the file holds it, and unpacked by ONNX Runtime at load.

ONNX Runtime's MatMulNBits has 4- and 8-bit kernels only, so a Q5_0 or Q6_K value takes a byte of its B input
and every run's scale a float32 (export/gguf_blocks.py). On disk the package keeps instead

- the values as bit planes of their own width (5 bits: a 4-bit and a 1-bit plane; 6: 4 + 2; 3: 2 + 1; 2, 4
  and 8: one plane), and
- the scales and offsets as the file's own factors: float16 d and dmin, integer sub-block sc and mn,

and the graph computes B, the float32 scales and the offsets from them: uint8 BitShift, Mod, Gather, Add and
Reshape; float Cast, Mul and Sub. Every input of those nodes is constant, so ONNX Runtime's constant
folding (graph optimization level "basic" and above) replaces each chain by the one initializer it computes,
before MatMulNBits prepacks it: the session runs the same graph as a package with plain blocks, bit for bit
(tests/export/test_compact_blocks.py). The float arithmetic is gguf_blocks.scales_offsets', in its order.

Plane layout. A value u = c + 2^(value_bits-1), made unsigned, is stored in B as u + 2^(bits-1) -
2^(value_bits-1). A plane holds `width` bits of u from bit `offset` on, 8 / width values a byte in row-major
order (value j of a byte at bit j * width). Unpacked: a 4-bit plane (the low bits of 5- and 6-bit values in
8-bit blocks) by a shift and a modulo; a 1- or 2-bit plane by a Gather from a 256-row table that gives each
byte's B bytes with its bits already at their offset (low and high nibble for 4-bit blocks) and the constant
added; the planes are added (their bits are disjoint) and reshaped to B. Opset-14 operators only.

Memory at load: ONNX Runtime keeps every tensor its constant folding makes until the pass ends, so each step
of a chain holds a copy of B (the shift, modulo, Cast, Gather, Add and Reshape: about 5.5 times B for a 5-bit
value); docs/results.md has what that costs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
from onnx import TensorProto

from .gguf_blocks import BLOCK_TYPES, Runs, pack
from .linear import NBits

# a value's bits -> its planes' widths, low bits first (a width divides 8, so a plane packs whole bytes)
PLANES = {row.value_bits: row.planes for row in BLOCK_TYPES.values()}


class WeightNodes(Protocol):
    """What the unpacking is written into (export/graph.py's builder): initializers and nodes of constants only."""

    def constant(self, name: str, array: np.ndarray) -> str:
        """An initializer named `name`; returns the name."""

    def weight_op(self, op_type: str, inputs: list[str], output: str, **attributes) -> str:
        """A node of constants only, which ONNX Runtime folds at load; returns its output's name."""


class Plane(NamedTuple):
    offset: int  # the bit of u its lowest bit is
    width: int  # its bits a value: 1, 2 or 4
    packed: np.ndarray  # uint8 (M,): 8 / width values a byte, in order, value j of a byte at bit j * width


def bit_planes(values: np.ndarray, *, value_bits: int) -> list[Plane]:
    """int8 (N, K) centred values of `value_bits` bits -> their planes, values in row-major order."""
    u = (values.astype(np.int16) + (1 << (value_bits - 1))).astype(np.uint8).reshape(-1)  # (N K,)
    planes, offset = [], 0
    for width in PLANES[value_bits]:
        part = ((u >> offset) & ((1 << width) - 1)).reshape(-1, 8 // width)  # (M, values a byte)
        packed = np.bitwise_or.reduce(part << (np.arange(8 // width, dtype=np.uint8) * width), axis=1)
        planes.append(Plane(offset, width, packed))
        offset += width
    return planes


def plane_table(plane: Plane, *, bits: int, zero_point: int) -> np.ndarray:
    """uint8 (256, B bytes a plane byte): what each byte of the plane adds to the B bytes it covers, its
    values' bits at their offset (in the low and high nibbles for 4-bit blocks), plus `zero_point` each."""
    fields, mask = 8 // bits, (1 << plane.width) - 1
    byte = np.arange(256, dtype=np.int64)[:, None, None]
    value = np.arange(8 // plane.width).reshape(-1, fields)[None]  # (1, B bytes, fields): the byte's values
    bits_in = ((byte >> (value * plane.width)) & mask) << (plane.offset + np.arange(fields) * bits)
    return (bits_in.sum(axis=-1) + zero_point * (0x11 if bits == 4 else 1)).astype(np.uint8)


def _unpacked(g: WeightNodes, name: str, plane: Plane, *, slots: list[int], bits: int, zero_point: int) -> str:
    """The B bytes' share of one plane, (*slots, 2, ..., 2), one 2 for each doubling of the B bytes a plane byte
    makes: a 4-bit plane (two B bytes a byte) by shift and modulo, a narrower one by a lookup table that also
    places the bits and adds `zero_point` (the tables take an int32 copy of the plane's bytes, a quarter of the
    size of the shift's output)."""
    if plane.width == 4:
        assert bits == 8 and plane.offset == 0 and zero_point == 0, "a 4-bit plane is the low one, in 8-bit blocks"
        stored = g.constant(name, plane.packed.reshape(*slots, 1))
        shifts = g.constant(f"{name}/shifts", np.array([0, 4], dtype=np.uint8))
        shifted = g.weight_op("BitShift", [stored, shifts], f"{name}/shifted", direction="RIGHT")
        return g.weight_op("Mod", [shifted, g.constant(f"{name}/size", np.array(16, np.uint8))], f"{name}/values")
    table = plane_table(plane, bits=bits, zero_point=zero_point)  # (256, B bytes a plane byte)
    table = g.constant(f"{name}/table", table.reshape(256, *[2] * (table.shape[1].bit_length() - 1)))
    stored = g.constant(name, plane.packed.reshape(slots))
    index = g.weight_op("Cast", [stored], f"{name}/index", to=TensorProto.INT32)
    return g.weight_op("Gather", [table, index], f"{name}/values", axis=0)


def _part_values(g: WeightNodes, output: str, part: Runs) -> None:
    """B's rows of one part (uint8 (N_part, K / block_size, blob)) as `output`: B itself where the values fill
    its bits, else computed from their bit planes. Every tensor ONNX Runtime folds at load stays in memory until
    constant folding ends, so each step costs a copy of B: this takes as few steps as it can."""
    n, k = part.values.shape
    bits = part.bits
    if part.value_bits == bits:  # 4-bit values in 4-bit blocks, Q8_0's in 8-bit ones: B's own bytes
        g.constant(output, pack(part.values, bits, part.block_size))
        return
    planes = bit_planes(part.values, value_bits=part.value_bits)
    zero_point = (1 << (bits - 1)) - (1 << (part.value_bits - 1))  # B holds u + this
    covers = [bits // plane.width for plane in planes]  # B bytes a plane byte makes
    group = max(covers)  # every plane unpacks to (B bytes / group, 2, ..., 2): added without reshaping
    depth = group.bit_length() - 1
    value = None
    for plane, cover in zip(planes, covers, strict=True):
        name = f"{output}/plane{plane.offset}"
        slots = [plane.packed.size * cover // group] + [2] * (depth - (cover.bit_length() - 1))
        piece = _unpacked(g, name, plane, slots=slots, bits=bits, zero_point=zero_point if plane.width < 4 else 0)
        if plane.width < 4:
            zero_point = 0  # added once
        value = piece if value is None else g.weight_op("Add", [value, piece], f"{name}/sum")  # disjoint bits
    if zero_point:  # no table took it
        value = g.weight_op(
            "Add", [value, g.constant(f"{output}/zero_point", np.array(zero_point, np.uint8))], f"{output}/stored"
        )
    shape = g.constant(f"{output}/shape", np.array([n, k // part.block_size, -1], dtype=np.int64))
    g.weight_op("Reshape", [value, shape], output)


def _float(g: WeightNodes, name: str, array: np.ndarray) -> str:
    """A float16 or integer factor as a float32 node output."""
    return g.weight_op("Cast", [g.constant(name, array)], f"{name}/float", to=TensorProto.FLOAT)


def _part_scales(g: WeightNodes, scales_out: str, offsets_out: str | None, part: Runs) -> None:
    """One part's float32 (N_part, runs) scales and offsets from its factors: scale = d * sc, offset = middle *
    scale - dmin * mn (gguf_blocks.scales_offsets, the same operations in the same order)."""
    f, p = part.factors, scales_out
    shape = g.constant(f"{p}/shape", np.array(part.scales.shape, dtype=np.int64))
    scale = _float(g, f"{p}/d", f.d)  # (N, G, runs or 1)
    if f.sc is not None:
        scale = g.weight_op("Mul", [scale, _float(g, f"{p}/sc", f.sc)], f"{p}/d_sc")  # (N, G, runs)
    g.weight_op("Reshape", [scale, shape], scales_out)
    if offsets_out is None:
        return
    if f.dmin is None:  # a part without offsets beside one with them: its offsets are 0
        g.weight_op("ConstantOfShape", [shape], offsets_out)
        return
    low = _float(g, f"{p}/dmin", f.dmin)
    if f.mn is not None:
        low = g.weight_op("Mul", [low, _float(g, f"{p}/mn", f.mn)], f"{p}/dmin_mn")
    middle = g.constant(f"{p}/middle", np.array(f.middle, dtype=np.float32))
    centred = g.weight_op("Mul", [scale, middle], f"{p}/middle_scale")
    g.weight_op("Reshape", [g.weight_op("Sub", [centred, low], f"{p}/offsets"), shape], offsets_out)


def write_blocks(g: WeightNodes, nbits: NBits, *, packed: str, scales: str, offsets: str | None) -> None:
    """MatMulNBits' B and scales, and the (K / block_size, N) block offsets (given `offsets`), as node outputs of
    those names computed from the parts' planes and factors; the parts meet along the outputs (Concat)."""
    parts = nbits.parts
    names = [packed] if len(parts) == 1 else [f"{packed}/part{j}" for j in range(len(parts))]
    for name, part in zip(names, parts, strict=True):
        _part_values(g, name, part)
    if len(parts) > 1:
        g.weight_op("Concat", names, packed, axis=0)
    scale_names = [scales] if len(parts) == 1 else [f"{scales}/part{j}" for j in range(len(parts))]
    offset_names = [None] * len(parts) if offsets is None else [f"{offsets}/part{j}" for j in range(len(parts))]
    for scale_name, offset_name, part in zip(scale_names, offset_names, parts, strict=True):
        _part_scales(g, scale_name, offset_name, part)
    if len(parts) > 1:
        g.weight_op("Concat", scale_names, scales, axis=0)
    if offsets is not None:
        rows = offset_names[0] if len(parts) == 1 else g.weight_op("Concat", offset_names, f"{offsets}/rows", axis=0)
        g.weight_op("Transpose", [rows], offsets, perm=[1, 0])  # (N, runs) -> (runs, N)
