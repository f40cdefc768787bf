"""Build the decoder's ONNX graph directly from the reference model's weights, with ONNX Runtime's
fused operators: the fast graph edgelm exports by default.

The traced graph (onnx_export.export_onnx) is portable ONNX: attention there is a dozen standard
ops per layer, and each decode step concatenates the whole past onto the new keys/values, copying
the cache. This graph runs attention as one com.microsoft GroupQueryAttention node per layer, fed
the packed Q/K/V product, and its cache is one preallocated buffer per layer that serves as both
past_key_values.{i}.* and present.{i}.*: a decode step writes one position into it, in place
(onnxruntime-genai's model builder makes the same choice, `past_present_share_buffer`).

    inputs   input_ids (B, T) int64, attention_mask (B, total) int64, position_ids (B, T) int64,
             past_key_values.{i}.key / .value (B, n_head, capacity, head_dim) float32,
             num_logits_to_keep () int64, optional: 0 (the default) = every position, k = the last k
    outputs  logits (B, T or k, vocab) float32,
             present.{i}.key / .value (B, n_head, max(capacity, total), head_dim) float32

Padding is on the right: row b's real tokens fill positions 0 .. len_b - 1 of the buffer and
attention_mask row b is len_b ones followed by zeros; GroupQueryAttention reads each row's length
(seqlens_k = len_b - 1) and the batch's longest total (the mask's width) from it. With the buffer
bound as both past and present (IO binding), nothing is copied; fed as separate arrays, the graph
also runs with a growing cache, as the traced graph does.

Node by node the graph is the reference model: token + position embeddings; per block
LayerNorm -> c_attn -> GroupQueryAttention -> c_proj -> residual, LayerNorm -> c_fc -> GELU
(com.microsoft FastGelu for GPT-2's tanh form, Gelu for the exact one) -> c_proj -> residual;
final LayerNorm; LM head. Linear layers stay MatMul + Add with constant weights, so quantize/
finds and quantizes them as in the traced graph, and a tied embedding is one (n_embd, vocab)
matrix read by both the LM head and a Gather along axis 1, as export_onnx stores it.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from .model import GPT

MS_DOMAIN = "com.microsoft"
LOGITS_TO_KEEP = "num_logits_to_keep"


class _GraphBuilder:
    """Collects nodes and initializers; names every node after its output."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []

    def float_output(self, name: str, shape: list) -> str:
        """Declare a contrib op's output: ONNX shape inference cannot type com.microsoft nodes, and the
        quantizers need the type of every tensor a MatMul reads."""
        self.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def constant(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array).copy(order="C"), name))  # 0-d stays 0-d
        return name

    def small_constant(self, name: str, array: np.ndarray) -> str:
        """A Constant node, not an initializer: saving the weights as external data then never moves
        the values that shape inference needs (a ReduceSum's axes, a Slice's bounds)."""
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(array)))
        return name

    def weight(self, name: str, tensor: torch.Tensor) -> str:
        return self.constant(name, tensor.detach().to(torch.float32).cpu().numpy())

    def op(self, op_type: str, inputs: list[str], output: str, *, domain: str = "", **attributes) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, domain=domain, **attributes))
        return output

    def linear(self, x: str, prefix: str, layer: torch.nn.Linear) -> str:
        # nn.Linear stores (out, in); MatMul wants (in, out)
        product = self.op("MatMul", [x, self.weight(f"{prefix}.weight", layer.weight.T)], f"{prefix}/MatMul")
        return self.op("Add", [product, self.weight(f"{prefix}.bias", layer.bias)], f"{prefix}/Add")

    def layer_norm(self, x: str, prefix: str, norm: torch.nn.LayerNorm) -> str:
        inputs = [x, self.weight(f"{prefix}.weight", norm.weight), self.weight(f"{prefix}.bias", norm.bias)]
        return self.op("LayerNormalization", inputs, f"{prefix}/LayerNorm", axis=-1, epsilon=norm.eps)


def build_fused_graph(model: GPT, *, opset: int = 17) -> onnx.ModelProto:
    """The reference model as an ONNX graph with fused attention and a shared KV buffer."""
    config = model.config
    model = model.eval()
    g = _GraphBuilder()
    n_head, head_dim = config.n_head, config.head_dim
    one = g.small_constant("const_one", np.array(1, dtype=np.int64))
    axis_1 = g.small_constant("const_axis_1", np.array([1], dtype=np.int64))

    # Token embedding. Tied: one (n_embd, vocab) matrix; the embedding gathers its columns.
    wte = model.transformer.wte.weight  # (V, C)
    if config.tie_word_embeddings:
        table = g.weight("lm_head.weight_T", wte.T)  # (C, V)
        columns = g.op("Gather", [table, "input_ids"], "wte/Gather", axis=1)  # (C, B, T)
        tokens = g.op("Transpose", [columns], "wte/Transpose", perm=[1, 2, 0])  # (B, T, C)
        head = table
    else:
        tokens = g.op("Gather", [g.weight("transformer.wte.weight", wte), "input_ids"], "wte/Gather", axis=0)
        head = g.weight("lm_head.weight_T", model.lm_head.weight.T)
    if config.positional == "learned":
        positions_table = g.weight("transformer.wpe.weight", model.transformer.wpe.weight)
    else:
        positions_table = g.weight("sinusoid", model.sinusoid)
    positions = g.op("Gather", [positions_table, "position_ids"], "wpe/Gather", axis=0)
    x = g.op("Add", [tokens, positions], "embeddings/Add")  # (B, T, C)

    # Each row's length and the longest total, from the attention mask, for every attention node.
    lengths = g.op("ReduceSum", ["attention_mask", axis_1], "mask/ReduceSum", keepdims=0)  # (B,)
    last_index = g.op("Sub", [lengths, one], "mask/Sub")
    seqlens_k = g.op("Cast", [last_index], "seqlens_k", to=TensorProto.INT32)
    mask_shape = g.op("Shape", ["attention_mask"], "mask/Shape")
    total = g.op("Gather", [mask_shape, one], "mask/Gather", axis=0)
    total_length = g.op("Cast", [total], "total_sequence_length", to=TensorProto.INT32)

    for i, block in enumerate(model.transformer.h):
        p = f"transformer.h.{i}"
        h = g.layer_norm(x, f"{p}.ln_1", block.ln_1)
        qkv = g.linear(h, f"{p}.attn.c_attn", block.attn.c_attn)  # (B, T, 3C): Q, K, V packed
        g.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total_length],
                [f"{p}/attn", f"present.{i}.key", f"present.{i}.value"],
                name=f"{p}/GroupQueryAttention",
                domain=MS_DOMAIN,
                num_heads=n_head,
                kv_num_heads=n_head,
                scale=1.0 / float(np.sqrt(head_dim)),
            )
        )
        attention = g.float_output(f"{p}/attn", ["batch_size", "sequence_length", config.n_embd])
        x = g.op("Add", [x, g.linear(attention, f"{p}.attn.c_proj", block.attn.c_proj)], f"{p}/attn_residual")
        h = g.layer_norm(x, f"{p}.ln_2", block.ln_2)
        h = g.linear(h, f"{p}.mlp.c_fc", block.mlp.c_fc)
        gelu = "Gelu" if config.activation == "gelu" else "FastGelu"  # exact erf form, or GPT-2's tanh form
        h = g.op(gelu, [h], f"{p}.mlp/{gelu}", domain=MS_DOMAIN)
        g.float_output(h, ["batch_size", "sequence_length", config.inner_dim])
        x = g.op("Add", [x, g.linear(h, f"{p}.mlp.c_proj", block.mlp.c_proj)], f"{p}/mlp_residual")

    # Keep the last k positions before the final LayerNorm and LM head: Slice(x, -k:) is every
    # position for k = 0 (the default, for evaluation) and the last one for k = 1 (generation).
    g.constant(LOGITS_TO_KEEP, np.array(0, dtype=np.int64))
    negated = g.op("Neg", [LOGITS_TO_KEEP], "keep/Neg")
    start = g.op("Unsqueeze", [negated, g.small_constant("const_axis_0", np.array([0]))], "keep/start")
    end = g.small_constant("const_int64_max", np.array([np.iinfo(np.int64).max], dtype=np.int64))
    x = g.op("Slice", [x, start, end, axis_1], "keep/Slice")
    x = g.layer_norm(x, "transformer.ln_f", model.transformer.ln_f)
    g.op("MatMul", [x, head], "logits")

    kv_shape = ["batch_size", n_head, "past_sequence_length", head_dim]
    present_shape = ["batch_size", n_head, "present_sequence_length", head_dim]  # max(past buffer, total)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "logits_length", config.vocab_size])
    ]
    for i in range(config.n_layer):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, present_shape))
    inputs.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, []))  # overridable default

    graph = helper.make_graph(g.nodes, "edgelm-gpt2-fused", inputs, outputs, g.initializers, value_info=g.value_info)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def check_parity_shared(model: GPT, onnx_path, *, decode_steps: int = 5, seed: int = 0) -> float:
    """Max |logit difference| between PyTorch and ONNX Runtime for the fused graph, run the way the
    runtime runs it: a batch of 2 right-padded prompts of different lengths with all-position logits,
    then one-token steps with num_logits_to_keep = 1, the cache one buffer per layer bound as both
    past and present. PyTorch gets the same rows with its own (growing, masked) cache."""
    import onnxruntime as ort

    config = model.config
    options = ort.SessionOptions()
    options.log_severity_level = 3  # not the notice that num_logits_to_keep, an input, is not folded
    options.add_session_config_entry("session.disable_prepacking", "1")  # no second copy of the weights
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(seed)
    lengths = [min(7, config.n_positions - decode_steps), min(5, config.n_positions - decode_steps)]
    width = max(lengths)
    capacity = width + decode_steps
    input_ids = torch.randint(0, config.vocab_size, (2, width), generator=generator)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    position_ids = torch.arange(width).unsqueeze(0).expand(2, width) * mask  # padding at position 0

    buffers = []
    for _ in range(2 * config.n_layer):
        zeros = np.zeros((2, config.n_head, capacity, config.head_dim), dtype=np.float32)
        buffers.append(ort.OrtValue.ortvalue_from_numpy(zeros))
    binding = session.io_binding()
    binding.bind_output("logits")  # first, so it is get_outputs()[0]; allocated by each run
    for i in range(config.n_layer):
        for j, kind in enumerate(("key", "value")):
            binding.bind_ortvalue_input(f"past_key_values.{i}.{kind}", buffers[2 * i + j])
            binding.bind_ortvalue_output(f"present.{i}.{kind}", buffers[2 * i + j])

    def ort_logits(ids, ort_mask, positions, keep):
        binding.bind_cpu_input("input_ids", ids.numpy())
        binding.bind_cpu_input("attention_mask", ort_mask)
        binding.bind_cpu_input("position_ids", positions.numpy())
        # an overridable initializer: IO binding takes it as an OrtValue, not through bind_cpu_input
        binding.bind_ortvalue_input(LOGITS_TO_KEEP, ort.OrtValue.ortvalue_from_numpy(np.array(keep, dtype=np.int64)))
        binding.bind_output("logits")  # unallocated again: its length changes between calls
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    worst = 0.0
    with torch.no_grad():
        torch_logits, torch_past = model(input_ids, mask, position_ids)
        logits = ort_logits(input_ids, mask.numpy(), position_ids, 0)
        real = mask.bool().numpy()
        worst = max(worst, float(np.abs(logits - torch_logits.numpy())[real].max()))
        totals = list(lengths)
        next_ids = torch.stack([torch_logits[row, totals[row] - 1].argmax() for row in range(2)]).unsqueeze(1)
        torch_mask = mask
        for _ in range(decode_steps):
            positions = torch.tensor(totals).unsqueeze(1)  # (2, 1)
            torch_mask = torch.cat([torch_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            torch_logits, torch_past = model(next_ids, torch_mask, positions, torch_past)
            totals = [t + 1 for t in totals]
            ort_mask = (np.arange(max(totals))[None, :] < np.array(totals)[:, None]).astype(np.int64)
            logits = ort_logits(next_ids, ort_mask, positions, 1)
            assert logits.shape == tuple(torch_logits.shape), f"ONNX logits {logits.shape} vs {torch_logits.shape}"
            worst = max(worst, float(np.abs(logits - torch_logits.numpy()).max()))
            next_ids = torch_logits[:, -1, :].argmax(-1, keepdim=True)
    return worst
