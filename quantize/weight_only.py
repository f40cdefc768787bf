"""Weight-only block quantization, for `edgelm quantize --mode int4 / int8-weight-only` (quantize/recipes.py, on an
fp32 package's graph) and `edgelm export --quantize` (export/block_quantize.py, on the checkpoint's weights) alike,
so both write the same bytes: symmetric blocks of `block_size` inputs, rounded to nearest by ONNX Runtime's own
kernels (the ones its MatMulNBitsQuantizer calls), the LM head's precision and blocks, and the recipe recorded in
the manifest. MatMulNBits' layout: com.microsoft MatMulNBits,
https://github.com/microsoft/onnxruntime/blob/main/docs/ContribOperators.md. Needs numpy and onnxruntime, not
torch or onnx.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .modes import LM_HEADS, MODES, WEIGHT_ONLY

HEAD_BLOCK_SIZE = 128  # an 8-bit LM head's weights per scale (docs/results.md, "int4: what each lever gave")
# MatMulNBits' accuracy level: the kernel quantizes activations to int8 per block and runs integer dot products
# (the other levels, compared in docs/results.md, were no more accurate and slower)
ACCURACY_LEVEL = 4


def quantize_blocks(weight: np.ndarray, *, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A (K, N) float weight (MatMul's layout) as MatMulNBits' symmetric `bits`-bit blocks of `block_size`
    consecutive k per column n, by ONNX Runtime's kernel: packed (N, blocks, block_size * bits / 8) uint8, each
    value plus 2^(bits-1), 4-bit ones two a byte, low nibble first; scales (N, blocks) float32. A K that is not
    whole blocks ends in a block the kernel pads with zeros."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    assert bits in (4, 8), f"MatMulNBits blocks of 4 or 8 bits, not {bits}"
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    k, n = weight.shape
    blocks = -(-k // block_size)
    packed = np.zeros((n, blocks, block_size * bits // 8), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=np.float32)
    zero_points = np.zeros((n, -(-blocks * bits // 8)), dtype=np.uint8)  # unused: symmetric
    kernel = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    kernel(packed, weight, scales, zero_points, block_size, n, k, True)
    return packed, scales


def head_block_size(bits: int, block_size: int, width: int) -> int:
    """Weights per scale of a weight-only recipe's LM head (and the embedding that gathers from it) of `width`
    inputs: an 8-bit head takes blocks of 128 where they divide the width. On the bundled model an 8-bit head in
    blocks of 128 agrees with fp32 as one in blocks of 32 does (93.30 against 93.34% top-1), and ONNX Runtime's
    8-bit kernel reads 8.5 bits a weight instead of 10 and runs faster (docs/benchmarks.md, "Real sizes"). A 4-bit
    head keeps the recipe's block size, as does a recipe whose blocks are already larger."""
    if bits == 8 and block_size < HEAD_BLOCK_SIZE and width % HEAD_BLOCK_SIZE == 0:
        return HEAD_BLOCK_SIZE
    return block_size


def check_block_size(block_size: int) -> None:
    """ValueError unless `block_size` is a power of two >= 16 (what MatMulNBits takes)."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two >= 16, got {block_size}")


@dataclass(frozen=True)
class WeightOnly:
    """A weight-only recipe's choices: the linears' bits and blocks, and the LM head's (the tied embedding gathers
    from the head's blocks; an untied one gets blocks of its own at the head's bits)."""

    mode: str  # int4 or int8-weight-only
    bits: int  # the blocks' linears
    block_size: int
    head_bits: int  # the LM head and the embedding
    head_block: int

    @classmethod
    def of(cls, mode: str, *, block_size: int, lm_head: str, head_width: int | None) -> WeightOnly:
        """The choices for `mode` with `lm_head` ("int8" keeps the head at 8 bits, since its rounding errors are
        the ones that change the most likely token; "int4" gives it the mode's bits); head_width: the head's
        inputs (None: the graph has no head)."""
        if mode not in WEIGHT_ONLY:
            raise ValueError(f"unknown weight-only quantization {mode!r}; valid: {', '.join(WEIGHT_ONLY)}")
        if lm_head not in LM_HEADS:
            raise ValueError(f"unknown int4 LM head precision {lm_head!r}; valid: {', '.join(LM_HEADS)}")
        check_block_size(block_size)
        bits = MODES[mode].bits
        head_bits = 8 if lm_head == "int8" else bits
        head_block = block_size if head_width is None else head_block_size(head_bits, block_size, head_width)
        return cls(mode, bits, block_size, head_bits, head_block)

    def recipe(self, *, embedding_bits: int | None = None) -> dict:
        """The manifest's record of it; embedding_bits: an untied embedding's own blocks."""
        untied = {} if embedding_bits is None else {"embedding": f"int{embedding_bits}"}
        return untied | {
            "mode": self.mode,
            "bits": self.bits,
            "op": "MatMulNBits",
            "algorithm": "round to nearest",
            "block_size": self.block_size,
            "lm_head_block_size": self.head_block,
            "symmetric": True,
            "accuracy_level": ACCURACY_LEVEL,
            "lm_head": f"int{self.head_bits}",
            "ops": f"linear MatMuls of the blocks int{self.bits}; LM head int{self.head_bits}, and the embedding "
            "(the head's blocks when tied, its own when not)",
        }
