"""The SmolLM3, Granite (3 and dense 4.0), Phi-3 and Gemma 4 cases (tests/family_cases.py) through llama.cpp's
own converter, convert_hf_to_gguf.py, rather than tests/family_cases.py's writer of its keys: the f32 file exports
to transformers' logits and greedy tokens, and the q8_0 file, its blocks kept (MatMulNBits at accuracy level 0),
to the logits of its own dequantized weights; a Gemma 4 wide enough for K-quants (256) through llama.cpp's quantizer
(Q4_K_M, with $EDGELM_LLAMA_CPP_PYTHON) the same. The converter is the copy scripts/fetch_llamacpp_vocab.py keeps
from llama-cpp-python's source distribution (or a llama.cpp checkout at $EDGELM_LLAMA_CPP); the tests need
sentencepiece (the converter imports it) and skip without it or without the converter.

The converter hashes a BPE tokenizer to name its pre-tokenizer and refuses one it does not know, as it does
the bundled test tokenizer: the run names it "gpt-2" (the tokenizer is not what is tested here), and Gemma 4's
converter, which reads only a Llama-style byte-fallback BPE, writes it as a GPT-2 one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from family_cases import CASES as FAMILY_CASES
from family_cases import NEW_TOKENS, PROMPTS
from helpers import hf_greedy, quiet, save_random_model

from edgelm.runtime import load

# slow: llama.cpp's converter on every family case it reads
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

CASES = ("smollm3", "granite", "granitemoehybrid", "phi3-longrope-short", "gemma4_text-shared", "gemma4_text-k-eq-v")
CONVERT = """
import sys
source, folder, outtype, out, label = sys.argv[1:]
sys.path[:0] = [source + "/gguf-py", source]
import conversion.base
import conversion.gemma
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: label
conversion.gemma.Gemma4Model.set_vocab = conversion.base.TextModel._set_vocab_gpt2
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", out]
convert_hf_to_gguf.main()
"""


@pytest.fixture(scope="module")
def llama_cpp(llamacpp_converter: Path) -> Path:
    return llamacpp_converter


def convert(
    llama_cpp: Path, folder: Path, outtype: str, tmp_path: Path, *, pre: str = "gpt-2", chat_template: str | None = None
) -> Path:
    """The converter's `outtype` file of the folder (copied into tmp_path once), its tokenizer's pre-tokenizer
    named `pre`, with `chat_template` when given."""
    source = tmp_path / "hf"
    if not source.exists():
        shutil.copytree(folder, source)
        # the converter's Phi-3 reads a GPT-2-style tokenizer only when the folder says so
        config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
        if chat_template is not None:
            config["chat_template"] = chat_template
        (source / "tokenizer_config.json").write_text(json.dumps(config))
        # transformers 5 saves granitemoehybrid's layer kinds as "full_attention"; the converter knows the
        # published checkpoints' "attention" only (and would take the layers for Mamba ones)
        hf_config = json.loads((source / "config.json").read_text())
        if hf_config["model_type"] == "granitemoehybrid":
            hf_config["layer_types"] = [k.replace("full_attention", "attention") for k in hf_config["layer_types"]]
            (source / "config.json").write_text(json.dumps(hf_config))
    out = tmp_path / f"{outtype}.gguf"
    run = subprocess.run(
        [sys.executable, "-c", CONVERT, str(llama_cpp), str(source), outtype, str(out), pre],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return out


@pytest.mark.parametrize("case", CASES)
def test_the_converters_files_export_exactly(case, llama_cpp, families, tmp_path):
    from edgelm.export.onnx_export import export_package
    from edgelm.export.source import open_source

    hf, folder = families.model(case)
    ids = np.array([PROMPTS[2]], dtype=np.int64)
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids)).logits.numpy()

    export_package(convert(llama_cpp, folder, "f32", tmp_path), tmp_path / "f32", progress=quiet)
    model = load(tmp_path / "f32", provider="cpu")
    assert float(np.abs(model.forward(ids)[0] - reference).max()) < 1e-4
    assert model.generate(PROMPTS[0], NEW_TOKENS, temperature=0, ignore_eos=True).token_ids == hf_greedy(
        hf, PROMPTS[0], NEW_TOKENS
    )

    q8 = convert(llama_cpp, folder, "q8_0", tmp_path)
    manifest = export_package(q8, tmp_path / "q8", accuracy_level=0, progress=quiet)
    assert manifest["precision"] != "fp32"  # the blocks were kept
    if case.startswith("gemma4"):  # the per-layer table too, its rows gathered from the blocks
        assert manifest["recipe"]["per_layer_embedding"] == "int8"
    with torch.no_grad():
        dequantized = open_source(q8).model(torch.from_numpy(ids))[0].numpy()
    assert float(np.abs(load(tmp_path / "q8", provider="cpu").forward(ids)[0] - dequantized).max()) < 1e-4


# every linear's inputs a multiple of 256 (K-quant blocks): hidden, MLP, heads (4 x 64 sliding, 4 x 128 full), and
# the per-layer input; KV sharing and double-wide MLPs as in the tiny case
GEMMA4_WIDE = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 64,
               "global_head_dim": 128, "hidden_size_per_layer_input": 256, "initializer_range": 0.075}  # fmt: skip


def test_gemma4_q4_k_m_keeps_its_blocks_and_their_dequantized_logits(llama_cpp, tmp_path):
    from test_hybrid_gguf import llama_python, run_llama

    from edgelm.export.onnx_export import export_package
    from edgelm.export.source import open_source

    if llama_python() is None:
        pytest.skip("set EDGELM_LLAMA_CPP_PYTHON to a Python that imports llama_cpp to run llama.cpp's quantizer")
    case = FAMILY_CASES["gemma4_text-shared"]
    save_random_model(tmp_path / "folder", case.classes, case.config | GEMMA4_WIDE)
    f32 = convert(llama_cpp, tmp_path / "folder", "f32", tmp_path)
    run_llama({"quantize": str(f32), "out": str(tmp_path / "Q4_K_M.gguf"), "type": "Q4_K_M"})
    manifest = export_package(tmp_path / "Q4_K_M.gguf", tmp_path / "q4", accuracy_level=0, progress=quiet)
    recipe = manifest["recipe"]
    assert recipe["float_linears"] == 0 and recipe["kept_linears"] > 0
    assert {"Q4_K", "Q6_K"} <= set(recipe["types"])
    ids = np.array([PROMPTS[2]], dtype=np.int64)
    with torch.no_grad():  # float64: the reference's own rounding stays below the tolerance
        dequantized = open_source(tmp_path / "Q4_K_M.gguf").model.double()(torch.from_numpy(ids))[0].numpy()
    assert float(np.abs(load(tmp_path / "q4", provider="cpu").forward(ids)[0] - dequantized).max()) < 1e-4
