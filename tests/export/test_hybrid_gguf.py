"""Qwen3.5 and LFM2 from GGUF files. What a qwen35 file's metadata can say that export refuses, in one line. And
llama.cpp itself: its converter's f32 and q8_0 files and its quantizer's Q4_K_M, exported and checked against
transformers (f32), against the file's own dequantized weights (the blocks kept, MatMulNBits at accuracy level 0),
and against llama.cpp's own greedy tokens on the same file (tests/export/test_families.py checks files of tests/
family_cases.py's writer, which mirrors the converter, against transformers).

The converter's models are 256 wide, so every linear takes K-quant super-blocks, and Qwen3.5's 8 value heads share
2 key heads: llama.cpp's converter moves them into its tiled order, which at that ratio is not its own inverse.
The Qwen3.5 folder carries a multi-token-prediction block, as published checkpoints do: the converter writes it
after the last layer and export leaves it out. Each folder carries a real chat template, which the package keeps.

The converter is the one tests/export/test_families_converter.py uses (fetched from llama-cpp-python's sdist, or
$EDGELM_LLAMA_CPP); the quantizer and the greedy runs also need $EDGELM_LLAMA_CPP_PYTHON, a Python that imports
llama_cpp (benchmarks/setup_llamacpp.sh builds one). Skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from family_cases import CASES, LFM2, NEW_TOKENS, PROMPTS, QWEN35
from gguf import GGUFValueType as V
from helpers import hf_greedy, quiet, rewrite_gguf, save_random_model
from test_families_converter import convert, llama_cpp  # noqa: F401 (a fixture)

from edgelm.cli import main
from edgelm.runtime import load

# slow: llama.cpp's converter and llama.cpp itself on the hybrids
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

# the 64-wide cases' initializer_range over sqrt(4): logits about as large (at 0.15 this Qwen3.5's reach 18 and
# float32 alone moves them by 2e-4)
WIDE = {"hidden_size": 256, "intermediate_size": 256, "initializer_range": 0.075}
# case -> (its config, the converter's pre-tokenizer label, a chat template of llama.cpp's models/templates/)
HYBRIDS = {
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
def hybrid(request, llama_cpp, tmp_path_factory):  # noqa: F811
    """(the transformers model, {file type: its GGUF file}, its chat template)."""
    case = request.param
    config, pre, template_name = HYBRIDS[case]
    tmp = tmp_path_factory.mktemp(case)
    hf = save_random_model(tmp / "folder", CASES[case].classes, config)
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
