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
Q4_1's w = d * q + m), and a tied embedding then gathers from the head's blocks.

The weights are not copied into the graph: its initializers are placeholders and the arrays travel beside
it, for edgelm.onnxfile.save_model to write one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgelm.nbits_gather import gather_from_nbits
from edgelm.onnxfile import SameBytes, placeholder

from ..runtime.contract import IONames
from .compact_blocks import write_blocks
from .decoder import Decoder, DeltaNet, Layer, Linear, NBits, Norm, ShortConv
from .lazy_weights import LazyArray

MS_DOMAIN = "com.microsoft"


def _nbits_names(prefix: str, nbits: NBits) -> tuple[str, str, str | None]:
    """MatMulNBits' B and scales, and the block offsets (None: the blocks have none)."""
    offsets = f"{prefix}.weight_block_offsets" if nbits.has_offsets else None
    return f"{prefix}.weight_Q{nbits.bits}", f"{prefix}.weight_scales", offsets


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


class _GraphBuilder:
    """Collects nodes and initializers; names every node after its output."""

    def __init__(self, *, accuracy_level: int, compact: bool):
        self.weight_nodes: list[onnx.NodeProto] = []  # compact blocks' unpacking, first in the graph
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []  # placeholders: the data is in `weights`
        self.weights: dict[str, np.ndarray] = {}
        self.value_info: list[onnx.ValueInfoProto] = []
        self.accuracy_level = accuracy_level  # MatMulNBits: 0 float activations, 4 int8 activations
        self.compact = compact  # kept blocks as bit planes and factors (export/compact_blocks.py)
        self.lora_inputs: list[onnx.ValueInfoProto] = []  # LoRA slots' A and B: overridable, zero-size by default
        # with KV sharing: a layer's prefix ("layers.3") -> the key and value inputs of its attention node, for the
        # layers that read its cache
        self.kv_inputs: dict[str, list[str]] | None = None

    def float_output(self, name: str, shape: list) -> str:
        """Declare a contrib op's output: ONNX shape inference cannot type com.microsoft nodes, and the
        quantizers need the type of every tensor a MatMul reads."""
        self.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def constant(self, name: str, array: np.ndarray) -> str:
        """An initializer; floating arrays but float16 ones are written as float32 (by save_model, no copy here)."""
        array = array if isinstance(array, LazyArray) else np.asarray(array)  # a LazyArray is read when written
        self.initializers.append(placeholder(name, array))
        self.weights[name] = array
        return name

    def small_constant(self, name: str, array: np.ndarray) -> str:
        """A Constant node, not an initializer: saving the weights as external data then never moves
        the values that shape inference needs (a ReduceSum's axes, a Slice's bounds)."""
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(array)))
        return name

    def op(self, op_type: str, inputs: list[str], output: str, *, domain: str = "", **attributes) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, domain=domain, **attributes))
        return output

    def weight_op(self, op_type: str, inputs: list[str], output: str, **attributes) -> str:
        """A node of constants only, which ONNX Runtime folds at load (export/compact_blocks.py)."""
        self.weight_nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attributes))
        return output

    def nbits_weights(self, prefix: str, nbits: NBits) -> tuple[str, str, str | None]:
        """MatMulNBits' B and scales and the block offsets (None: none), as initializers or, compact, as the
        outputs of nodes that compute them from smaller ones."""
        packed, scales, offsets = _nbits_names(prefix, nbits)
        if self.compact:
            write_blocks(self, nbits, packed=packed, scales=scales, offsets=offsets)
        else:  # unpacked (or quantized) when written, once for the three arrays (save_model writes them in turn)
            k, n = nbits.shape
            runs = k // nbits.block_size
            arrays = _NBitsArrays(nbits, 3 if offsets is not None else 2)
            self.constant(packed, LazyArray((n, runs, nbits.block_size * nbits.bits // 8), arrays.packed, np.uint8))
            self.constant(scales, LazyArray((n, runs), arrays.scales))
            if offsets is not None:
                self.constant(offsets, LazyArray((runs, n), arrays.block_offsets))
        return packed, scales, offsets

    def matmul_nbits(self, x: str, prefix: str, nbits: NBits, output: str) -> str:
        """x @ W on the blocks; with block offsets (Q4_1's w = d * q + m) the integer-zero-point product
        plus (block sums of x) @ offsets, which keeps ONNX Runtime on its fast kernels."""
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

    def split_qkv(self, qkv: str, prefix: str, d: Decoder, layer: Layer | None = None) -> list[str]:
        """Q, K and V split from the packed product (V is K's projection where the layer says so)."""
        n_head, n_kv_head, head_dim = d.heads(layer) if layer is not None else (d.n_head, d.n_kv_head, d.head_dim)
        widths = [n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim]
        names = [f"{prefix}/q", f"{prefix}/k", f"{prefix}/v"]
        if layer is not None and layer.value_is_key:
            widths, names = widths[:2], names[:2]
        sizes = self.small_constant(f"{prefix}/qkv_sizes", np.array(widths, dtype=np.int64))
        self.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{prefix}/qkv_Split", axis=-1))
        return names if len(names) == 3 else [*names, names[1]]

    def head_norm(
        self, x: str, prefix: str, name: str, weight: np.ndarray, heads: int, head_dim: int, eps: float
    ) -> str:
        """x (B, T, heads * hs) RMS-normalized over each head's values, times `weight` (hs,)."""
        shape = self.small_constant(f"{prefix}/{name}_head_shape", np.array([0, 0, -1, head_dim], dtype=np.int64))
        flat = self.small_constant(f"{prefix}/{name}_flat_shape", np.array([0, 0, -1], dtype=np.int64))
        split = self.op("Reshape", [x, shape], f"{prefix}/{name}_heads")  # (B, T, heads, hs)
        inputs = [split, self.constant(f"{prefix}.{name}_norm.weight", weight)]
        normed = self.op("SimplifiedLayerNormalization", inputs, f"{prefix}/{name}_norm", axis=-1, epsilon=eps)
        self.float_output(normed, ["batch_size", "sequence_length", heads, head_dim])
        return self.op("Reshape", [normed, flat], f"{prefix}/{name}_normed")  # (B, T, heads * hs)

    def head_norms(self, qkv: str, prefix: str, layer: Layer, decoder: Decoder) -> list[str]:
        """GroupQueryAttention's query, key and value inputs: the packed product alone, or, with per-head norms
        (Qwen3, Gemma 3), Q and K split from it and RMS-normalized over each head's head_dim values (V as it is,
        or weightless-normed: Gemma 4's v_norm)."""
        if layer.q_norm is None:
            return [qkv, "", ""]
        d = decoder
        n_head, n_kv_head, head_dim = d.heads(layer)
        if layer.attention_gate:  # the gate after V (Qwen3.5)
            widths = [n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim, n_head * head_dim]
            sizes = self.small_constant(f"{prefix}/qkv_sizes", np.array(widths, dtype=np.int64))
            names = [f"{prefix}/q", f"{prefix}/k", f"{prefix}/v", f"{prefix}/gate"]
            self.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{prefix}/qkv_Split", axis=-1))
        else:
            names = self.split_qkv(qkv, prefix, d, layer)
        q = self.head_norm(names[0], prefix, "q", layer.q_norm.weight, n_head, head_dim, d.norm_eps)
        k = self.head_norm(names[1], prefix, "k", layer.k_norm.weight, n_kv_head, head_dim, d.norm_eps)
        v = names[2]
        if layer.v_norm:
            v = self.head_norm(v, prefix, "v", np.ones(head_dim, np.float32), n_kv_head, head_dim, d.norm_eps)
        return [q, k, v]

    def rotated(self, qkv: list[str], prefix: str, d: Decoder, rotary: _Rotary) -> list[str]:
        """Q and K rotated before attention, each row at its own positions into the tables (com.microsoft
        RotaryEmbedding; the first rotary_dim values of each head), V as it is."""
        if qkv[1] == "":
            qkv = self.split_qkv(qkv[0], prefix, d)
        q, k, v = qkv
        width = 2 * d.rotary_cos.shape[1]
        inputs = [rotary.positions, *rotary.caches]
        q = self.op("RotaryEmbedding", [q, *inputs], f"{prefix}/q_rotary", domain=MS_DOMAIN, num_heads=d.n_head,
                    rotary_embedding_dim=width)  # fmt: skip
        k = self.op("RotaryEmbedding", [k, *inputs], f"{prefix}/k_rotary", domain=MS_DOMAIN, num_heads=d.n_kv_head,
                    rotary_embedding_dim=width)  # fmt: skip
        self.float_output(q, ["batch_size", "sequence_length", d.n_head * d.head_dim])
        self.float_output(k, ["batch_size", "sequence_length", d.n_kv_head * d.head_dim])
        return [q, k, v]

    def shared_inputs(self, qkv: str, prefix: str, layer: Layer, d: Decoder) -> list[str]:
        """A KV-shared layer's GroupQueryAttention inputs: its query (normed), and the key and value inputs of the
        layer it reads (kv_inputs), which that layer's node already wrote into the cache this node reads."""
        n_head, _, head_dim = d.heads(layer)
        q = qkv if layer.q_norm is None else self.head_norm(qkv, prefix, "q", layer.q_norm.weight, n_head, head_dim,
                                                            d.norm_eps)  # fmt: skip
        return [q, *self.kv_inputs[f"layers.{layer.kv_source}"]]

    def attention(
        self,
        h: str,
        prefix: str,
        layer: Layer,
        d: Decoder,
        io: tuple[tuple[str, str], tuple[str, str]],
        lengths: list[str],
        rotary: _Rotary | None,
    ) -> str:
        """One GroupQueryAttention node on the packed Q/K/V product of h; `lengths`: seqlens_k and the total length;
        `rotary`: the layer's rotary caches (None: no positions), applied inside the node or, where it cannot
        (per-row tables, a rotary width it does not take), before it. Returns its (B, T, n_head * head_dim) output."""
        past, present = io
        n_head, n_kv_head, head_dim = d.heads(layer)
        qkv = self.linear(h, f"{prefix}.qkv", layer.qkv)  # (B, T, (n_head + 2 n_kv_head) hs): Q, K, V packed
        if layer.kv_source is not None:  # Q alone: keys and values are another layer's, read from its cache
            inputs = self.shared_inputs(qkv, prefix, layer, d)
        else:
            inputs = self.head_norms(qkv, prefix, layer, d)
            if inputs[1] == "" and self.kv_inputs is not None:
                inputs = self.split_qkv(qkv, prefix, d, layer)
            if self.kv_inputs is not None:
                self.kv_inputs[prefix] = inputs[1:]
        # a sliding layer: its own rotary caches and window (ONNX Runtime 1.32's CPU kernel counts the query's
        # own position in local_window_size, as transformers' sliding_window does: checked against it)
        window = {} if layer.sliding_window is None else {"local_window_size": layer.sliding_window}
        inside = rotary is not None and rotary.positions is None
        if rotary is not None and not inside:
            inputs = self.rotated(inputs, prefix, d, rotary)
        caches = rotary.caches if inside else []
        self.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [*inputs, *past, *lengths, *caches],
                [f"{prefix}/attention", *present],
                name=f"{prefix}/GroupQueryAttention",
                domain=MS_DOMAIN,
                num_heads=n_head,
                kv_num_heads=n_kv_head,
                scale=d.attention_scale or 1.0 / float(np.sqrt(head_dim)),
                **({"do_rotary": 1, "rotary_interleaved": 0} if inside else {}),
                **window,
            )
        )
        out = self.float_output(f"{prefix}/attention", ["batch_size", "sequence_length", n_head * head_dim])
        if not layer.attention_gate:
            return out
        gate = self.op("Sigmoid", [f"{prefix}/gate"], f"{prefix}/gate/Sigmoid")
        return self.op("Mul", [out, gate], f"{prefix}/gated_attention")

    def short_conv(self, h: str, prefix: str, conv: ShortConv, d: Decoder, past: str, present: str) -> str:
        """A convolution layer (LFM2): in_proj, B * x through com.microsoft CausalConvWithState (its state
        `past` -> `present`, (B, n_embd, kernel - 1)), times C, out_proj. Returns its (B, T, n_embd) output."""
        gates = self.linear(h, f"{prefix}.conv.in_proj", conv.in_proj)  # (B, T, 3C)
        channels = self.op("Transpose", [gates], f"{prefix}/conv/Transpose", perm=[0, 2, 1])  # (B, 3C, T)
        sizes = self.small_constant(f"{prefix}/conv/sizes", np.array([d.n_embd] * 3, dtype=np.int64))
        b, c, x = (f"{prefix}/conv/{name}" for name in "bcx")
        self.nodes.append(helper.make_node("Split", [channels, sizes], [b, c, x], name=f"{prefix}/conv/Split", axis=1))
        gated = self.op("Mul", [b, x], f"{prefix}/conv/gated")
        bias = "" if conv.bias is None else self.constant(f"{prefix}.conv.bias", conv.bias)
        inputs = [gated, self.constant(f"{prefix}.conv.weight", conv.weight), bias, past]
        y = f"{prefix}/conv/CausalConvWithState"
        self.nodes.append(helper.make_node("CausalConvWithState", inputs, [y, present], name=y, domain=MS_DOMAIN))
        self.float_output(y, ["batch_size", d.n_embd, "sequence_length"])
        out = self.op(
            "Transpose", [self.op("Mul", [c, y], f"{prefix}/conv/out")], f"{prefix}/conv/back", perm=[0, 2, 1]
        )
        return self.linear(out, f"{prefix}.conv.out_proj", conv.out_proj)

    def delta_net(self, h: str, prefix: str, n: DeltaNet, d: Decoder, io: IONames, i: int) -> str:
        """A Gated DeltaNet layer (Qwen3.5): its conv state through com.microsoft CausalConvWithState (SiLU), the
        recurrence through com.microsoft GatedDeltaNet (io's past.%d.recurrent -> present.%d.recurrent), the
        gates in standard ops. Returns its (B, T, n_embd) output."""
        p = f"{prefix}/delta"
        mixed = self.linear(h, f"{prefix}.delta.in_proj", n.in_proj)  # (B, T, channels)
        channels = self.op("Transpose", [mixed], f"{p}/Transpose", perm=[0, 2, 1])
        conv = f"{p}/CausalConvWithState"
        inputs = [channels, self.constant(f"{prefix}.delta.conv.weight", n.conv_weight), "", io.past_conv % i]
        self.nodes.append(
            helper.make_node(
                "CausalConvWithState", inputs, [conv, io.present_conv % i], name=conv, domain=MS_DOMAIN,
                activation="silu",
            )
        )  # fmt: skip
        self.float_output(conv, ["batch_size", n.channels, "sequence_length"])
        qkv = self.op("Transpose", [conv], f"{p}/back", perm=[0, 2, 1])  # (B, T, channels)
        widths = [n.k_heads * n.k_dim, n.k_heads * n.k_dim, n.v_heads * n.v_dim]
        sizes = self.small_constant(f"{p}/sizes", np.array(widths, dtype=np.int64))
        names = [f"{p}/q", f"{p}/k", f"{p}/v"]
        self.nodes.append(helper.make_node("Split", [qkv, sizes], names, name=f"{p}/Split", axis=-1))
        heads = lambda x, count, size: self.op(  # noqa: E731
            "Reshape", [x, self.small_constant(f"{x}/shape", np.array([0, 0, count, size], np.int64))], f"{x}/heads"
        )
        axis = self.small_constant(f"{p}/last_axis", np.array([-1], dtype=np.int64))
        eps = self.small_constant(f"{p}/eps", np.array(1e-6, dtype=np.float32))
        normed = []
        for x in names[:2]:  # x / sqrt(sum(x^2) + 1e-6) per head, as transformers' l2norm
            x = heads(x, n.k_heads, n.k_dim)
            total = self.op("ReduceSum", [self.op("Mul", [x, x], f"{x}/sq"), axis], f"{x}/sum", keepdims=1)
            inverse = self.op(
                "Reciprocal", [self.op("Sqrt", [self.op("Add", [total, eps], f"{x}/eps")], f"{x}/sqrt")], f"{x}/inv"
            )
            normed.append(self.op("Mul", [x, inverse], f"{x}/l2"))
        v = heads(names[2], n.v_heads, n.v_dim)
        beta = self.op("Sigmoid", [self.linear(h, f"{prefix}.delta.b", n.b)], f"{p}/beta")  # (B, T, v_heads)
        raw = self.op(
            "Add",
            [self.linear(h, f"{prefix}.delta.a", n.a), self.constant(f"{prefix}.delta.dt_bias", n.dt_bias)],
            f"{p}/a",
        )
        decay_scale = self.constant(f"{prefix}.delta.neg_exp_a_log", -np.exp(n.a_log.astype(np.float32)))
        decay = self.op("Mul", [self.op("Softplus", [raw], f"{p}/softplus"), decay_scale], f"{p}/decay")
        rule = f"{p}/GatedDeltaNet"
        self.nodes.append(
            helper.make_node(
                "GatedDeltaNet", [*normed, v, "", decay, beta, io.past_recurrent % i], [rule, io.present_recurrent % i],
                name=rule, domain=MS_DOMAIN, update_rule="gated_delta",
            )
        )  # fmt: skip
        self.float_output(rule, ["batch_size", "sequence_length", n.v_heads, n.v_dim])
        inputs = [rule, self.constant(f"{prefix}.delta.norm.weight", n.norm.weight)]
        out = self.op("SimplifiedLayerNormalization", inputs, f"{p}/norm", axis=-1, epsilon=d.norm_eps)
        self.float_output(out, ["batch_size", "sequence_length", n.v_heads, n.v_dim])
        z = heads(self.linear(h, f"{prefix}.delta.z", n.z), n.v_heads, n.v_dim)
        gated = self.op(
            "Mul", [out, self.op("Mul", [z, self.op("Sigmoid", [z], f"{p}/z_sigmoid")], f"{p}/z_silu")], f"{p}/gated"
        )
        if n.out_heads is not None:
            order = self.small_constant(f"{p}/out_heads", n.out_heads)
            gated = self.op("Gather", [gated, order], f"{p}/reordered", axis=2)
        flat = self.small_constant(f"{p}/flat", np.array([0, 0, -1], dtype=np.int64))
        return self.linear(self.op("Reshape", [gated, flat], f"{p}/flat_out"), f"{prefix}.delta.out_proj", n.out_proj)

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

    def per_layer_inputs(self, x: str, d: Decoder, io: IONames) -> str:
        """(B, T, n_layer, D): the per-layer table's rows for each token (times sqrt(D)) plus the token
        embeddings x projected (times n_embd ** -0.5) and RMS-normed over D, times 2 ** -0.5 (Gemma 4)."""
        dim = d.per_layer_dim
        scalar = lambda name, value: self.small_constant(name, np.array(value, dtype=np.float32))  # noqa: E731
        if d.per_layer_embedding_nbits is not None:  # a stand-in table, rewired to read the blocks
            self.nbits_weights("per_layer.embed", d.per_layer_embedding_nbits)
            columns = self.op("Gather", ["per_layer.embed.weight_T", io.input_ids], "per_layer/Gather", axis=1)
            rows = self.op("Transpose", [columns], "per_layer/Transpose", perm=[1, 2, 0])  # (B, T, n_layer * D)
        else:
            table = self.constant("per_layer.embedding", d.per_layer_embedding)
            rows = self.op("Gather", [table, io.input_ids], "per_layer/Gather", axis=0)  # (B, T, n_layer * D)
        rows = self.op("Mul", [rows, scalar("per_layer/row_scale", dim**0.5)], "per_layer/rows")
        projected = self.linear(x, "per_layer.projection", d.per_layer_projection)
        projected = self.op(
            "Mul", [projected, scalar("per_layer/projection_scale", d.n_embd**-0.5)], "per_layer/scaled"
        )
        shape = self.small_constant("per_layer/shape", np.array([0, 0, d.n_layer, dim], dtype=np.int64))
        projected = self.op("Reshape", [projected, shape], "per_layer/projected")  # (B, T, n_layer, D)
        inputs = [projected, self.constant("per_layer.norm.weight", d.per_layer_norm.weight)]
        normed = self.op("SimplifiedLayerNormalization", inputs, "per_layer/norm", axis=-1, epsilon=d.norm_eps)
        self.float_output(normed, ["batch_size", "sequence_length", d.n_layer, dim])
        total = self.op("Add", [normed, self.op("Reshape", [rows, shape], "per_layer/rows_4d")], "per_layer/sum")
        return self.op("Mul", [total, scalar("per_layer/mean_scale", 2.0**-0.5)], "per_layer/inputs")

    def per_layer_step(self, x: str, prefix: str, layer: Layer, d: Decoder, inputs: str, index: int) -> str:
        """x + norm(proj(act(x W_gate) * layer `index`'s (B, T, D) per-layer input))."""
        part = layer.per_layer
        mine = self.op("Gather", [inputs, self.small_constant(f"{prefix}/per_layer_index", np.array(index))],
                       f"{prefix}/per_layer_input", axis=2)  # fmt: skip
        gate = self.linear(x, f"{prefix}.per_layer.gate", part.gate)  # (B, T, D)
        shape = ["batch_size", "sequence_length", d.per_layer_dim]
        act = self.float_output(self.op("FastGelu", [gate], f"{prefix}/per_layer/FastGelu", domain=MS_DOMAIN), shape)
        out = self.linear(self.op("Mul", [act, mine], f"{prefix}/per_layer/gated"), f"{prefix}.per_layer.projection",
                          part.projection)  # fmt: skip
        out = self.norm(out, f"{prefix}.per_layer.norm", part.norm, d)
        return self.op("Add", [x, out], f"{prefix}/per_layer_residual")


def build_fused_graph(
    decoder: Decoder, io: IONames, *, opset: int = 17, accuracy_level: int = 4, compact: bool = True
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The decoder as an ONNX graph with fused attention and a shared KV buffer, and its weights: initializer
    name -> array, for edgelm.onnxfile.save_model. accuracy_level: MatMulNBits' (blocks kept from a GGUF only);
    compact: kept blocks as bit planes and the file's factors, unpacked at load (export/compact_blocks.py),
    else as MatMulNBits' own arrays. io: the manifest's names; its logits_to_keep names the optional input."""
    assert io.logits_to_keep is not None, "the fused graph takes the number of positions to keep as an input"
    d = decoder
    g = _GraphBuilder(accuracy_level=accuracy_level, compact=compact)
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
    per_layer = g.per_layer_inputs(x, d, io) if d.per_layer_dim else None
    if any(layer.kv_source is not None for layer in d.layers):
        g.kv_inputs = {}

    h = g.norm(x, "layers.0.attention_norm", d.layers[0].attention_norm, d)
    for i, layer in enumerate(d.layers):
        p = f"layers.{i}"
        if layer.conv is not None:
            out = g.short_conv(h, p, layer.conv, d, io.past_conv % i, io.present_conv % i)
        elif layer.delta_net is not None:
            out = g.delta_net(h, p, layer.delta_net, d, io, i)
        else:
            caches = (local_rotary if layer.sliding_window is not None else rotary) if layer.rotary else None
            cache = (io.past(i), io.present(i))
            if layer.kv_source is not None:  # the source's present in, a present of its own that nothing reads out
                cache = (io.present(layer.kv_source), (f"{p}/present_key", f"{p}/present_value"))
            attention = g.attention(h, p, layer, d, cache, lengths, caches)
            out = g.linear(attention, f"{p}.attention_out", layer.attention_out)
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
                x = g.per_layer_step(x, p, layer, d, per_layer, i)
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
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    _gather_embedding_blocks(model, d, g.weights, compact=compact)
    if d.per_layer_embedding_nbits is not None:  # Gemma 4's per-layer table, kept as the file's blocks
        _gather_blocks(model, "per_layer/Gather", "per_layer.embed", d.per_layer_embedding_nbits)
    return model, g.weights


def _embeddings(g: _GraphBuilder, d: Decoder, io: IONames) -> tuple[str, str | None]:
    """(the token embeddings, scaled and with positions added where the family has them: (B, T, C); the LM
    head's (C, V) weight, or None when the head is blocks). Tied: one (C, V) matrix; the embedding gathers
    its columns."""
    head = None
    if d.tied or d.embedding_nbits is not None:
        # with blocks the Gather's table is a stand-in, rewired to read them (edgelm/nbits_gather.py): the
        # head's when tied, the embedding's own (V, C / block, blob) when not
        if d.tied:
            table = "lm_head.weight_T" if d.head_nbits is not None else g.constant("lm_head.weight_T", d.embedding.T)
            head = table
        else:
            g.nbits_weights("embed", d.embedding_nbits)  # offsets (C / block, V) too, where it has them
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


@dataclass
class _Rotary:
    caches: list[str]  # cos and sin tables
    positions: str | None = None  # (B, T) rows of the tables, per row; None: GroupQueryAttention rotates itself


def _rotary_caches(g: _GraphBuilder, d: Decoder, io: IONames, seqlens_k: str) -> tuple[_Rotary | None, _Rotary | None]:
    """The full layers' and the sliding layers' rotary caches (None where none). GroupQueryAttention rotates by
    them itself where it can: one table for every row, of a width that is a multiple of 8 (ONNX Runtime 1.32's
    rule). Otherwise Q and K rotate before it, by positions computed here as it computes them (0 .. T - 1 in a
    prompt, past .. past + T - 1 after), a LongRoPE row past rotary_long_after tokens reading the long tables,
    stacked after the short ones."""
    rotary = local_rotary = None
    if d.rotary_cos is not None:
        cos, sin = d.rotary_cos, d.rotary_sin
        if d.rotary_cos_long is not None:
            cos, sin = np.concatenate([cos, d.rotary_cos_long]), np.concatenate([sin, d.rotary_sin_long])
        rotary = _Rotary([g.constant("rotary.cos", cos), g.constant("rotary.sin", sin)])
        if d.rotary_cos_long is not None or d.rotary_cos.shape[1] % 8:
            rotary.positions = _row_positions(g, d, io, seqlens_k)
    if d.rotary_cos_local is not None:
        local = [g.constant("rotary.cos_local", d.rotary_cos_local)]
        local_rotary = _Rotary(local + [g.constant("rotary.sin_local", d.rotary_sin_local)])
    return rotary, local_rotary


def _row_positions(g: _GraphBuilder, d: Decoder, io: IONames, seqlens_k: str) -> str:
    """(B, T) int64: each row's positions, max(seqlens_k + 1 - T, 0) + 0 .. T - 1, plus the table length for a
    LongRoPE row longer than rotary_long_after (seqlens_k + 1 tokens)."""
    ids_shape = g.op("Shape", [io.input_ids], "positions/Shape")
    width = g.op("Gather", [ids_shape, g.small_constant("positions/one", np.array(1))], "positions/T", axis=0)
    zero = g.small_constant("positions/zero", np.array(0, dtype=np.int64))
    step = g.small_constant("positions/step", np.array(1, dtype=np.int64))
    offsets = g.op("Range", [zero, width, step], "positions/Range")  # (T,)
    lengths = g.op("Add", [g.op("Cast", [seqlens_k], "positions/lengths", to=TensorProto.INT64), step],
                   "positions/total")  # fmt: skip
    start = g.op("Max", [g.op("Sub", [lengths, width], "positions/Sub"), zero], "positions/start")  # (B,)
    if d.rotary_long_after is not None:
        after = g.small_constant("positions/long_after", np.array(d.rotary_long_after, dtype=np.int64))
        long = g.op("Cast", [g.op("Greater", [lengths, after], "positions/long")], "positions/long_int",
                    to=TensorProto.INT64)  # fmt: skip
        table = g.small_constant("positions/table", np.array(d.rotary_cos.shape[0], dtype=np.int64))
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
        if layer.conv is not None:  # a convolution layer's state, (B, n_embd, kernel - 1)
            state = ["batch_size", d.n_embd, layer.conv.kernel - 1]
            inputs.append(helper.make_tensor_value_info(io.past_conv % i, TensorProto.FLOAT, state))
            outputs.append(helper.make_tensor_value_info(io.present_conv % i, TensorProto.FLOAT, state))
            continue
        if layer.delta_net is not None:  # (B, channels, kernel - 1) and (B, v_heads, v_dim, k_dim)
            n = layer.delta_net
            for kind, state in (("conv", ["batch_size", n.channels, n.kernel - 1]),
                                ("recurrent", ["batch_size", n.v_heads, n.v_dim, n.k_dim])):  # fmt: skip
                inputs.append(helper.make_tensor_value_info(getattr(io, f"past_{kind}") % i, TensorProto.FLOAT, state))
                outputs.append(
                    helper.make_tensor_value_info(getattr(io, f"present_{kind}") % i, TensorProto.FLOAT, state)
                )
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


def _gather_embedding_blocks(model: onnx.ModelProto, d: Decoder, weights: dict, *, compact: bool) -> None:
    """Rewire the embedding's stand-in Gather to gather rows of blocks (the head's, when tied), if there are any.
    Tied plain blocks are gathered through initializers of their own that point at the head's bytes (SameBytes):
    ONNX Runtime maps them apart from the ones MatMulNBits prepacks and lets go, so the head's pages need not stay
    resident for the few rows a step gathers (runtime/session.py drops them; compact blocks are computed at load,
    and the gather reads the computed tensors)."""
    table, prefix = (d.head_nbits, "lm_head") if d.tied else (d.embedding_nbits, "embed")
    if table is not None:
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
