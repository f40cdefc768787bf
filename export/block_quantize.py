"""`export --quantize int4 | int8-weight-only | fp16`: a Hugging Face folder straight to a weight-only quantized (or
half-precision) package, block by block, with no fp32 package in between (on disk or in memory).

The recipe is quantize/weight_only.py's, the one `quantize --mode int4 / int8-weight-only` runs: every linear layer
of the blocks in symmetric `bits`-bit blocks of `block_size` inputs, rounded to nearest by ONNX Runtime's kernels,
the LM head (and the tied embedding, which gathers its rows from the head's blocks; an untied embedding in blocks
of its own, its rows gathered from them) in 8-bit blocks unless lm_head is "int4", MatMulNBits at accuracy level
4. Each weight is quantized when the graph writes it (gguf_blocks.LazyRuns), one at a time, so the package holds
the same bytes as `export` then `quantize` would write.

The proof compares the graph with the reference model computing on what the blocks hold: each quantized
weight of the reference is replaced by its blocks' values (quantized and dequantized when read), as for a GGUF
file's kept blocks, so the check is the graph's, not the rounding's (the rounding's cost is what `quantize
--eval-text` measures).

fp16 is `quantize --mode fp16`'s conversion (writers/float16.py: onnxruntime's convert_float_to_float16) run on
the fused graph before its weights are written, each float weight converted to float16 as it is written; its
proof runs ONNX Runtime on the half-precision graph (float16 weights, activations, KV cache and logits) against
the float64 reference on the checkpoint's weights.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from edgelm.quantize.weight_only import WeightOnly, quantize_blocks
from edgelm.writers.float16 import FP16_FACTS, half_graph, to_half

from .decoder import Decoder, Linear, NBits
from .gguf_blocks import LazyRuns, Runs, dequantized
from .lazy_weights import SLICE_BYTES, LazyArray, TensorLoader, is_lazy, lazy_parameter, read

TOKEN_EMBEDDINGS = ("embed_tokens", "wte")  # the reference models' token tables (not GPT-2's positions, wpe)


def block_quantized(weight: np.ndarray, *, bits: int, block_size: int) -> Runs:
    """A (K, N) float weight (MatMul's layout) as quantize/weight_only.py's blocks: Runs of centred values (N, K)."""
    k, n = weight.shape
    assert k % block_size == 0, f"{k} inputs are not whole blocks of {block_size}"
    packed, scales = quantize_blocks(weight, bits=bits, block_size=block_size)  # (N, blocks, blob), (N, blocks)
    if bits == 4:  # element 2i in the low nibble of byte i (gguf_blocks.pack's layout)
        stored = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k)
    else:
        stored = packed.reshape(n, k)
    values = (stored.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
    return Runs(bits, block_size, values, scales, None, bits, None)


def _nbits(weight, *, bits: int, block_size: int) -> NBits:
    """A (K, N) weight (an array or a LazyArray) as blocks quantized when the graph writes them; where its columns
    can be read alone (a tied head: the embedding's rows of a GGUF file), also some of them at a time, so that a
    large one is quantized and written a slice at a time (export/graph_blocks.py SLICED_WEIGHTS)."""
    k, n = weight.shape
    load = lambda: block_quantized(np.asarray(weight), bits=bits, block_size=block_size)  # noqa: E731
    columns = getattr(weight, "columns", None)
    some = None
    if columns is not None:
        some = lambda start, stop: block_quantized(  # noqa: E731
            np.ascontiguousarray(columns(start, stop).T), bits=bits, block_size=block_size
        )
    return NBits(bits, block_size, [LazyRuns(bits, block_size, (n, k), False, load, some)])


def _source_rows(tensor: torch.Tensor, rows: torch.Tensor | None, span: tuple[int, int] | None) -> torch.Tensor:
    """An (out, in) weight's rows `rows` (ids), or [start, stop) = span, or all of them, in the file's dtype; read
    alone where its loader can (a GGUF file's tensor: whole, a 1B head is 1 GB of float32 and more in temporaries)."""
    loader = tensor.loader if is_lazy(tensor) else None
    if rows is not None:
        return loader.rows(rows) if loader is not None and loader.rows is not None else read(tensor)[rows]
    if span is not None:
        if loader is not None and loader.row_range is not None:
            return loader.row_range(*span)
        return read(tensor)[span[0] : span[1]]
    return read(tensor)


def _what_blocks_hold(
    tensor: torch.Tensor,
    rows: torch.Tensor | None = None,
    *,
    bits: int,
    block_size: int,
    span: tuple[int, int] | None = None,
) -> torch.Tensor:
    """An nn.Linear-layout (out, in) weight as its blocks hold it (quantized along `in`), float32; rows: those
    only (ids, or the range `span`). Each output row's blocks are its own, so it is quantized a slice of rows at a
    time (a 152k-row head would otherwise take several float32 copies at once)."""
    weight = _source_rows(tensor, rows, span)  # (out, in), the file's dtype
    held = torch.empty(weight.shape, dtype=torch.float32)
    step = max(1, SLICE_BYTES // (4 * weight.shape[1]))
    for i in range(0, weight.shape[0], step):
        part = weight[i : i + step].to(torch.float32).numpy().T  # (in, rows): MatMul's layout
        held[i : i + step] = torch.from_numpy(dequantized(block_quantized(part, bits=bits, block_size=block_size)))
    return held


def _reference_on_blocks(parameter: torch.nn.Parameter, *, bits: int, block_size: int) -> torch.nn.Parameter:
    load = partial(_what_blocks_hold, parameter, bits=bits, block_size=block_size)
    loader = parameter.loader if is_lazy(parameter) else None
    some = None  # rows [start, stop) alone where the source reads them so (the proof's Linear, row_slices)
    if loader is not None and loader.row_range is not None:
        some = lambda start, stop: load(span=(start, stop))  # noqa: E731
    return lazy_parameter(TensorLoader(tuple(parameter.shape), load, load, some))


def check_block_size(decoder: Decoder, block_size: int) -> None:
    """ValueError unless `block_size` divides every linear's inputs (a power of two >= 16 is WeightOnly.of's)."""
    widths = [decoder.n_embd, decoder.inner_dim, decoder.n_head * decoder.head_dim]
    widths += [decoder.per_layer_dim] if decoder.per_layer_dim else []  # Gemma 4's per-layer projections
    widths += [decoder.n_head * decoder.heads(layer)[2] for layer in decoder.layers]  # its full layers' heads
    for width in widths:
        if width % block_size:
            raise ValueError(
                f"block size {block_size} does not divide a linear layer's {width} inputs; use a smaller one"
            )


def quantize_decoder(
    decoder: Decoder, model: torch.nn.Module, *, mode: str, block_size: int = 32, lm_head: str = "int8"
) -> dict:
    """Every float linear of `decoder` as weight-only blocks and the LM head as `lm_head` blocks (the tied embedding
    gathering from them); the reference model's weights replaced by what the blocks hold. Returns the recipe
    (quantize/weight_only.py WeightOnly.recipe)."""
    head = decoder.embedding.T if decoder.tied else decoder.lm_head  # (C, V)
    plan = WeightOnly.of(mode, block_size=block_size, lm_head=lm_head, head_width=head.shape[0])
    check_block_size(decoder, block_size)
    bits, head_bits, head_block = plan.bits, plan.head_bits, plan.head_block
    for layer in decoder.layers:
        for owner, name in _linear_fields(layer):
            linear: Linear = getattr(owner, name)
            if linear.nbits is None:
                blocks = _nbits(linear.weight, bits=bits, block_size=block_size)
                setattr(owner, name, Linear(None, linear.bias, blocks, lora=linear.lora))
    projection = decoder.per_layer_projection  # Gemma 4's, quantized in the reference model too
    if projection is not None and projection.nbits is None:
        decoder.per_layer_projection = Linear(None, None, _nbits(projection.weight, bits=bits, block_size=block_size))
    decoder.head_nbits = _nbits(head, bits=head_bits, block_size=head_block)
    own_table = not decoder.tied and decoder.embedding_nbits is None  # untied and float: blocks like the head's
    if own_table:
        decoder.embedding_nbits = _nbits(decoder.embedding.T, bits=head_bits, block_size=head_block)
    _quantize_reference(
        model, bits=bits, head_bits=head_bits, block_size=block_size, head_block=head_block, embedding=own_table
    )
    embedding_bits = None if decoder.tied else decoder.embedding_nbits.bits
    return plan.recipe(embedding_bits=embedding_bits) | {
        "written_by": "export --quantize (block by block, no fp32 package)"
    }


def _linear_fields(layer) -> list[tuple[object, str]]:
    """(object, field) of each linear of a layer: its attention's or its mixer's (a hybrid's ShortConv or DeltaNet),
    and the MLP's."""
    if layer.conv is not None:
        mixer = [(layer.conv, "in_proj"), (layer.conv, "out_proj")]
    elif layer.delta_net is not None:
        mixer = [(layer.delta_net, name) for name in ("in_proj", "z", "b", "a", "out_proj")]
    else:
        mixer = [(layer, "qkv"), (layer, "attention_out")]
    per_layer = [] if layer.per_layer is None else [(layer.per_layer, "gate"), (layer.per_layer, "projection")]
    return [*mixer, (layer, "up"), (layer, "down"), *per_layer]  # Gemma 4's per-layer input linears last


def _quantize_reference(
    model: torch.nn.Module, *, bits: int, head_bits: int, block_size: int, head_block: int, embedding: bool = False
) -> None:
    """The reference model's linears (and its head, with the embedding tied to it) computing on their blocks; with
    `embedding`, the untied token table reading blocks of its own, at the head's bits."""
    head = model.lm_head
    tied = [m for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight is head.weight]
    tables = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in TOKEN_EMBEDDINGS] if embedding else []
    assert not embedding or len(tables) == 1, f"the reference model has {len(tables)} token tables, not one"
    for table in tables:  # the untied token table (V, C): blocks along C, as the head's
        table.weight = _reference_on_blocks(table.weight, bits=head_bits, block_size=head_block)
    for module in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
        width, size = (head_bits, head_block) if module is head else (bits, block_size)
        module.weight = _reference_on_blocks(module.weight, bits=width, block_size=size)
        if module is head:
            for embedding in tied:
                embedding.weight = module.weight  # one parameter again


def half_precision(graph, weights: dict) -> dict:
    """export --quantize fp16: the fused graph (its weights held apart, in `weights`) converted as `quantize --mode
    fp16` converts an fp32 package's; returns the recipe's facts. Each float weight the conversion turned to
    float16 is read and converted when it is written, one at a time."""
    converted, names = half_graph(graph)
    graph.CopyFrom(converted)
    for name in names:
        weights[name] = _half(weights[name])
    return FP16_FACTS | {"written_by": "export --quantize fp16 (tensor by tensor, no fp32 package)"}


def _half(array) -> LazyArray:
    def load() -> np.ndarray:
        values = np.asarray(array, dtype=np.float32)  # a LazyArray is read now, once
        return to_half(values.shape, lambda start, stop: values[start:stop])

    return LazyArray(array.shape, load, np.float16)
