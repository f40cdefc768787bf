"""LoRA on Gemma 4 with KV sharing: a random PEFT adapter on every layer linear (q/k/v/o, the MLP, the per-layer
input gate and projection) merged at export on both graphs, and converted for a fused base with slots, gives
transformers + peft's logits (1e-4) and greedy ids. The KV-shared layers have no k_proj or v_proj, so their qkv
slot is Q's alone; the full layers' larger heads and the shared layers' double-wide MLPs get slots of their own."""

from __future__ import annotations

import copy
import json

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
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "per_layer_input_gate",
           "per_layer_projection"]  # fmt: skip


@pytest.fixture(scope="module")
def case(families, tmp_path_factory) -> dict:
    hf, folder = families.model("gemma4_text-shared")
    root = tmp_path_factory.mktemp("lora-gemma4")
    reference = save_peft_adapter(hf, root / "adapter", r=4, targets=TARGETS, lora_alpha=4, seed=7)
    for graph in ("fused", "standard"):
        export_package(folder, root / graph, attention=graph, lora=[(root / "adapter", 1.0)], progress=quiet)
    export_package(folder, root / "slots", lora_slots=SlotSpec(["all"], 8), progress=quiet)
    adapter = convert_adapter(root / "adapter", root / "slots", root / "adapter.onnx_adapter")
    merged = copy.deepcopy(reference).merge_and_unload()
    return {"hf": hf, "root": root, "reference": reference, "merged": merged, "adapter": adapter}


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
    assert model.generate(PROMPT, NEW_TOKENS, ignore_eos=True).token_ids == torch_greedy(
        case["merged"], PROMPT, NEW_TOKENS
    )


def test_slotted_adapter_equals_peft_and_the_base_is_unchanged(case):
    model = load(case["root"] / "slots", provider="cpu", threads=1)
    model.load_adapter(case["adapter"], name="a")
    base, _ = model.forward(np.array([PROMPT]))
    assert np.abs(base[0] - _logits(case["hf"])).max() < TOLERANCE
    logits, _ = model.forward(np.array([PROMPT]), adapter="a")
    assert np.abs(logits[0] - _logits(case["reference"])).max() < TOLERANCE
    expected = torch_greedy(case["merged"], PROMPT, NEW_TOKENS)
    assert model.generate(PROMPT, NEW_TOKENS, ignore_eos=True, adapter="a").token_ids == expected
    fast = model.generate(PROMPT * 3, 40, ignore_eos=True, adapter="a", speculative="lookup")
    assert fast.token_ids == model.generate(PROMPT * 3, 40, ignore_eos=True, adapter="a").token_ids
    assert model.generate(PROMPT, NEW_TOKENS, ignore_eos=True).token_ids == torch_greedy(case["hf"], PROMPT, NEW_TOKENS)


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


def test_all_linear_merges_the_model_projection_too(case, families, tmp_path):
    """PEFT's all-linear also adapts model.per_layer_model_projection (outside the layers): merged, it works;
    it has no slot, so converting it for slots is refused in one line."""
    from edgelm.runtime.errors import AdapterError

    hf, folder = families.model("gemma4_text-shared")
    reference = save_peft_adapter(hf, tmp_path / "all", r=2, targets="all-linear", lora_alpha=2, seed=3)
    export_package(folder, tmp_path / "merged", lora=[(tmp_path / "all", 1.0)], progress=quiet)
    logits, _ = load(tmp_path / "merged", provider="cpu", threads=1).forward(np.array([PROMPT]))
    assert np.abs(logits[0] - _logits(reference)).max() < TOLERANCE
    with pytest.raises(AdapterError, match="per_layer_model_projection has no LoRA slot"):
        convert_adapter(tmp_path / "all", case["root"] / "slots", tmp_path / "all.onnx_adapter")
