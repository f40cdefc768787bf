"""LoRA on the families made of Llama's parts with their own rows: Phi-3 (PEFT adapts its packed qkv_proj and
gate_up_proj as stored; the reference model holds them split, the graph packs them again), SmolLM3 and Granite
(multipliers away from 1). A random PEFT adapter on every linear, merged at export and converted for a base with
slots, gives transformers + peft's logits (1e-4); Phi-3's from a GGUF file too, and its slots are the packed linears."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from family_cases import CASES
from helpers import quiet, save_peft_adapter, save_random_model

from edgelm.export.families import FAMILIES
from edgelm.export.lora import SlotSpec, convert_adapter, merge_adapters
from edgelm.export.onnx_export import export_package
from edgelm.export.peft_adapter import read_peft_adapter
from edgelm.runtime import load
from edgelm.runtime.errors import AdapterError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 99, 1200, 7, 640, 33, 1800, 412]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {  # case: the linears PEFT adapts, as the transformers model names them
    "phi3-longrope-short": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "smollm3": LLAMA_TARGETS,
    "granite": LLAMA_TARGETS,
}


@pytest.fixture(scope="module", params=list(TARGETS))
def case(request, tmp_path_factory) -> dict:
    """The base, its PEFT adapter (rank 4), the merged package and a package with slots."""
    name = request.param
    root = tmp_path_factory.mktemp(f"lora-{name}")
    spec = CASES[name]
    hf = save_random_model(root / "base", spec.classes, copy.deepcopy(spec.config))
    reference = save_peft_adapter(hf, root / "adapter", r=4, targets=TARGETS[name])
    export_package(root / "base", root / "merged", lora=[(root / "adapter", 1.0)], progress=quiet)
    export_package(root / "base", root / "slots", lora_slots=SlotSpec(["all"], 8), progress=quiet)
    return {"name": name, "hf": hf, "root": root, "reference": reference}


def _expected(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


def test_merged_adapter_equals_peft(case):
    expected = _expected(case["reference"])
    logits, _ = load(case["root"] / "merged", provider="cpu", threads=1).forward(np.array([PROMPT]))
    assert np.abs(logits[0] - expected).max() < 1e-4
    assert np.abs(_expected(case["hf"]) - expected).max() > 1e-2  # the adapter matters


def test_slotted_adapter_equals_peft(case):
    root = case["root"]
    adapter = convert_adapter(root / "adapter", root / "slots", root / "adapter.onnx_adapter", overwrite=True)
    model = load(root / "slots", provider="cpu", threads=1)
    model.load_adapter(adapter, name="a")
    base, _ = model.forward(np.array([PROMPT]))
    assert np.abs(base[0] - _expected(case["hf"])).max() < 1e-4
    logits, _ = model.forward(np.array([PROMPT]), adapter="a")
    assert np.abs(logits[0] - _expected(case["reference"])).max() < 1e-4


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
    assert np.abs(logits[0] - _expected(phi3["reference"])).max() < 1e-4


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
