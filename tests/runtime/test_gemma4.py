"""Gemma 4's KV sharing through the package and the runtime: the manifest says which layer reads which layer's
cache and each layer's cache shape, the graph has no cache inputs or outputs for the layers that read another's,
the runtime's buffers are that much smaller, and a conversation kept across turns (undo and prompt lookup
included) equals fresh runs, on both graphs. tests/export/test_families.py holds the transformers parity of the Gemma 4
cases (tests/family_cases.py), batch 1 and padded, with and without sharing."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
from chat_package import make_chat_package
from family_cases import PROMPTS
from helpers import quiet
from test_hybrid import QUESTIONS, SYSTEM, check_turns

from edgelm.runtime import load
from edgelm.runtime.contract import Manifest
from edgelm.runtime.errors import PackageError
from edgelm.runtime.kvcache import kv_cache_bytes, make_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KV_SOURCE = [0, 1, 2, 3, 3, 2]  # layers 4 (sliding) and 5 (full) read layers 3 and 2


def test_the_manifest_says_which_layer_reads_which_cache(families):
    package = families.package("gemma4_text-shared", "fused")
    arch = json.loads((package / "edgelm.json").read_text())["architecture"]
    assert arch["kv_source"] == KV_SOURCE
    assert arch["layer_head_dim"] == [16, 16, 32, 16, 16, 32]
    assert not (package / "genai_config.json").exists()  # onnxruntime-genai 0.18 builds no KV sharing
    names = {i.name for i in onnx.load(package / "model.onnx", load_external_data=False).graph.input}
    assert "past_key_values.3.key" in names and not {"past_key_values.4.key", "past_key_values.5.value"} & names
    data = json.loads((package / "edgelm.json").read_text())
    data["architecture"]["kv_source"] = [0, 1, 2, 3, 5, 2]  # a layer reading a later one
    with pytest.raises(PackageError, match="kv_source"):
        Manifest.parse(data)


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_the_runtime_keeps_only_the_cache_keeping_layers(graph, families):
    model = load(families.package("gemma4_text-shared", graph), provider="cpu")
    cache = make_cache(model, [PROMPTS[0]], capacity=64)
    cache.prompt()
    held = cache.buffers if graph == "fused" else [value.numpy() for value in cache.past]
    assert len(held) == 8  # 4 layers of 6 keep a key and a value
    held_bytes = sum(b.numpy().nbytes if graph == "fused" else b.nbytes for b in held)
    length = 64 if graph == "fused" else len(PROMPTS[0])
    assert held_bytes == kv_cache_bytes(model.spec, batch=1, capacity=length)
    unshared = copy.deepcopy(model.spec)
    unshared.arch.kv.kv_source = None
    # per position: 2 x (3 sliding x 2 heads x 16 + 1 full x 2 x 32) floats shared, (4 x 2 x 16 + 2 x 2 x 32) not
    assert (
        kv_cache_bytes(model.spec, batch=1, capacity=100) * 512 == kv_cache_bytes(unshared, batch=1, capacity=100) * 320
    )


@pytest.fixture(scope="module", params=["fused", "standard"])
def chat(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4") / f"gemma4-chat-{request.param}"
    return load(make_chat_package(out, family="gemma4", layers=6, attention=request.param), provider="cpu", threads=1)


def test_a_conversation_keeps_its_cache_and_undo_equals_a_fresh_chat(chat):
    conv = chat.conversation(system=SYSTEM)
    turns = check_turns(chat, conv, QUESTIONS)  # each reply equals a fresh generation from the whole history
    for (reply, _), (_, turn) in zip(turns, turns[1:], strict=False):
        assert turn.reused_tokens >= len(reply.prompt_token_ids)  # the kept cache was used
    conv.undo()
    again = conv.send(QUESTIONS[2], 40, speculative="lookup")  # rewinds past rejected guesses
    assert again.token_ids == chat.generate(again.prompt_token_ids, 40).token_ids


def test_prompt_lookup_and_a_padded_batch_give_the_plain_greedy_ids(chat):
    for prompt in (PROMPTS[1] * 3, PROMPTS[2]):
        plain = chat.generate(prompt, 60, ignore_eos=True)
        assert chat.generate(prompt, 60, ignore_eos=True, speculative="lookup").token_ids == plain.token_ids
    alone = [chat.generate(p, 20, ignore_eos=True).token_ids for p in PROMPTS]
    assert [r.token_ids for r in chat.generate_batch(PROMPTS, 20, ignore_eos=True)] == alone


def test_what_gemma4_lacks_is_refused_in_one_line(tmp_path):
    from edgelm.export.checkpoint import CheckpointError
    from edgelm.export.families.gemma4 import config_from_hf

    base = {"model_type": "gemma4_text", "num_hidden_layers": 2, "eos_token_id": 1}
    for key, value in (("enable_moe_block", True), ("use_bidirectional_attention", "all")):
        with pytest.raises(CheckpointError, match=key):
            config_from_hf(base | {key: value})
    with pytest.raises(CheckpointError, match="per_layer_config"):
        config_from_hf(base | {"per_layer_config": {"0": {"head_dim": 64}}})  # a sliding layer's
    assert np.isfinite(config_from_hf(base).rope_theta)


def test_export_quantize_covers_the_per_layer_linears(families, tmp_path):
    from edgelm.export.onnx_export import export_package

    folder = families.model("gemma4_text-shared")[1]
    with pytest.raises(ValueError, match="does not divide a linear layer's 16 inputs"):  # the per-layer width
        export_package(folder, tmp_path / "q32", quantize="int4", progress=quiet)
    manifest = export_package(folder, tmp_path / "q16", quantize="int4", block_size=16, progress=quiet)
    assert manifest["precision"] == "int4"  # export's proof passed against the reference on the same blocks
    graph = onnx.load(tmp_path / "q16" / "model.onnx", load_external_data=False).graph
    assert not [n for n in graph.node if n.op_type == "MatMul" and "per_layer" in n.name]  # all MatMulNBits
    assert len(load(tmp_path / "q16", provider="cpu").generate(PROMPTS[0], 8, ignore_eos=True).token_ids) == 8


def test_quantize_int4_finds_the_soft_capped_head_and_fp16_is_refused(families, tmp_path):
    from edgelm.quantize.quantize import quantize_package

    package = families.package("gemma4_text-shared", "fused")
    quantize_package(package, tmp_path / "int4", mode="int4", block_size=16, progress=quiet)  # head: Div, Tanh, Mul
    assert len(load(tmp_path / "int4", provider="cpu").generate(PROMPTS[0], 8, ignore_eos=True).token_ids) == 8
    with pytest.raises(ValueError, match="share a cache"):  # ONNX Runtime 1.32 segfaults optimizing that graph
        quantize_package(package, tmp_path / "fp16", mode="fp16", progress=quiet)


@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
def test_a_gguf_whose_layers_are_all_one_kind_exports_and_equals_transformers(kind, tmp_path):
    """A sliding_window_pattern all full or all sliding: the one kind's KV heads stand for both (the export raised
    KeyError: 'pop from an empty set')."""
    import torch
    import transformers
    from family_cases import GEMMA4, write_gguf

    from edgelm.export.onnx_export import export_package

    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**(GEMMA4 | {"layer_types": [kind] * 6}))
    hf = transformers.Gemma4ForCausalLM(config).eval()
    source = write_gguf(hf, tmp_path / "gemma4.gguf")
    export_package(source, tmp_path / "package", progress=quiet)
    model = load(tmp_path / "package", provider="cpu", threads=1)
    ids = np.array([PROMPTS[2]], dtype=np.int64)
    logits, _ = model.forward(ids)
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids)).logits.numpy()
    assert float(np.abs(logits - reference).max()) < 1e-3
