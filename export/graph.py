"""Build the decoder's ONNX graph from a Decoder (export/decoder.py), with ONNX Runtime's fused
operators: the fast graph edgelm exports by default.

Attention is one com.microsoft GroupQueryAttention node per layer, fed the packed Q/K/V product
(rotary positions applied inside it where the family has them), and its cache is one preallocated
buffer per layer that serves as both past_key_values.{i}.* and present.{i}.*: a decode step writes one
position into it, in place (onnxruntime-genai's builder makes the same choice, past_present_share_buffer).

    inputs   input_ids (B, T) int64, attention_mask (B, total) int64, position_ids (B, T) int64 (position
             tables only; rotary positions come from each row's length), past keys / values
             (B, n_kv_head, capacity, head_dim), num_logits_to_keep () int64, optional: 0 (the default) =
             every position, k = the last k
    outputs  logits (B, T or k, vocab), present keys / values (B, n_kv_head, max(capacity, total), head_dim)

Each residual Add and the norm after it are one com.microsoft node, SkipSimplifiedLayerNormalization
(RMSNorm: Llama, Qwen2, Mistral) or SkipLayerNormalization (GPT-2), whose extra output is the residual sum;
ONNX Runtime does not fuse them itself (the sum has two readers), and then folds a Linear's bias into
SkipLayerNormalization's bias input.

Padding is on the right: row b's tokens fill positions 0 .. len_b - 1 of the buffer and attention_mask
row b is len_b ones followed by zeros; GroupQueryAttention reads each row's length (seqlens_k =
len_b - 1) and the longest total (the mask's width) from it. Fed as separate arrays, the graph also
runs with a growing cache, as the standard graph does.

Linear layers are MatMul (+ Add for a bias) with constant weights, so quantize/ finds and quantizes
them; a tied embedding is one (C, V) matrix read by both the LM head and a Gather along axis 1. A Linear
that carries MatMulNBits blocks (a GGUF file's own quantization, export/decoder.py NBits) becomes a
com.microsoft MatMulNBits node on them instead (plus a MatMul of x's block sums by the blocks' offsets for
Q4_1's w = d * q + m), and a tied embedding then gathers from the head's blocks (export/graph_blocks.py).
The mechanisms (attention, a short convolution, Gated DeltaNet, per-layer inputs) are export/mechanisms/'s.

The weights are not copied into the graph: its initializers are placeholders and the arrays travel beside
it, for edgelm.writers.onnxfile.save_model to write one at a time.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgelm.writers.float16 import KEEP_FLOAT32

from ..runtime.contract import IONames
from ..runtime.packed import DOMAIN as PACKED_DOMAIN
from .decoder import Decoder, Linear, Norm, Rotary
from .graph_blocks import _BlockNodes, _gather_blocks, _gather_embedding_blocks
from .graph_nodes import MS_DOMAIN
from .limits import check_table_memory
from .mechanisms import attention, per_layer_input
from .mechanisms.attention import RotaryCaches


class _GraphBuilder(_BlockNodes):
    """The fused graph's builder: its primitives (export/graph_nodes.py), kept-block linears
    (export/graph_blocks.py), and here the linears, norms and MLPs; the mechanisms' steps (export/mechanisms/) are
    functions given it."""

    def __init__(self, *, accuracy_level: int, compact: bool):
        super().__init__()
        self.accuracy_level = accuracy_level  # MatMulNBits: 0 float activations, 4 int8 activations
        self.compact = compact  # kept blocks as bit planes and factors (export/compact_blocks.py)
        self.lora_inputs: list[onnx.ValueInfoProto] = []  # LoRA slots' A and B: overridable, zero-size by default
        # with KV sharing: a layer's prefix ("layers.3") -> the key and value inputs of its attention node, for the
        # layers that read its cache
        self.kv_inputs: dict[str, list[str]] | None = None

    def linear(self, x: str, prefix: str, layer: Linear) -> str:
        if layer.nbits is not None:
            product = self.matmul_nbits(x, prefix, layer.nbits, f"{prefix}/MatMulNBits")
        else:
            product = self.op("MatMul", [x, self.constant(f"{prefix}.weight", layer.weight)], f"{prefix}/MatMul")
        if layer.lora is not None:
            product = self.lora_slot(x, prefix, layer, product)
        if layer.bias is None:
            return product
        return self.op("Add", [product, self.constant(f"{prefix}.bias", layer.bias)], f"{prefix}/Add")

    def lora_slot(self, x: str, prefix: str, layer: Linear, product: str) -> str:
        """product + (x @ A) @ B: A (in, r) and B (r, out) graph inputs whose defaults have r = 0, so the base
        costs three near-empty nodes; a run binds an adapter's A and B (runtime/adapters.py)."""
        k, n = layer.nbits.shape if layer.nbits is not None else layer.weight.shape
        a, b = layer.lora
        rank = f"{prefix.split('.', 2)[-1]}_lora_rank"  # one symbolic width per kind of linear
        self.lora_inputs.append(helper.make_tensor_value_info(a, TensorProto.FLOAT, [k, rank]))
        self.lora_inputs.append(helper.make_tensor_value_info(b, TensorProto.FLOAT, [rank, n]))
        self.constant(a, np.zeros((k, 0), np.float32))
        self.constant(b, np.zeros((0, n), np.float32))
        down = self.op("MatMul", [x, a], f"{prefix}/lora_A")  # (B, T, r)
        delta = self.op("MatMul", [down, b], f"{prefix}/lora_B")  # (B, T, out)
        return self.op("Add", [product, delta], f"{prefix}/lora_Add")

    def norm(self, x: str, prefix: str, norm: Norm, decoder: Decoder) -> str:
        if decoder.norm == "rms":  # x / sqrt(mean(x^2) + eps) * weight: ONNX Runtime's contrib op
            inputs = [x, self.constant(f"{prefix}.weight", norm.weight)]
            output = self.op(
                "SimplifiedLayerNormalization", inputs, f"{prefix}/RMSNorm", axis=-1, epsilon=decoder.norm_eps
            )
            return self.float_output(output, ["batch_size", "sequence_length", decoder.n_embd])  # contrib op: typed
        inputs = [x, self.constant(f"{prefix}.weight", norm.weight), self.constant(f"{prefix}.bias", norm.bias)]
        return self.op("LayerNormalization", inputs, f"{prefix}/LayerNorm", axis=-1, epsilon=decoder.norm_eps)

    def residual_norm(
        self, x: str, skip: str, prefix: str, norm: Norm, decoder: Decoder, *, residual: str | None
    ) -> tuple[str, str | None]:
        """(norm(x + skip), x + skip named `residual`; None: the sum is not needed), as one com.microsoft node:
        SkipSimplifiedLayerNormalization (RMSNorm) or SkipLayerNormalization, whose output 3 is the sum
        (onnxruntime-genai's builder does the same)."""
        inputs = [x, skip, self.constant(f"{prefix}.weight", norm.weight)]
        if decoder.norm == "rms":
            op_type, normalized = "SkipSimplifiedLayerNormalization", f"{prefix}/SkipRMSNorm"
        else:
            op_type, normalized = "SkipLayerNormalization", f"{prefix}/SkipLayerNorm"
            inputs.append(self.constant(f"{prefix}.bias", norm.bias))
        self.nodes.append(
            helper.make_node(
                op_type,
                inputs,
                [normalized] if residual is None else [normalized, "", "", residual],  # no mean, inverse std
                name=normalized,
                domain=MS_DOMAIN,
                epsilon=decoder.norm_eps,
            )
        )
        shape = ["batch_size", "sequence_length", decoder.n_embd]
        return self.float_output(normalized, shape), residual and self.float_output(residual, shape)

    def mlp(self, x: str, prefix: str, up: Linear, decoder: Decoder, inner_dim: int | None = None) -> str:
        """act(x W_up), or act(x W_gate) * (x W_up) for a gated MLP (one MatMul for gate and up, split after
        it: two MatMulNBits showed no clear win); inner_dim: the layer's width, where not the Decoder's."""
        inner_dim = inner_dim or decoder.inner_dim
        h = self.linear(x, f"{prefix}.up", up)
        shape = ["batch_size", "sequence_length", inner_dim]
        gate = h
        if decoder.gated_mlp:
            sizes = self.small_constant(f"{prefix}/split_sizes", np.array([inner_dim] * 2, dtype=np.int64))
            names = [f"{prefix}/gate", f"{prefix}/up"]
            self.nodes.append(helper.make_node("Split", [h, sizes], names, name=f"{prefix}/Split", axis=-1))
            gate, h = names
        if decoder.activation == "silu":
            act = self.op("Mul", [gate, self.op("Sigmoid", [gate], f"{prefix}/Sigmoid")], f"{prefix}/SiLU")
        else:
            gelu = "Gelu" if decoder.activation == "gelu" else "FastGelu"  # exact erf form, or the tanh form
            act = self.float_output(self.op(gelu, [gate], f"{prefix}/{gelu}", domain=MS_DOMAIN), shape)
        return self.op("Mul", [act, h], f"{prefix}/gated") if decoder.gated_mlp else act


def build_fused_graph(
    decoder: Decoder,
    io: IONames,
    *,
    opset: int = 17,
    accuracy_level: int = 4,
    compact: bool = True,
    packed: bool = False,
    fallback_plan: dict | None = None,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The decoder as an ONNX graph with fused attention and a shared KV buffer, and its weights: initializer
    name -> array, for edgelm.writers.onnxfile.save_model. accuracy_level: MatMulNBits' (blocks kept from a GGUF only);
    compact: kept blocks as bit planes and the file's factors, unpacked at load (export/compact_blocks.py),
    else as MatMulNBits' own arrays. packed: the file's own rows under ai.edgelm ops (runtime/packed.py); a
    fallback_plan dict: the plain graph whose block arrays it records as made from those rows (never written).
    io: the manifest's names; its logits_to_keep names the optional input."""
    assert io.logits_to_keep is not None, "the fused graph takes the number of positions to keep as an input"
    d = decoder
    g = _GraphBuilder(accuracy_level=accuracy_level, compact=compact)
    g.packed, g.fallback_plan = packed, fallback_plan
    one = g.small_constant("const_one", np.array(1, dtype=np.int64))
    axis_1 = g.small_constant("const_axis_1", np.array([1], dtype=np.int64))
    x, head = _embeddings(g, d, io)

    # Each row's length and the longest total, from the attention mask, for every attention node.
    lengths = g.op("ReduceSum", [io.attention_mask, axis_1], "mask/ReduceSum", keepdims=0)  # (B,)
    last_index = g.op("Sub", [lengths, one], "mask/Sub")
    seqlens_k = g.op("Cast", [last_index], "seqlens_k", to=TensorProto.INT32)
    mask_shape = g.op("Shape", [io.attention_mask], "mask/Shape")
    total = g.op("Gather", [mask_shape, one], "mask/Gather", axis=0)
    lengths = [seqlens_k, g.op("Cast", [total], "total_sequence_length", to=TensorProto.INT32)]
    rotary, local_rotary = _rotary_caches(g, d, io, seqlens_k)
    per_layer = per_layer_input.inputs(g, x, d, io) if d.per_layer_dim else None
    if any(layer.kv_source is not None for layer in d.layers):
        g.kv_inputs = {}

    h = g.norm(x, "layers.0.attention_norm", d.layers[0].attention_norm, d)
    for i, layer in enumerate(d.layers):
        p = f"layers.{i}"
        if layer.state_mixer is not None:  # a short convolution, a Gated DeltaNet (export/mechanisms/)
            out = layer.state_mixer.step(g, h, p, io, i, eps=d.norm_eps)
        else:
            caches = (local_rotary if layer.sliding_window is not None else rotary) if layer.rotary else None
            cache = (io.past(i), io.present(i))
            if layer.kv_source is not None:  # the source's present in, a present of its own that nothing reads out
                cache = (io.present(layer.kv_source), (f"{p}/present_key", f"{p}/present_value"))
            out = g.linear(attention.step(g, h, p, layer, d, cache, lengths, caches), f"{p}.attention_out",
                           layer.attention_out)  # fmt: skip
        if layer.attention_post_norm is not None:
            out = g.norm(out, f"{p}.attention_post_norm", layer.attention_post_norm, d)
        out = _scaled(g, out, d.residual_scale, f"{p}/attention_scaled")
        h, x = g.residual_norm(x, out, f"{p}.mlp_norm", layer.mlp_norm, d, residual=f"{p}/attention_residual")
        down = g.linear(g.mlp(h, f"{p}.mlp", layer.up, d, layer.inner_dim), f"{p}.mlp.down", layer.down)
        if layer.mlp_post_norm is not None:
            down = g.norm(down, f"{p}.mlp_post_norm", layer.mlp_post_norm, d)
        down = _scaled(g, down, d.residual_scale, f"{p}/mlp_scaled")
        if layer.per_layer is not None or layer.output_scale is not None:  # steps after the residual sum
            x = g.op("Add", [x, down], f"{p}/mlp_residual")
            if layer.per_layer is not None:
                x = per_layer_input.step(g, x, p, layer.per_layer, d, per_layer, i)
            x, down = _scaled(g, x, layer.output_scale, f"{p}/layer_scaled"), None
            if i + 1 < d.n_layer:
                h = g.norm(x, f"layers.{i + 1}.attention_norm", d.layers[i + 1].attention_norm, d)
        elif i + 1 < d.n_layer:  # the residual sum and the next layer's attention norm
            nxt = f"layers.{i + 1}.attention_norm"
            h, x = g.residual_norm(x, down, nxt, d.layers[i + 1].attention_norm, d, residual=f"{p}/mlp_residual")
    _logits(g, d, io, x, down, head=head, axis_1=axis_1)

    inputs, outputs = _graph_io(d, io)
    inputs += g.lora_inputs
    graph = helper.make_graph(
        g.weight_nodes + g.nodes, f"edgelm-{d.family}-fused", inputs, outputs, g.initializers, value_info=g.value_info
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)]
    if packed:
        opsets.append(helper.make_opsetid(PACKED_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    _gather_embedding_blocks(model, d, g.weights, compact=compact, packed=packed)
    if d.per_layer_embedding_nbits is not None:  # Gemma 4's per-layer table, kept as the file's blocks
        _gather_blocks(model, "per_layer/Gather", "per_layer.embed", d.per_layer_embedding_nbits)
    return model, g.weights


def _embeddings(g: _GraphBuilder, d: Decoder, io: IONames) -> tuple[str, str | None]:
    """(the token embeddings, scaled and with positions added where the family has them: (B, T, C); the LM
    head's (C, V) weight, or None when the head is blocks). Tied: one (C, V) matrix; the embedding gathers
    its columns."""
    head = None
    if d.tied or d.embedding_nbits is not None:
        # with blocks the Gather's table is a stand-in, rewired to read them (writers/nbits_gather.py): the
        # head's when tied, the embedding's own (V, C / block, blob) when not
        if d.tied:
            table = "lm_head.weight_T" if d.head_nbits is not None else g.constant("lm_head.weight_T", d.embedding.T)
            head = table
        else:
            g.embedding_blocks("embed", d.embedding_nbits)  # offsets (C / block, V) too, where it has them
            table = "embed.weight_T"
        columns = g.op("Gather", [table, io.input_ids], "embed/Gather", axis=1)  # (C, B, T)
        x = g.op("Transpose", [columns], "embed/Transpose", perm=[1, 2, 0])  # (B, T, C)
    else:
        x = g.op("Gather", [g.constant("embed.weight", d.embedding), io.input_ids], "embed/Gather", axis=0)
    if not d.tied and d.head_nbits is None:
        head = g.constant("lm_head.weight_T", d.lm_head)
    if d.embedding_scale is not None:
        scale = g.small_constant("embed/scale", np.array(d.embedding_scale, dtype=np.float32))
        x = g.op("Mul", [x, scale], "embed/Mul")  # (B, T, C)
    if d.position_table is not None:
        positions = g.op("Gather", [g.constant("positions.weight", d.position_table), io.position_ids], "pos/Gather")
        x = g.op("Add", [x, positions], "embeddings/Add")  # (B, T, C)
    return x, head


def _rotary_caches(
    g: _GraphBuilder, d: Decoder, io: IONames, seqlens_k: str
) -> tuple[RotaryCaches | None, RotaryCaches | None]:
    """The full layers' and the sliding layers' rotary caches (None where none). GroupQueryAttention rotates by
    them itself where it can: one table for every row, of a width that is a multiple of 8 (ONNX Runtime 1.32's
    rule). Otherwise Q and K rotate before it, by positions computed here as it computes them (0 .. T - 1 in a
    prompt, past .. past + T - 1 after), a LongRoPE row past long_after tokens reading the long tables,
    stacked after the short ones."""
    rotary = local_rotary = None
    if d.rotary is not None:
        rotary = RotaryCaches(_rotary_tables(g, d.rotary, d.context_length, "rotary"), d.rotary.width)
        if d.rotary.long_inv_freq is not None or d.rotary.width // 2 % 8:
            rotary.positions = _row_positions(g, d, io, seqlens_k)
    if d.rotary_local is not None:
        local = d.rotary_local
        local_rotary = RotaryCaches(_rotary_tables(g, local, d.context_length, "rotary_local"), local.width)
    return rotary, local_rotary


def _rotary_tables(g: _GraphBuilder, rotary: Rotary, positions: int, name: str) -> list[str]:
    """The cos and sin caches, (positions, r / 2) float32 each (LongRoPE: the long frequencies' rows after the short
    ones, (2 positions, r / 2)), computed from the frequencies by nodes of constants only, which ONNX Runtime folds
    once at session start: cos(p * inv_freq) * factor, p a float32 position and the product float32, as the
    reference's torch.arange(P, dtype=float32)[:, None] * inv_freq. The nodes keep float32 under the float16
    conversion (writers/float16.py: positions past 2048 are not exact in float16, past 65504 not finite); the last
    node, a Cast to float32 that the conversion turns into one to float16, gives them in the graph's float type."""
    sets = 1 if rotary.long_inv_freq is None else 2  # LongRoPE: short and long
    check_table_memory(positions, sets * rotary.width, "the rotary cos and sin tables, (positions, r / 2) each,")
    p = f"{KEEP_FLOAT32}{name}"
    int64 = lambda suffix, value: g.constant(f"{p}/{suffix}", np.array(value, dtype=np.int64))  # noqa: E731
    rows = g.weight_op("Range", [int64("start", 0), int64("limit", positions), int64("delta", 1)], f"{p}/Range")
    floats = g.weight_op("Cast", [rows], f"{p}/positions", to=TensorProto.FLOAT)
    column = g.weight_op("Unsqueeze", [floats, int64("axis", [1])], f"{p}/column")  # (P, 1)
    if rotary.long_inv_freq is None:
        angles = g.weight_op("Mul", [column, g.constant(f"{name}.inv_freq", rotary.inv_freq)], f"{p}/angles")
    else:  # (2, 1, r / 2): short, long; then (2, P, r / 2) as (2 P, r / 2), a Reshape that is a copy when folded
        stacked = g.constant(f"{name}.inv_freq", np.stack([rotary.inv_freq, rotary.long_inv_freq])[:, None, :])
        angles = g.weight_op("Mul", [column, stacked], f"{p}/stacked_angles")
        angles = g.weight_op("Reshape", [angles, int64("shape", [-1, rotary.width // 2])], f"{p}/angles")
    tables = []
    for kind in ("Cos", "Sin"):
        table = g.weight_op(kind, [angles], f"{p}/{kind.lower()}")
        if rotary.factor != 1.0:  # times 1 is exact: no node
            factor = g.constant(f"{p}/{kind.lower()}_factor", np.array(rotary.factor, dtype=np.float32))
            table = g.weight_op("Mul", [table, factor], f"{p}/{kind.lower()}_scaled")
        tables.append(g.weight_op("Cast", [table], f"{name}.{kind.lower()}", to=TensorProto.FLOAT))
    return tables


def _row_positions(g: _GraphBuilder, d: Decoder, io: IONames, seqlens_k: str) -> str:
    """(B, T) int64: each row's positions, max(seqlens_k + 1 - T, 0) + 0 .. T - 1, plus the table length for a
    LongRoPE row longer than its long_after (seqlens_k + 1 tokens)."""
    ids_shape = g.op("Shape", [io.input_ids], "positions/Shape")
    width = g.op("Gather", [ids_shape, g.small_constant("positions/one", np.array(1))], "positions/T", axis=0)
    zero = g.small_constant("positions/zero", np.array(0, dtype=np.int64))
    step = g.small_constant("positions/step", np.array(1, dtype=np.int64))
    offsets = g.op("Range", [zero, width, step], "positions/Range")  # (T,)
    lengths = g.op("Add", [g.op("Cast", [seqlens_k], "positions/lengths", to=TensorProto.INT64), step],
                   "positions/total")  # fmt: skip
    start = g.op("Max", [g.op("Sub", [lengths, width], "positions/Sub"), zero], "positions/start")  # (B,)
    if d.rotary.long_after is not None:
        after = g.small_constant("positions/long_after", np.array(d.rotary.long_after, dtype=np.int64))
        long = g.op("Cast", [g.op("Greater", [lengths, after], "positions/long")], "positions/long_int",
                    to=TensorProto.INT64)  # fmt: skip
        table = g.small_constant("positions/table", np.array(d.context_length, dtype=np.int64))
        start = g.op("Add", [start, g.op("Mul", [long, table], "positions/long_rows")], "positions/first")
    column = g.op("Unsqueeze", [start, g.small_constant("positions/axis", np.array([1]))], "positions/column")
    return g.op("Add", [column, offsets], "positions")  # (B, T)


def _scaled(g: _GraphBuilder, x: str, scale: float | None, name: str) -> str:
    """x times `scale` (Granite's residual multiplier), or x where there is none."""
    if scale is None:
        return x
    return g.op("Mul", [x, g.small_constant(f"{name}/scale", np.array(scale, dtype=np.float32))], name)


def _logits(
    g: _GraphBuilder, d: Decoder, io: IONames, x: str, down: str | None, *, head: str | None, axis_1: str
) -> None:
    """The last residual (down None: x holds it already), the final norm and the LM head, on the last k positions
    (io.logits_to_keep)."""
    # Keep the last k positions before the LM head: Slice(x, -k:) is every position for k = 0 (the default,
    # for evaluation) and the last one for k = 1 (generation).
    g.constant(io.logits_to_keep, np.array(0, dtype=np.int64))
    negated = g.op("Neg", [io.logits_to_keep], "keep/Neg")
    start = g.op("Unsqueeze", [negated, g.small_constant("const_axis_0", np.array([0]))], "keep/start")
    end = g.small_constant("const_int64_max", np.array([np.iinfo(np.int64).max], dtype=np.int64))
    # The last residual and the final norm in one node over every position, then the Slice: normalizing T rows
    # of C is cheap beside the LM head, and one Slice after it is a node fewer than one on each input.
    if down is None:
        x = g.norm(x, "final_norm", d.final_norm, d)
    else:
        x, _ = g.residual_norm(x, down, "final_norm", d.final_norm, d, residual=None)
    x = g.op("Slice", [x, start, end, axis_1], "keep/Slice")
    logits = io.logits if d.logits_divisor is None and d.logits_softcap is None else "lm_head/logits"
    if d.head_nbits is not None:
        g.matmul_nbits(x, "lm_head", d.head_nbits, logits)
    else:
        g.op("MatMul", [x, head], logits)
    if d.logits_divisor is not None:  # Granite's logits_scaling
        divisor = g.small_constant("lm_head/divisor", np.array(d.logits_divisor, dtype=np.float32))
        g.op("Div", [logits, divisor], io.logits)
    if d.logits_softcap is not None:  # Gemma 4: cap * tanh(logits / cap)
        cap = g.small_constant("lm_head/softcap", np.array(d.logits_softcap, dtype=np.float32))
        capped = g.op("Tanh", [g.op("Div", [logits, cap], "lm_head/capped")], "lm_head/tanh")
        g.op("Mul", [capped, cap], io.logits)


def _graph_io(d: Decoder, io: IONames) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """The graph's inputs and outputs, named as the manifest names them."""
    inputs = [
        helper.make_tensor_value_info(io.input_ids, TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info(io.attention_mask, TensorProto.INT64, ["batch_size", "total_sequence_length"]),
    ]
    if d.position_table is not None:
        inputs.append(
            helper.make_tensor_value_info(io.position_ids, TensorProto.INT64, ["batch_size", "sequence_length"])
        )
    outputs = [
        helper.make_tensor_value_info(io.logits, TensorProto.FLOAT, ["batch_size", "logits_length", d.vocab_size])
    ]
    for i, layer in enumerate(d.layers):
        states = [] if layer.state_mixer is None else layer.state_mixer.states(io, i)  # (past, present, shape)
        for past_name, present_name, shape in states:
            inputs.append(helper.make_tensor_value_info(past_name, TensorProto.FLOAT, shape))
            outputs.append(helper.make_tensor_value_info(present_name, TensorProto.FLOAT, shape))
        if states:
            continue
        if layer.kv_source is not None:  # reads another layer's cache: none of its own
            continue
        _, n_kv_head, head_dim = d.heads(layer)
        kv_shape = ["batch_size", n_kv_head, "past_sequence_length", head_dim]
        present_shape = ["batch_size", n_kv_head, "present_sequence_length", head_dim]  # max(buffer, total)
        for past_name, present_name in zip(io.past(i), io.present(i), strict=True):
            inputs.append(helper.make_tensor_value_info(past_name, TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(present_name, TensorProto.FLOAT, present_shape))
    inputs.append(helper.make_tensor_value_info(io.logits_to_keep, TensorProto.INT64, []))  # overridable default
    return inputs, outputs
