"""LoRA on every family case tagged "lora" (tests/family_cases.py): the families made of Llama's parts with their own
rows (Phi-3: PEFT adapts its packed qkv_proj and gate_up_proj as stored, the reference model holds them split, the
graph packs them again; SmolLM3; Granite, multipliers away from 1), Gemma 4 with KV sharing and per-layer inputs, and
the hybrids LFM2 and Qwen3.5. A random PEFT adapter on every layer linear (attention; the MLP; Gemma 4's per-layer
input gate and projection; the short convolution's or the Gated DeltaNet's in/out projections and gates) merged at
export on both graphs, and converted for a fused base with slots, gives transformers + peft's logits (1e-4) and
greedy ids, the base unchanged without the adapter.

Then what one mechanism makes of the slots: Gemma 4's KV-shared layers have no k_proj or v_proj, so their qkv slot
is Q's alone, and the full layers' larger heads and the shared layers' double-wide MLPs get slots of their own; a
hybrid's slots sit only in the layers that hold their linear, Qwen3.5's q_proj (each head's query then its gate)
lands in the packed [Q, K, V, gate] linear's query and gate columns, onnxruntime-genai runs the slotted packages
with the adapter, and eight threads with and without it get what each gets alone. Phi-3's adapter merges into a GGUF
base too, and its slots are the packed linears."""

from __future__ import annotations

import copy
import json
import threading

import numpy as np
import pytest
import torch
from family_cases import CASES, cases_with
from helpers import quiet, save_peft_adapter, save_random_model, torch_greedy

from edgelm.export.families import FAMILIES
from edgelm.export.lora import SlotSpec, convert_adapter, merge_adapters
from edgelm.export.onnx_export import export_package
from edgelm.export.peft_adapter import read_peft_adapter
from edgelm.runtime import load
from edgelm.runtime.errors import AdapterError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 99, 1200, 7, 640, 33, 1800, 412]
NEW_TOKENS = 12
TOLERANCE = 1e-4
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# case: (the linears PEFT adapts, as the transformers model names them; its lora_alpha and seed; how far the adapter
# moves the logits at least). The hybrids' and Gemma 4's alpha 4 with rank 4: a larger scale makes the random
# recurrence sensitive past float32's 1e-4.
ADAPTERS = {
    "phi3-longrope-short": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], dict(lora_alpha=8, seed=1), 1e-2),
    "smollm3": (LLAMA_TARGETS, dict(lora_alpha=8, seed=1), 1e-2),
    "granite": (LLAMA_TARGETS, dict(lora_alpha=8, seed=1), 1e-2),
    "gemma4_text-shared": (
        [*LLAMA_TARGETS, "per_layer_input_gate", "per_layer_projection"],
        dict(lora_alpha=4, seed=7),
        1e-1,
    ),
    "lfm2": ("all-linear", dict(lora_alpha=4, seed=7), 1e-1),
    "qwen3_5_text": ("all-linear", dict(lora_alpha=4, seed=7), 1e-1),
}


def test_every_lora_case_has_its_adapter():
    assert sorted(ADAPTERS) == cases_with("lora")


@pytest.fixture(scope="module", params=cases_with("lora"))
def case(request, families, tmp_path_factory) -> dict:
    """The tiny base, its PEFT adapter (rank 4), the merged packages of both graphs and a fused package with slots,
    the adapter converted for it."""
    name = request.param
    hf, folder = families.model(name)
    root = tmp_path_factory.mktemp(f"lora-{name}")
    targets, options, _ = ADAPTERS[name]
    reference = save_peft_adapter(hf, root / "adapter", r=4, targets=targets, **options)
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
    assert np.abs(_logits(case["hf"]) - expected).max() > ADAPTERS[case["name"]][2]  # the adapter matters
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
    # a hybrid's state cache: its snapshots and replayed rewinds run under the adapter too
    fast = model.generate(PROMPT * 3, 40, ignore_eos=True, adapter="a", speculative="lookup")
    assert fast.token_ids == model.generate(PROMPT * 3, 40, ignore_eos=True, adapter="a").token_ids
    assert model.generate(PROMPT, NEW_TOKENS, ignore_eos=True).token_ids == torch_greedy(case["hf"], PROMPT, NEW_TOKENS)


# ---- KV sharing and per-layer inputs (Gemma 4) ----------------------------------------------------------------------


@pytest.mark.parametrize("case", cases_with("lora", "kv-sharing"), indirect=True)
def test_shared_layers_get_a_query_only_slot(case):
    slots = json.loads((case["root"] / "slots" / "edgelm.json").read_text())["lora"]["slots"]
    qkv = {tuple(linear.get("layers") or ()): linear for linear in slots["linears"] if "qkv" in linear["a"]}
    # sliding layers 0, 1, 3 (heads of 16), full layer 2 (heads of 32), shared layers 4 and 5: Q alone
    assert sorted(qkv) == [(0, 1, 3), (2,), (4,), (5,)]
    assert [p["module"].rsplit(".", 1)[-1] for p in qkv[(4,)]["parts"]] == ["q_proj"]
    assert [p["module"].rsplit(".", 1)[-1] for p in qkv[(0, 1, 3)]["parts"]] == ["q_proj", "k_proj", "v_proj"]
    assert qkv[(5,)]["out"] == 2 * qkv[(4,)]["out"]  # a full layer's heads are twice as wide
    up = {tuple(linear.get("layers") or ()) for linear in slots["linears"] if ".up." in linear["a"]}
    assert up == {(0, 1, 2, 3), (4, 5)}  # the shared layers' MLPs are double-wide
    gates = [linear for linear in slots["linears"] if "per_layer.gate" in linear["a"]]
    assert len(gates) == 1 and gates[0].get("layers") is None


@pytest.mark.parametrize("case", cases_with("lora", "per-layer-inputs"), indirect=True)
def test_all_linear_merges_the_model_projection_too(case, families, tmp_path):
    """PEFT's all-linear also adapts model.per_layer_model_projection (outside the layers): merged, it works;
    it has no slot, so converting it for slots is refused in one line."""
    hf, folder = families.model(case["name"])
    reference = save_peft_adapter(hf, tmp_path / "all", r=2, targets="all-linear", lora_alpha=2, seed=3)
    export_package(folder, tmp_path / "merged", lora=[(tmp_path / "all", 1.0)], progress=quiet)
    logits, _ = load(tmp_path / "merged", provider="cpu", threads=1).forward(np.array([PROMPT]))
    assert np.abs(logits[0] - _logits(reference)).max() < TOLERANCE
    with pytest.raises(AdapterError, match="per_layer_model_projection has no LoRA slot"):
        convert_adapter(tmp_path / "all", case["root"] / "slots", tmp_path / "all.onnx_adapter")


# ---- the hybrids' state layers (LFM2, Qwen3.5) -------------------------------------------------------------------


@pytest.mark.parametrize("case", cases_with("lora", "hybrid-state"), indirect=True)
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


@pytest.mark.parametrize("case", cases_with("lora", "hybrid-state"), indirect=True)
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


@pytest.mark.parametrize("case", cases_with("lora", "hybrid-state"), indirect=True)
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


@pytest.mark.parametrize("case", cases_with("lora", "hybrid-state"), indirect=True)
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


# ---- Phi-3's packed linears -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> dict:
    """A Phi-3 base, a PEFT adapter of "all-linear" (PEFT picks the packed linears) and a GGUF file of the base."""
    from family_cases import write_gguf

    root = tmp_path_factory.mktemp("lora-phi3")
    spec = CASES["phi3-longrope-short"]
    hf = save_random_model(root / "base", spec.classes, copy.deepcopy(spec.config))
    reference = save_peft_adapter(hf, root / "adapter", r=2, targets="all-linear", seed=5)
    return {"hf": hf, "root": root, "reference": reference, "gguf": write_gguf(hf, root / "base.gguf")}


def test_phi3_all_linear_adapter_merges_into_a_gguf_base(phi3):
    root = phi3["root"]
    export_package(phi3["gguf"], root / "merged-gguf", lora=[(root / "adapter", 1.0)], progress=quiet)
    manifest = json.loads((root / "merged-gguf" / "edgelm.json").read_text())
    assert manifest["lora"]["merged"][0]["modules"] == 4 * phi3["hf"].config.num_hidden_layers
    logits, _ = load(root / "merged-gguf", provider="cpu", threads=1).forward(np.array([PROMPT]))
    assert np.abs(logits[0] - _logits(phi3["reference"])).max() < 1e-4


def test_phi3_merge_names_the_packed_weight_for_gguf_blocks(phi3):
    """A GGUF file's blocks are named by the packed tensors: merging must name them, so they are dropped."""
    model = FAMILIES["phi3"].load(phi3["root"] / "base")
    adapter = read_peft_adapter(phi3["root"] / "adapter")
    merged = merge_adapters(model, [adapter], family="phi3", packed=FAMILIES["phi3"].lora_packed)
    assert {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.k_proj.weight"} <= merged


def test_phi3_slots_are_the_packed_linears(phi3):
    root = phi3["root"]
    export_package(root / "base", root / "qkv-slots", lora_slots=SlotSpec(["qkv_proj", "gate_up_proj"], 2),
                   progress=quiet)  # fmt: skip
    slots = json.loads((root / "qkv-slots" / "edgelm.json").read_text())["lora"]["slots"]
    parts = {part["module"]: (part["offset"], part["width"]) for linear in slots["linears"] for part in linear["parts"]}
    c = phi3["hf"].config
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * (c.hidden_size // c.num_attention_heads)
    assert parts == {
        "model.layers.%d.self_attn.qkv_proj": (0, qkv),
        "model.layers.%d.mlp.gate_up_proj": (0, 2 * c.intermediate_size),
    }
    with pytest.raises(AdapterError, match="no linear named q_proj in a phi3 model"):
        export_package(root / "base", root / "bad", lora_slots=SlotSpec(["q_proj"], 8), progress=quiet)
