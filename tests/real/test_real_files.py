"""The two real files as people download them (scripts/fetch_real_models.py; skipped where they cannot be had):
each exports with no flags, its proof passes through the float twin and the KL bounds, the package loads, greedy
decoding gives llama.cpp's ids on the same file (tests/data/real_files_llamacpp.json, recorded from llama.cpp
itself), and a wrong graph of the real file is refused. Both systems round activations to int8, each its own
way, so ids are compared up to where they parted when recorded (a near tie there: docs/results.md, "Real files
against llama.cpp on the same file")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import quiet

pytest.importorskip("gguf")
from mistakes import injected  # noqa: E402

from edgelm.export.onnx_export import export_package  # noqa: E402
from edgelm.runtime import load  # noqa: E402

pytestmark = pytest.mark.slow  # the two real GGUF files, exported and run

RECORDED = json.loads((Path(__file__).parents[1] / "data" / "real_files_llamacpp.json").read_text(encoding="utf-8"))
COMPARED = 16  # tokens compared where the recording agreed for at least this many
# every such prompt must agree this far, and one all 16: another CPU's int8 path (MLAS on AVX2 against AVX-512 VNNI)
# rounds its own way and may part at a near tie sooner (SmolLM2's "x = np." at token 9 on an AVX2-only AMD EPYC)
AGREED_EVERYWHERE = 8


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request, real_default_packages):
    path = request.getfixturevalue(f"{request.param}_gguf")
    return request.param, path, *real_default_packages(request.param, path)


def test_a_real_file_exports_with_no_flags_and_its_proof_passes(real):
    _, _, package, manifest = real
    parity = manifest["parity"]
    assert parity["max_abs_logit_diff"] <= parity["tolerance"] and "int8" in parity["activations"]
    assert parity["int8"]["mean_kl"] <= parity["int8"]["mean_kl_bound"]
    assert parity["int8"]["top1_agreement"] >= 0.9
    assert not list(package.glob(".float-twin*"))


def test_a_real_files_greedy_ids_are_llamacpps(real):
    name, _, package, _ = real
    model = load(package, threads=2)
    compared, whole = 0, 0
    for case in RECORDED["files"][name]:
        if case["agreed"] < COMPARED:
            continue
        ids = model.generate(case["prompt_ids"], max_new_tokens=COMPARED, ignore_eos=True).token_ids
        assert ids[:AGREED_EVERYWHERE] == case["llamacpp_ids"][:AGREED_EVERYWHERE], case["prompt"]
        whole += ids == case["llamacpp_ids"][:COMPARED]
        compared += 1
    assert compared >= 2, "the recording has prompts that agree for 16 tokens"
    assert whole >= 1, f"no prompt gave llama.cpp's {COMPARED} ids"


def test_the_prompts_tokenize_as_llamacpp_does(real):
    name, _, package, _ = real
    model = load(package, threads=2)
    for case in RECORDED["files"][name]:
        assert model.tokenizer.encode(case["prompt"], add_special_tokens=True) == case["prompt_ids"]


def test_a_wrong_graph_of_the_real_file_is_refused(real, tmp_path):
    """The subtlest mistake that applies: Gemma's embedding scale rounded to bfloat16 (0.15% off), or the rotary
    base off for SmolLM2."""
    name, path, _, _ = real
    mistake = "embedding_scale_bf16" if name == "gemma3" else "rope_base"
    # Gemma's window check (float activations past its 512-token window) runs first and refuses it there
    with injected(mistake), pytest.raises(RuntimeError, match="ONNX Runtime and PyTorch disagree.*float activations"):
        export_package(path, tmp_path / "wrong", progress=quiet)
