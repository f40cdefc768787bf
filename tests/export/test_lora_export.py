"""LoRA merged at export: random PEFT adapters (ranks 1, 8, 16; rsLoRA on and off; attention only and attention +
MLP; rank_pattern / alpha_pattern; GPT-2's Conv1D with fan_in_fan_out) on tiny random Llama, Qwen2 and GPT-2
bases; the exported package gives transformers + peft's logits (1e-4) and greedy ids, records each adapter's
sha256 and scale, and quantizes like any package."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import edgelm, lora_targets, quiet, save_lora_base, save_peft_adapter, torch_greedy

from edgelm.export.onnx_export import export_package
from edgelm.quantize.quantize import quantize_package
from edgelm.runtime import load

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 99, 1200, 7, 640, 33, 1800, 412]
NEW_TOKENS = 12
CASES = {  # name: (base, rank, attention + MLP, rsLoRA, extra LoraConfig options)
    "llama-r8-attention": ("llama", 8, False, False, {}),
    "llama-r16-mlp-rslora": ("llama", 16, True, True, {}),
    "llama-r1-patterns": ("llama", 1, True, False, {"rank_pattern": {"q_proj": 4}, "alpha_pattern": {"down_proj": 7}}),
    "qwen2-r8-mlp": ("qwen2", 8, True, False, {}),
    "gpt2-r8-mlp": ("gpt2", 8, True, False, {}),
    "gpt2-r1-rslora": ("gpt2", 1, False, True, {}),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("lora-bases")
    return {name: (save_lora_base(root / name, name), root / name) for name in ("llama", "qwen2", "gpt2")}


@pytest.fixture(scope="module")
def merged(bases, tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path, Path]]:
    """case -> (the PeftModel, the adapter folder, the merged package)."""
    root = tmp_path_factory.mktemp("lora-merged")
    out = {}
    for case, (base, rank, mlp, rslora, extra) in CASES.items():
        hf, folder = bases[base]
        adapter = root / f"{case}-adapter"
        reference = save_peft_adapter(hf, adapter, r=rank, targets=lora_targets(base, mlp=mlp), rslora=rslora, **extra)
        package = root / case
        export_package(folder, package, lora=[(adapter, 1.0)], progress=quiet)
        out[case] = (reference, adapter, package)
    return out


@pytest.mark.parametrize("case", CASES)
def test_merged_package_equals_peft(case, merged):
    reference, _, package = merged[case]
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    model = load(package, provider="cpu", threads=1)
    logits, _ = model.forward(np.array([PROMPT]))
    assert np.abs(logits[0] - expected).max() < 1e-4
    with torch.no_grad(), reference.disable_adapter():  # the adapter matters: far from the base's logits
        assert np.abs(reference(torch.tensor([PROMPT])).logits[0].numpy() - expected).max() > 1e-2
    result = model.generate(PROMPT, NEW_TOKENS, ignore_eos=True)
    assert result.token_ids == torch_greedy(reference, PROMPT, NEW_TOKENS)


def test_manifest_records_each_adapter(merged, bases, tmp_path):
    _, adapter, _ = merged["llama-r8-attention"]
    _, second, _ = merged["llama-r16-mlp-rslora"]
    out = tmp_path / "two"
    export_package(bases["llama"][1], out, lora=[(adapter, 0.5), (second, 2.0)], progress=quiet)
    record = json.loads((out / "edgelm.json").read_text())["lora"]["merged"]
    expected = [(adapter.name, 0.5, [8]), (second.name, 2.0, [16])]
    assert [(r["adapter"], r["scale"], r["ranks"]) for r in record] == expected
    assert all(len(r["sha256"]) == 64 for r in record) and record[0]["sha256"] != record[1]["sha256"]
    assert record[1]["use_rslora"] is True
    plain = json.loads((merged["llama-r8-attention"][2] / "edgelm.json").read_text())
    assert "slots" not in plain["lora"]


def test_scale_zero_is_the_base(merged, bases, tmp_path):
    """Scale 0 merges nothing: the package is the base."""
    reference, adapter, _ = merged["gpt2-r8-mlp"]
    out = tmp_path / "zero"
    export_package(bases["gpt2"][1], out, lora=[(adapter, 0.0)], progress=quiet)
    with torch.no_grad():
        base = bases["gpt2"][0](torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(load(out, provider="cpu").forward(np.array([PROMPT]))[0][0] - base).max() < 1e-4


@pytest.mark.parametrize("mode", ["int4", "int8-weight-only", "dynamic"])
def test_merged_package_quantizes(mode, merged, tmp_path):
    reference, _, package = merged["llama-r16-mlp-rslora"]
    out = tmp_path / mode
    quantize_package(package, out, mode=mode, progress=quiet)
    manifest = json.loads((out / "edgelm.json").read_text())
    assert manifest["precision"] != "fp32" and manifest["lora"]["merged"][0]["scale"] == 1.0
    logits, _ = load(out, provider="cpu").forward(np.array([PROMPT]))
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    agreement = (logits[0].argmax(-1) == expected.argmax(-1)).mean()
    assert agreement >= 0.5, f"{mode}: top-1 agreement with peft {agreement:.2f}"


def test_cli_export_lora(merged, bases, tmp_path):
    _, adapter, _ = merged["qwen2-r8-mlp"]
    out = tmp_path / "cli"
    done = edgelm("export", bases["qwen2"][1], out, "--lora", f"{adapter}:1.5")
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "edgelm.json").read_text())["lora"]["merged"][0]["scale"] == 1.5
    bad = edgelm("export", bases["qwen2"][1], tmp_path / "bad", "--lora", str(tmp_path / "missing"))
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "missing" in bad.stderr
    assert not (tmp_path / "bad").exists()
