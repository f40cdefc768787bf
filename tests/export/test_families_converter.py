"""The SmolLM3, Granite (3 and dense 4.0), Phi-3 and Gemma 4 cases (tests/family_cases.py) through llama.cpp's
own converter, convert_hf_to_gguf.py, rather than tests/family_cases.py's writer of its keys: the f32 file exports
to transformers' logits and greedy tokens, and the q8_0 file, its blocks kept (MatMulNBits at accuracy level 0),
to the logits of its own dequantized weights; a Gemma 4 wide enough for K-quants (256) through llama.cpp's quantizer
(Q4_K_M, with $EDGELM_LLAMA_CPP_PYTHON) the same. The converter is the copy scripts/fetch_llamacpp_vocab.py keeps
from llama-cpp-python's source distribution (or a llama.cpp checkout at $EDGELM_LLAMA_CPP); the tests need
sentencepiece (the converter imports it) and skip without it or without the converter.

The converter hashes a BPE tokenizer to name its pre-tokenizer and refuses one it does not know, as it does
the bundled test tokenizer: the run names it "gpt-2" (the tokenizer is not what is tested here), and Gemma 4's
converter, which reads only a Llama-style byte-fallback BPE, writes it as a GPT-2 one.

Qwen3.5 and LFM2 from GGUF files. What a qwen35 file's metadata can say that export refuses, in one line. And
llama.cpp itself: its converter's f32 and q8_0 files and its quantizer's Q4_K_M, exported and checked against
transformers (f32), against the file's own dequantized weights (the blocks kept, MatMulNBits at accuracy level 0),
and against llama.cpp's own greedy tokens on the same file (tests/export/test_families.py checks files of tests/
family_cases.py's writer, which mirrors the converter, against transformers).

The converter's models are 256 wide, so every linear takes K-quant super-blocks, and Qwen3.5's 8 value heads share
2 key heads: llama.cpp's converter moves them into its tiled order, which at that ratio is not its own inverse.
The Qwen3.5 folder carries a multi-token-prediction block, as published checkpoints do: the converter writes it
after the last layer and export leaves it out. Each folder carries a real chat template, which the package keeps.

The hybrids' quantizer and greedy runs also need $EDGELM_LLAMA_CPP_PYTHON, a Python that imports llama_cpp
(benchmarks/peers/setup_llamacpp.sh builds one). Skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from family_cases import CASES as FAMILY_CASES
from family_cases import LFM2, NEW_TOKENS, PROMPTS, QWEN35, cases_with
from gguf import GGUFValueType as V
from helpers import hf_greedy, quiet, rewrite_gguf, save_random_model

from edgelm.cli import main
from edgelm.runtime import load

# slow: llama.cpp's converter on every family case it reads, and llama.cpp itself on the hybrids
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


# ---- the hybrids (Qwen3.5, LFM2) from GGUF files ---------------------------------------------------------------------

# the 64-wide cases' initializer_range over sqrt(4): logits about as large (at 0.15 this Qwen3.5's reach 18 and
# float32 alone moves them by 2e-4)
WIDE = {"hidden_size": 256, "intermediate_size": 256, "initializer_range": 0.075}
# case -> (its config, the converter's pre-tokenizer label, a chat template of llama.cpp's models/templates/)
HYBRIDS = {  # tests/family_cases.py's "hybrid-state" cases
    "qwen3_5_text": (
        QWEN35
        | WIDE
        | dict(
            linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=True
        ),  # the small Qwen3.5s tie them; tests/export/test_families: untied
        "qwen35",
        "Qwen3.5-4B.jinja",
    ),
    "lfm2": (LFM2 | WIDE | {"intermediate_size": 384}, "lfm2", "LFM2.5-Instruct.jinja"),  # 2/3 of it: 256
}
QUANTIZED = ("q8_0", "Q4_K_M")
REFUSED = {  # metadata changes -> what the one line says
    "rope scaling": ({"qwen35.rope.scaling.type": ("yarn", V.STRING)}, "rope scaling 'yarn' is not implemented"),
    "value head width": ({"qwen35.ssm.inner_size": (33, V.UINT32)}, "inner_size 33 is not a multiple"),
    "layer kinds": ({"qwen35.attention.recurrent_layers": ([True] * 3, V.ARRAY, V.BOOL)}, "must list 4 layers"),
    "heads that do not group": ({"qwen35.ssm.group_count": (3, V.UINT32)}, "4 value over 3 key heads"),
    "a layer taken for an MTP block": ({"qwen35.nextn_predict_layers": (1, V.UINT32)}, "block 3 has no nextn"),
}
LLAMA = """
import json, sys
import numpy as np
import llama_cpp
job = json.loads(sys.argv[1])
if "quantize" in job:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + job["type"])
    sys.exit(llama_cpp.llama_model_quantize(job["quantize"].encode(), job["out"].encode(), params))
greedy = {}
for path in job["models"]:  # an f32 KV cache, as the package keeps
    llm = llama_cpp.Llama(path, n_ctx=64, n_threads=1, type_k=0, type_v=0, logits_all=True, verbose=False)
    llm.eval(job["prompt"])
    ids = []
    for _ in range(job["new_tokens"]):
        ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(ids[-1:])
    greedy[path] = {"ids": ids, "logits": llm.scores[: llm.n_tokens].tolist()}  # at every position
print(json.dumps(greedy))
"""


def test_every_hybrid_case_has_a_converter_model():
    assert sorted(HYBRIDS) == cases_with("hybrid-state")


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_qwen35_file_is_one_line(case, families, tmp_path, capsys):
    changes, expected = REFUSED[case]
    bad = rewrite_gguf(families.gguf("qwen3_5_text"), tmp_path / "bad.gguf", changes)
    capsys.readouterr()  # transformers' progress while the file was made
    assert main(["export", str(bad), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.gguf: " in err and expected in err, err
    assert not (tmp_path / "out").exists()


def llama_python() -> str | None:
    return os.environ.get("EDGELM_LLAMA_CPP_PYTHON")


def run_llama(job: dict) -> str:
    if llama_python() is None:
        pytest.skip("set EDGELM_LLAMA_CPP_PYTHON to a Python that imports llama_cpp to run llama.cpp")
    run = subprocess.run([llama_python(), "-c", LLAMA, json.dumps(job)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def add_mtp_block(folder: Path) -> None:
    """A multi-token-prediction block as Qwen3.5's checkpoints carry it (mtp.*: its fc and norms, and one decoder
    layer like an attention layer), which transformers' model does not hold."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    hidden, attention = config["hidden_size"], config["layer_types"].index("full_attention")
    prefix = f"model.layers.{attention}."
    state |= {"mtp.layers.0." + k.removeprefix(prefix): v.clone() for k, v in state.items() if k.startswith(prefix)}
    state["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
    state |= {f"mtp.{name}.weight": torch.zeros(hidden) for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")}
    state["mtp.norm.weight"] = torch.zeros(hidden)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request, llama_cpp, tmp_path_factory):
    """(the transformers model, {file type: its GGUF file}, its chat template)."""
    case = request.param
    config, pre, template_name = HYBRIDS[case]
    tmp = tmp_path_factory.mktemp(case)
    hf = save_random_model(tmp / "folder", FAMILY_CASES[case].classes, config)
    if case == "qwen3_5_text":
        add_mtp_block(tmp / "folder")
    template = (llama_cpp / "models" / "templates" / template_name).read_text()
    files = {
        kind: convert(llama_cpp, tmp / "folder", kind, tmp, pre=pre, chat_template=template) for kind in ("f32", "q8_0")
    }
    if llama_python() is not None:
        files["Q4_K_M"] = tmp / "Q4_K_M.gguf"
        run_llama({"quantize": str(files["f32"]), "out": str(files["Q4_K_M"]), "type": "Q4_K_M"})
    return hf, files, template


def export(gguf: Path, out: Path, accuracy_level: int = 0):
    from edgelm.export.onnx_export import export_package

    if not out.exists():
        export_package(gguf, out, accuracy_level=accuracy_level, progress=quiet)
    return load(out, provider="cpu")


def test_the_f32_file_exports_to_transformers_logits_and_keeps_its_template(hybrid):
    hf, files, template = hybrid
    ids = np.array([PROMPTS[2]], dtype=np.int64)
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids)).logits.numpy()
    model = export(files["f32"], files["f32"].with_suffix(".package"))
    assert float(np.abs(model.forward(ids)[0] - reference).max()) < 1e-4
    assert model.generate(PROMPTS[0], NEW_TOKENS, temperature=0, ignore_eos=True).token_ids == hf_greedy(
        hf, PROMPTS[0], NEW_TOKENS
    )
    assert (files["f32"].with_suffix(".package") / "chat_template.jinja").read_text() == template


@pytest.mark.parametrize("kind", QUANTIZED)
def test_quantized_files_keep_their_blocks_and_their_dequantized_logits(hybrid, kind):
    from edgelm.export.source import open_source

    files = hybrid[1]
    if kind not in files:
        pytest.skip("set EDGELM_LLAMA_CPP_PYTHON to a Python that imports llama_cpp to run llama.cpp's quantizer")
    model = export(files[kind], files[kind].with_suffix(".package"))
    recipe = json.loads((files[kind].with_suffix(".package") / "edgelm.json").read_text())["recipe"]
    assert recipe["float_linears"] == 0 and recipe["kept_linears"] > 0
    if kind == "Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= set(recipe["types"])
    ids = np.array([PROMPTS[2]], dtype=np.int64)
    with torch.no_grad():  # float64: the float32 reference is itself 7e-5 off at some positions
        dequantized = open_source(files[kind]).model.double()(torch.from_numpy(ids))[0].numpy()
    assert float(np.abs(model.forward(ids)[0] - dequantized).max()) < 1e-4


def test_llama_cpp_gives_the_packages_greedy_tokens_and_logits(hybrid):
    """On the f32 file, llama.cpp's greedy tokens are the package's and its logits the same within 1e-4. On a
    quantized file llama.cpp rounds the activations to 8 bits before each quantized matmul (q8_0 blocks of 32, q8_K
    of 256), which moves this random model's logits by tenths, past its narrow top-2 margins: there its logits must
    stay within 3 times of how far ONNX Runtime's own int8 activations (accuracy level 4) move them. A wrong value
    head order, for one, puts them 15 apart."""
    files = hybrid[1]
    prompt = PROMPTS[2]
    runs = json.loads(run_llama({"models": [str(f) for f in files.values()], "prompt": prompt, "new_tokens": 16}))
    for kind, path in files.items():
        ids, logits = runs[str(path)]["ids"], np.array(runs[str(path)]["logits"])
        model = export(path, path.with_suffix(".package"))
        ours = model.forward(np.array([prompt + ids]))[0][0]  # on llama.cpp's tokens
        if kind == "f32":
            assert model.generate(prompt, len(ids), temperature=0, ignore_eos=True).token_ids == ids
            assert float(np.abs(ours - logits).max()) < 1e-4
        else:
            int8 = export(path, path.with_suffix(".int8"), accuracy_level=4).forward(np.array([prompt + ids]))[0][0]
            assert float(np.abs(ours - logits).max()) < 3 * float(np.abs(ours - int8).max()), kind
