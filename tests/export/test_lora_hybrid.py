"""LoRA on the hybrid families, LFM2 and Qwen3.5: a random PEFT adapter on every linear (attention, the short
convolution's or the Gated DeltaNet's in/out projections and gates, the MLP) merged at export on both graphs, and
converted for a fused base with slots, gives transformers + peft's logits (1e-4) and greedy ids. Slots sit only in
the layers that hold their linear, and Qwen3.5's q_proj (each head's query then its gate) lands in the packed
[Q, K, V, gate] linear's query and gate columns. onnxruntime-genai runs the slotted packages with the adapter, and
eight threads with and without it get what each gets alone."""

from __future__ import annotations

import copy
import json
import threading

import numpy as np
import pytest
import torch
from helpers import quiet, save_peft_adapter, torch_greedy

from edgelm.export.lora import SlotSpec, convert_adapter
from edgelm.export.onnx_export import export_package
from edgelm.runtime import load

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 99, 1200, 7, 640, 33, 1800, 412]
NEW_TOKENS = 12
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5_text"])
def case(request, families, tmp_path_factory) -> dict:
    """The tiny base, its all-linear PEFT adapter (rank 4, alpha 4: a larger scale makes the random recurrence
    sensitive past float32's 1e-4), the merged packages of both graphs and a fused package with slots."""
    name = request.param
    hf, folder = families.model(name)
    root = tmp_path_factory.mktemp(f"lora-{name}")
    reference = save_peft_adapter(hf, root / "adapter", r=4, targets="all-linear", lora_alpha=4, seed=7)
    for graph in ("fused", "standard"):
        export_package(folder, root / graph, attention=graph, lora=[(root / "adapter", 1.0)], progress=quiet)
    export_package(folder, root / "slots", lora_slots=SlotSpec(["all"], 8), progress=quiet)
    adapter = convert_adapter(root / "adapter", root / "slots", root / "adapter.onnx_adapter")
    merged = copy.deepcopy(reference).merge_and_unload()  # PEFT's merged transformers model: the greedy reference
    return {"name": name, "hf": hf, "root": root, "reference": reference, "merged": merged, "adapter": adapter}


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_merged_adapter_equals_peft_on_both_graphs(case, graph):
    expected = _logits(case["reference"])
    assert np.abs(_logits(case["hf"]) - expected).max() > 1e-1  # the adapter matters
    model = load(case["root"] / graph, provider="cpu", threads=1)
    logits, _ = model.forward(np.array([PROMPT]))
    assert np.abs(logits[0] - expected).max() < TOLERANCE
    tokens = model.generate(PROMPT, NEW_TOKENS, ignore_eos=True).token_ids
    assert tokens == torch_greedy(case["merged"], PROMPT, NEW_TOKENS)


def test_slotted_adapter_equals_peft_and_the_base_is_unchanged(case):
    model = load(case["root"] / "slots", provider="cpu", threads=1)
    model.load_adapter(case["adapter"], name="a")
    base, _ = model.forward(np.array([PROMPT]))
    assert np.abs(base[0] - _logits(case["hf"])).max() < TOLERANCE
    logits, _ = model.forward(np.array([PROMPT]), adapter="a")
    assert np.abs(logits[0] - _logits(case["reference"])).max() < TOLERANCE
    expected = torch_greedy(case["merged"], PROMPT, NEW_TOKENS)
    assert model.generate(PROMPT, NEW_TOKENS, ignore_eos=True, adapter="a").token_ids == expected
    # the state cache's snapshots and replayed rewinds run under the adapter too
    fast = model.generate(PROMPT * 3, 40, ignore_eos=True, adapter="a", speculative="lookup")
    assert fast.token_ids == model.generate(PROMPT * 3, 40, ignore_eos=True, adapter="a").token_ids
    assert model.generate(PROMPT, NEW_TOKENS, ignore_eos=True).token_ids == torch_greedy(case["hf"], PROMPT, NEW_TOKENS)


def test_slots_sit_in_the_layers_that_hold_their_linear(case):
    slots = json.loads((case["root"] / "slots" / "edgelm.json").read_text())["lora"]["slots"]
    layers = {linear["a"]: linear.get("layers") for linear in slots["linears"]}
    config = case["hf"].config
    attention = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    others = [i for i in range(config.num_hidden_layers) if i not in attention]
    assert layers["layers.%d.qkv.lora_A"] == attention and layers["layers.%d.up.lora_A"] is None  # every layer
    mixer = "conv.in_proj" if case["name"] == "lfm2" else "delta_net.in_proj"
    assert layers[f"layers.%d.{mixer}.lora_A"] == others
    inputs = {i.name for i in load(case["root"] / "slots", provider="cpu").session.get_overridable_initializers()}
    assert f"layers.{others[0]}.{mixer}.lora_A" in inputs and f"layers.{attention[0]}.{mixer}.lora_A" not in inputs
    if case["name"] == "qwen3_5_text":
        qkv = next(linear for linear in slots["linears"] if linear["a"] == "layers.%d.qkv.lora_A")
        q_proj = qkv["parts"][0]
        heads, head_dim = config.num_attention_heads, config.head_dim
        gate = heads * head_dim + 2 * config.num_key_value_heads * head_dim
        assert q_proj["columns"][:2] == [[0, head_dim], [gate, head_dim]] and len(q_proj["columns"]) == 2 * heads


def test_a_slot_record_with_layers_out_of_range_is_refused(case):
    from edgelm.runtime.errors import PackageError
    from edgelm.runtime.lora_contract import parse_slots

    lora = json.loads((case["root"] / "slots" / "edgelm.json").read_text())["lora"]
    assert parse_slots(lora, "edgelm.json").linears[0].layers is not None
    for bad in ([4], [], [True], "1"):
        broken = copy.deepcopy(lora)
        broken["slots"]["linears"][0]["layers"] = bad
        with pytest.raises(PackageError, match="layers must be a non-empty list of layer indices below 4"):
            parse_slots(broken, "edgelm.json")


def test_onnxruntime_genai_runs_the_converted_adapter(case):
    """genai's adapters API on the slotted hybrid package (slots in some layers only): edgelm's ids."""
    og = pytest.importorskip("onnxruntime_genai")
    genai_model = og.Model(str(case["root"] / "slots"))
    adapters = og.Adapters(genai_model)
    adapters.load(str(case["adapter"]), "a")
    model = load(case["root"] / "slots", provider="cpu", threads=1)
    model.load_adapter(case["adapter"], name="a")
    for adapter in (None, "a"):
        params = og.GeneratorParams(genai_model)
        params.set_search_options(max_length=len(PROMPT) + NEW_TOKENS, do_sample=False)
        generator = og.Generator(genai_model, params)
        if adapter is not None:
            generator.set_active_adapter(adapters, "a")
        generator.append_tokens(np.array([PROMPT], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        ids = [int(t) for t in generator.get_sequence(0)][len(PROMPT) :]
        expected = model.generate(PROMPT, NEW_TOKENS, ignore_eos=True, adapter=adapter).token_ids
        assert ids and ids == expected[: len(ids)], adapter  # genai stops at EOS (id 0); edgelm ignored it


def test_eight_threads_with_and_without_the_adapter_get_what_each_gets_alone(case):
    from concurrent.futures import ThreadPoolExecutor

    model = load(case["root"] / "slots", provider="cpu", threads=1)
    model.load_adapter(case["adapter"], name="a")
    jobs = [(PROMPT[: 3 + i], "a" if i % 2 else None, "lookup" if i % 3 == 0 else None) for i in range(8)]
    run = lambda job: model.generate(job[0], 10, ignore_eos=True, adapter=job[1], speculative=job[2]).token_ids  # noqa: E731
    alone = [run(job) for job in jobs]
    start = threading.Barrier(len(jobs))

    def worker(job):
        start.wait()
        return [run(job) for _ in range(3)]

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(worker, jobs))
    assert together == [[ids] * 3 for ids in alone]


def _q8_0(source, target):
    """The GGUF file with every linear (a 2-D blk.* weight, not the conv kernel) in Q8_0 blocks."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import quantize
    from helpers import rewrite_gguf

    reader = GGUFReader(source)
    linears = {t.name: np.asarray(t.data) for t in reader.tensors
               if t.name.startswith("blk.") and len(t.shape) == 2 and "conv" not in t.name}  # fmt: skip

    def add(writer):
        for name, data in linears.items():
            blocks = quantize(np.ascontiguousarray(data, dtype=np.float32), GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType.Q8_0)

    return rewrite_gguf(source, target, {}, add=add, tensors=dict.fromkeys(linears))


def test_slots_on_a_qwen35_gguf_base_follow_its_kept_out_proj_blocks(families, tmp_path):
    # llama.cpp's converter tiles the value heads where they outnumber the key heads; out_proj's kept blocks keep
    # the file's order and the graph gathers their input so: the slot's A rows follow (its manifest's rows)
    hf, _ = families.model("qwen3_5_text")
    gguf = _q8_0(families.gguf("qwen3_5_text"), tmp_path / "q8_0.gguf")
    save_peft_adapter(hf, tmp_path / "adapter", r=4, targets="all-linear", lora_alpha=4, seed=7)
    export_package(gguf, tmp_path / "slots", lora_slots=SlotSpec(["all"], 8), accuracy_level=0, progress=quiet)
    export_package(gguf, tmp_path / "merged", lora=[(tmp_path / "adapter", 1.0)], accuracy_level=0, progress=quiet)
    slots = json.loads((tmp_path / "slots" / "edgelm.json").read_text())["lora"]["slots"]
    out_proj = next(linear for linear in slots["linears"] if linear["a"] == "layers.%d.delta_net.out_proj.lora_A")
    assert out_proj["rows"] != sorted(out_proj["rows"])  # the file's head order
    adapter = convert_adapter(tmp_path / "adapter", tmp_path / "slots", tmp_path / "a.onnx_adapter")
    model = load(tmp_path / "slots", provider="cpu", threads=1)
    model.load_adapter(adapter, name="a")
    merged, _ = load(tmp_path / "merged", provider="cpu", threads=1).forward(np.array([PROMPT]))
    logits, _ = model.forward(np.array([PROMPT]), adapter="a")
    assert np.abs(logits - merged).max() < TOLERANCE  # the blocks' weights plus the adapter, two ways
