"""The standard graph: the reference model traced to ONNX (TorchScript exporter), standard ops only.

Attention is a dozen standard ops per layer and each step concatenates the whole past onto the new
keys/values; slower than the fused graph (export/graph.py), but it runs on any ONNX runtime. One
graph serves the prompt (past length 0) and every decode step:

    inputs   input_ids (B, T), attention_mask (B, past + T), position_ids (B, T), past keys / values
             (B, n_kv_head, past, head_dim)
    outputs  logits (B, T, vocab) [(B, 1, vocab) with last_token_logits], present keys / values
             (B, n_kv_head, past + T, head_dim)
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ..runtime.contract import MODEL_FILE, Architecture, IONames, cache_records
from .mechanisms import delta_net


def state_layout(model: torch.nn.Module) -> dict:
    """The manifest's cache fields a reference model has beyond heads and head size: a hybrid's layer_types,
    conv_state and recurrent_state (export/models/lfm2.py), Gemma 4's kv_source and per-layer shapes
    (export/models/gemma4.py); {} for the others, whose every layer holds a key and a value of one shape."""
    return model.state_layout() if hasattr(model, "state_layout") else {}


def cache_architecture(model: torch.nn.Module) -> Architecture:
    """The contract's view of a reference model's cache: which tensors, of which shapes (Architecture.cache_layers,
    cache_shape), for the export checks and the traced graph's names."""
    c = model.config
    return Architecture(
        type="", vocab_size=c.vocab_size, context_length=c.n_positions, n_layer=c.n_layer,
        n_head=c.n_head, n_kv_head=c.n_kv_head, head_dim=c.head_dim, **cache_records(state_layout(model)),
    )  # fmt: skip


def io_names(arch: Architecture, io: IONames) -> tuple[list[str], list[str]]:
    """The graph's input and output names in _FlatDecoder's order."""
    inputs = [io.input_ids, io.attention_mask, io.position_ids, *arch.past_names(io)]
    return inputs, [io.logits, *arch.present_names(io)]


class _FlatDecoder(torch.nn.Module):
    """The model with flat tensor inputs and outputs, in the order of io_names(): each layer's cache tensors (key
    and value, or a hybrid layer's states) one after another."""

    def __init__(self, model: torch.nn.Module, last_token_logits: bool):
        super().__init__()
        self.model = model
        self.last_token_logits = last_token_logits
        layers = [layer for layer, _ in cache_architecture(model).cache_layers()]
        self.counts = [layers.count(layer) for layer in dict.fromkeys(layers)]  # per cache-keeping layer

    def forward(self, input_ids, attention_mask, position_ids, *past_flat):
        starts = [sum(self.counts[:i]) for i in range(len(self.counts))]
        past = [tuple(past_flat[start : start + n]) for start, n in zip(starts, self.counts, strict=True)]
        logits, present = self.model(
            input_ids, attention_mask, position_ids, past, last_token_logits=self.last_token_logits
        )
        return (logits, *[t for pair in present for t in pair])


def _share_tied_embedding(model: onnx.ModelProto) -> None:
    """Store a tied embedding once. The exporter folds the LM head's Transpose(wte) into a second
    initializer W^T (n_embd, vocab); we keep only W^T and let the embedding gather columns of it:
    Gather(W^T, ids, axis=1) -> (n_embd, B, T), then Transpose -> (B, T, n_embd)."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits]
    matmuls = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    for gather in gathers:
        table = numpy_helper.to_array(inits[gather.input[0]])
        if table.ndim != 2:
            continue
        for matmul in matmuls:
            head = inits[matmul.input[1]]
            if tuple(head.dims) != table.shape[::-1] or not np.array_equal(numpy_helper.to_array(head), table.T):
                continue
            gathered = gather.output[0] + "_columns"
            columns = helper.make_node(
                "Gather", [matmul.input[1], gather.input[1]], [gathered], axis=1, name=gather.name + "_columns"
            )
            transpose = helper.make_node(
                "Transpose", [gathered], [gather.output[0]], perm=[1, 2, 0], name=gather.name + "_rows"
            )
            index = list(graph.node).index(gather)
            graph.node.remove(gather)
            graph.node.insert(index, transpose)
            graph.node.insert(index, columns)
            graph.initializer.remove(inits[gather.input[0]])
            return


# Placeholder nodes a reference model's torch.autograd.Function emits (its `symbolic`, domain "edgelm") for what
# has no practical standard form, and ONNX Runtime's contrib op each becomes: op name -> (its attributes, the
# positions of the optional inputs the placeholder leaves out), from the mechanisms that have one (export/mechanisms/).
MICROSOFT_OPS = {delta_net.PLACEHOLDER: delta_net.CONTRIB}


def _microsoft_ops(model: onnx.ModelProto) -> None:
    """The placeholders as com.microsoft nodes, the skipped optional inputs given as empty names."""
    found = False
    for node in model.graph.node:
        if node.domain == "edgelm" and node.op_type in MICROSOFT_OPS:
            attributes, skipped = MICROSOFT_OPS[node.op_type]
            inputs = list(node.input)
            for position in skipped:
                inputs.insert(position, "")
            del node.input[:]
            node.input.extend(inputs)
            node.domain = "com.microsoft"
            node.attribute.extend(helper.make_attribute(k, v) for k, v in attributes.items())
            found = True
    imports = [o for o in model.opset_import if o.domain != "edgelm"]
    del model.opset_import[:]
    model.opset_import.extend(imports + ([helper.make_opsetid("com.microsoft", 1)] if found else []))


def trace_graph(model: torch.nn.Module, *, io: IONames, opset: int, last_token_logits: bool = False) -> onnx.ModelProto:
    """The reference model traced to ONNX with the manifest's I/O names (`io`); a tied embedding is stored once
    (see _share_tied_embedding)."""
    config = model.config
    model = model.eval()
    layout = state_layout(model)
    arch = cache_architecture(model)
    input_names, output_names = io_names(arch, io)
    # Trace with distinct sizes (batch 2, 3 new tokens, 5 past) so no axis is mistaken for another.
    batch, seq, past = 2, 3, 5
    dummy = [
        torch.randint(0, config.vocab_size, (batch, seq)),
        torch.ones(batch, past + seq, dtype=torch.long),
        torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous(),
    ]
    kinds = arch.cache_kinds()
    dummy += [torch.zeros(arch.cache_shape(kind, batch, layer, past)) for layer, kind in arch.cache_layers()]
    ids, mask, positions = input_names[:3]
    dynamic_axes = {
        ids: {0: "batch_size", 1: "sequence_length"},
        mask: {0: "batch_size", 1: "total_sequence_length"},
        positions: {0: "batch_size", 1: "sequence_length"},
        output_names[0]: {0: "batch_size", 1: "sequence_length"} if not last_token_logits else {0: "batch_size"},
    }
    for name, kind in zip(input_names[3:], kinds, strict=True):
        dynamic_axes[name] = (
            {0: "batch_size", 2: "past_sequence_length"} if kind in ("key", "value") else {0: "batch_size"}
        )
    for name, kind in zip(output_names[1:], kinds, strict=True):
        dynamic_axes[name] = (
            {0: "batch_size", 2: "total_sequence_length"} if kind in ("key", "value") else {0: "batch_size"}
        )

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
        traced_path = Path(tmp) / MODEL_FILE
        torch.onnx.export(
            _FlatDecoder(model, last_token_logits),
            tuple(dummy),
            str(traced_path),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
            # the placeholders' domain, where a layer has one (a recurrent state's rule); torch warns of it otherwise
            custom_opsets={"edgelm": 1} if "recurrent_state" in layout else None,
        )
        onnx_model = onnx.load(str(traced_path))  # loads external data too, if the exporter wrote any

    _microsoft_ops(onnx_model)
    if last_token_logits:  # one position: said in the graph, where the tracer left a name (a hybrid's graph)
        onnx_model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 1
    if config.tie_word_embeddings:
        _share_tied_embedding(onnx_model)
    return onnx_model
