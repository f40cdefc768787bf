"""A kept GGUF weight stored about as compactly as the file holds it, and unpacked by ONNX Runtime at load.

ONNX Runtime's MatMulNBits has 4- and 8-bit kernels only, so a Q5_0 or Q6_K value takes a byte of its B input
and every run's scale a float32 (export/gguf_blocks.py). On disk the package keeps instead

- the values as bit planes of their own width (5 bits: a 4-bit and a 1-bit plane; 6: 4 + 2; 3: 2 + 1; 2, 4
  and 8: one plane), and
- the scales and offsets as the file's own factors: float16 d and dmin, integer sub-block sc and mn,

and the graph computes B, the float32 scales and the offsets from them: uint8 BitShift, BitwiseAnd, Reshape,
BitwiseOr and Add; float Cast, Mul and Sub. Every input of those nodes is constant, so ONNX Runtime's constant
folding (graph optimization level "basic" and above) replaces each chain by the one initializer it computes,
before MatMulNBits prepacks it: the session runs the same graph as a package with plain blocks, bit for bit
(tests/test_compact_blocks.py). The float arithmetic is gguf_blocks.scales_offsets', in its order.

Plane layout. A value u = c + 2^(value_bits-1), made unsigned, is stored in B as u + 2^(bits-1) -
2^(value_bits-1). A plane holds `width` bits of u from bit `offset` on, 8 / width values a byte (value j at
bit j * width), in the order B's bytes take them: 8-bit blocks one a byte; 4-bit blocks the even elements
(B's low nibbles), then the odd ones. Unpacked: each plane byte shifted right by 0, width, 2 width, ... and
taken modulo 2^width, then shifted to its offset; the planes added (their bits are disjoint), the constant
added, and for 4-bit blocks the odd half shifted into the high nibbles. Only opset-14 operators (BitShift,
Mod, Add on uint8), so any opset export writes takes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from onnx import TensorProto, helper

from .gguf_blocks import Runs, pack

if TYPE_CHECKING:
    from .decoder import NBits
    from .graph import _GraphBuilder

# a value's bits -> its planes' widths, low bits first (a width divides 8, so a plane packs whole bytes)
PLANES = {2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 8: (8,)}


class Plane(NamedTuple):
    offset: int  # the bit of u its lowest bit is
    width: int  # its bits a value: 1, 2 or 4
    packed: np.ndarray  # uint8 (M, 1): 8 / width values a byte, value j of a byte at bit j * width


def bit_planes(values: np.ndarray, *, value_bits: int, bits: int) -> list[Plane]:
    """int8 (N, K) centred values of `value_bits` bits, fewer than MatMulNBits' `bits` -> their planes, the values
    in the order B takes them: one a byte (8 bits), or the even elements, then the odd ones (4 bits: B's low
    and high nibbles)."""
    u = (values.astype(np.int16) + (1 << (value_bits - 1))).astype(np.uint8).reshape(-1)  # (N K,)
    if bits == 4:
        u = np.concatenate([u[0::2], u[1::2]])
    planes, offset = [], 0
    for width in PLANES[value_bits]:
        group = 8 // width
        part = ((u >> offset) & ((1 << width) - 1)).reshape(-1, group)  # (M, group)
        packed = np.bitwise_or.reduce(part << (np.arange(group, dtype=np.uint8) * width), axis=1)  # (M,)
        planes.append(Plane(offset, width, packed[:, None]))
        offset += width
    return planes


def _part_values(g: _GraphBuilder, output: str, part: Runs) -> None:
    """B's rows of one part (uint8 (N_part, K / block_size, blob)) as `output`: B itself where the values fill
    its bits, else computed from their bit planes."""
    n, k = part.values.shape
    bits = part.bits
    if part.value_bits == bits:  # 4-bit values in 4-bit blocks, Q8_0's in 8-bit ones: B's own bytes
        g.constant(output, pack(part.values, bits, part.block_size))
        return
    block_shape = np.array([n, k // part.block_size, -1], dtype=np.int64)
    shape = g.constant(f"{output}/shape", np.array([2, -1], dtype=np.int64) if bits == 4 else block_shape)
    value = None
    for plane in bit_planes(part.values, value_bits=part.value_bits, bits=bits):
        name = f"{output}/plane{plane.offset}"
        shifts = g.constant(f"{name}/shifts", np.arange(8 // plane.width, dtype=np.uint8) * plane.width)
        piece = g.weight_op("BitShift", [g.constant(name, plane.packed), shifts], f"{name}/shifted", direction="RIGHT")
        size = g.constant(f"{name}/size", np.array(1 << plane.width, dtype=np.uint8))
        piece = g.weight_op("Mod", [piece, size], f"{name}/values")  # (M, 8 / width): the plane's bits of u
        piece = g.weight_op("Reshape", [piece, shape], f"{name}/rows")
        if plane.offset:
            at = g.constant(f"{name}/offset", np.array(plane.offset, dtype=np.uint8))
            piece = g.weight_op("BitShift", [piece, at], f"{name}/placed", direction="LEFT")
        value = piece if value is None else g.weight_op("Add", [value, piece], f"{name}/u")  # disjoint bits: OR
    zero_point = (1 << (bits - 1)) - (1 << (part.value_bits - 1))  # stored = u + this
    zero_point = g.constant(f"{output}/zero_point", np.array(zero_point, dtype=np.uint8))
    if bits == 8:
        g.weight_op("Add", [value, zero_point], output)
        return
    stored = g.weight_op("Add", [value, zero_point], f"{output}/stored")  # (2, N K / 2): even, odd elements
    halves = [f"{output}/even", f"{output}/odd"]
    split = g.constant(f"{output}/split", np.array([1, 1], dtype=np.int64))
    g.weight_nodes.append(helper.make_node("Split", [stored, split], halves, name=f"{output}/Split", axis=0))
    four = g.constant(f"{output}/four", np.array(4, dtype=np.uint8))
    high = g.weight_op("BitShift", [halves[1], four], f"{output}/high", direction="LEFT")
    packed = g.weight_op("Add", [halves[0], high], f"{output}/bytes")  # (1, N K / 2)
    g.weight_op("Reshape", [packed, g.constant(f"{output}/block_shape", block_shape)], output)


def _float(g: _GraphBuilder, name: str, array: np.ndarray) -> str:
    """A float16 or integer factor as a float32 node output."""
    return g.weight_op("Cast", [g.constant(name, array)], f"{name}/float", to=TensorProto.FLOAT)


def _part_scales(g: _GraphBuilder, scales_out: str, offsets_out: str | None, part: Runs) -> None:
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


def write_blocks(g: _GraphBuilder, nbits: NBits, *, packed: str, scales: str, offsets: str | None) -> None:
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
