"""LoRA on the families made of Llama's parts with their own rows: Phi-3 (PEFT adapts its packed qkv_proj and
gate_up_proj as stored; the reference model holds them split, the graph packs them again), SmolLM3 and Granite
(multipliers away from 1). A random PEFT adapter on every linear, merged at export and converted for a base with
slots, gives transformers + peft's logits (1e-4)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from family_cases import CASES
from helpers import quiet, save_peft_adapter, save_random_model

from edgelm.export.lora import SlotSpec, convert_adapter
from edgelm.export.onnx_export import export_package
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


def test_phi3_slots_are_the_packed_linears(case):
    if case["name"] != "phi3-longrope-short":
        pytest.skip("Phi-3's packed linears")
    slots = json.loads((case["root"] / "slots" / "edgelm.json").read_text())["lora"]["slots"]
    parts = {part["module"]: (part["offset"], part["width"]) for linear in slots["linears"] for part in linear["parts"]}
    c = case["hf"].config
    head_dim = c.hidden_size // c.num_attention_heads
    assert parts["model.layers.%d.self_attn.qkv_proj"] == (
        0,
        (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim,
    )
    assert parts["model.layers.%d.mlp.gate_up_proj"] == (0, 2 * c.intermediate_size)
    with pytest.raises(AdapterError, match="no linear named q_proj in a phi3 model"):
        export_package(case["root"] / "base", case["root"] / "bad", lora_slots=SlotSpec(["q_proj"], 8), progress=quiet)
