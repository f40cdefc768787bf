"""Packages that keep a GGUF file's blocks as the file stores them (export --packed-blocks, runtime/packed.py): the
package is the file's size; the native kernels' logits agree with today's MatMulNBits package within the int8
tolerance; the fallback (native kernels off) runs the same package and gives today's package's logits exactly;
speculative decoding stays exact on the kernels; onnxruntime-genai runs the package through its custom_ops_library."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
from helpers import genai_greedy, quiet

from edgelm.export.onnx_export import export_package
from edgelm.runtime import load, native, packed
from edgelm.runtime.onnx_external import operators

pytestmark = pytest.mark.slow  # the real GGUF files, packed


PROMPT = "The capital of France is"
INT8_LOGIT_NOISE = 4.0  # two int8-activation roundings of SmolLM2 apart: each moves its logits by up to about 2


def exported(source, folder, **options):
    export_package(source, folder, progress=quiet, **options)
    return folder


@pytest.fixture(scope="module")
def smol_packed(smollm2_gguf, tmp_path_factory):
    return exported(smollm2_gguf, tmp_path_factory.mktemp("packed") / "smol", packed_blocks=True)


@pytest.fixture(scope="module")
def smol_plain(smollm2_gguf, tmp_path_factory):
    return exported(smollm2_gguf, tmp_path_factory.mktemp("plain") / "smol")


@pytest.fixture
def no_native(monkeypatch):
    """The native kernels off (EDGELM_NATIVE=0) for one test."""
    monkeypatch.setenv("EDGELM_NATIVE", "0")
    native.ops_library.cache_clear()
    yield
    native.ops_library.cache_clear()


def needs_native():
    try:
        native.ops_library()
    except native.NativeUnavailable as error:
        pytest.skip(f"native kernels not built here: {error}")


def package_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def logits(folder, ids) -> tuple[np.ndarray, packed.KernelPath | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's one warning
        model = load(folder, provider="cpu", threads=2)
    return model.forward(np.array([ids], np.int64))[0][0], packed.kernel_path(model.session)


def test_packed_package_is_the_files_size(smol_packed, smollm2_gguf):
    manifest = json.loads((smol_packed / "edgelm.json").read_text())
    assert manifest["recipe"]["storage"] == "packed"
    assert package_bytes(smol_packed) <= 1.05 * smollm2_gguf.stat().st_size
    ops = {(op.domain, op.op_type) for op in operators(smol_packed / "model.onnx")}
    assert {(packed.DOMAIN, "MatMulPacked"), (packed.DOMAIN, "GatherPacked")} <= ops
    assert not any(op_type == "MatMulNBits" for _, op_type in ops)


def test_native_logits_agree_with_todays_package(smol_packed, smol_plain):
    needs_native()
    model = load(smol_plain, provider="cpu", threads=2)
    ids = model.encode(PROMPT)
    ours, path = logits(smol_packed, ids)
    theirs, _ = logits(smol_plain, ids)
    assert path is not None and path.native, path
    assert np.abs(ours - theirs).max() < INT8_LOGIT_NOISE
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.8  # the int8 roundings differ, the answers rarely


def test_fallback_runs_the_same_package_as_todays(smol_packed, smol_plain, no_native):
    """With the kernels off the runtime converts the blocks at load into today's arrays: the same logits, bit for
    bit, as the package exported as MatMulNBits; it says so once, and info says which path runs."""
    model = load(smol_plain, provider="cpu", threads=2)
    ids = model.encode(PROMPT)
    with pytest.warns(RuntimeWarning, match="EDGELM_NATIVE=0"):
        packed._warned.clear()
        fallback = load(smol_packed, provider="cpu", threads=2)
    assert fallback.info()["kernels"] == {"path": "fallback", "isa": None, "reason": "turned off by EDGELM_NATIVE=0"}
    ours = fallback.forward(np.array([ids], np.int64))[0][0]
    theirs = model.forward(np.array([ids], np.int64))[0][0]
    assert np.array_equal(ours, theirs)
    assert fallback.generate(PROMPT, max_new_tokens=8).token_ids == model.generate(PROMPT, max_new_tokens=8).token_ids


def test_fallback_refuses_a_package_without_its_graph(smol_packed, tmp_path, no_native):
    copy = tmp_path / "copy"
    shutil.copytree(smol_packed, copy)
    (copy / packed.FALLBACK_PLAN).unlink()
    with pytest.raises(Exception, match="has no model.fallback.onnx / model.fallback.json"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            load(copy, provider="cpu", threads=1, verify=False)


def test_speculative_decoding_stays_exact_on_the_kernels(smol_packed):
    """Prompt-lookup speculation gives the plain greedy tokens. Each row of a step is quantized on its own, but the
    float noise of a several-token step upstream (attention) can move an int8 rounding, so the runtime's step check
    may turn speculation off with a warning, as for MatMulNBits at accuracy level 4: the tokens stay the plain ones."""
    needs_native()
    model = load(smol_packed, provider="cpu", threads=2)
    prompt = "one two three four, one two three four, one two three four, one two"
    plain = model.generate(prompt, max_new_tokens=24, ignore_eos=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "speculative decoding is off", where the check says so
        fast = model.generate(prompt, max_new_tokens=24, ignore_eos=True, speculative="lookup")
    assert fast.token_ids == plain.token_ids


def test_onnxruntime_genai_runs_it_with_the_custom_ops(smol_packed, tmp_path):
    """onnxruntime-genai opens the package through its session option custom_ops_library, the library built here
    (packed.genai_config_with_ops), and decodes greedily as edgelm's runtime does."""
    needs_native()
    pytest.importorskip("onnxruntime_genai")
    copy = tmp_path / "genai"
    shutil.copytree(smol_packed, copy)
    packed.add_genai_custom_ops(copy)
    model = load(smol_packed, provider="cpu", threads=2)
    ids = model.encode(PROMPT)
    ours = model.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids
    assert genai_greedy(copy, ids, 10) == ours


@pytest.mark.slow
def test_gemma3_q4_k_m_packed(gemma3_gguf, tmp_path, real_default_packages):
    """The real Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0; a tied Q8_0 head) exports to a package of its blocks' size whose
    export proof passes through the native kernels (the float twin: its fallback graph at accuracy level 0; the
    graph as shipped: the kernels, by KL). The kernels' activation groups of 32 come out closer to PyTorch than the
    default package's MatMulNBits blocks at accuracy level 4 (which the fallback graph as shipped equals, bit for
    bit: test_fallback_runs_the_same_package_as_todays)."""
    needs_native()
    folder = exported(gemma3_gguf, tmp_path / "gemma", packed_blocks=True)
    tokenizer = sum((folder / name).stat().st_size for name in ("tokenizer.json", "tokenizer_config.json"))
    assert package_bytes(folder) - tokenizer <= 1.05 * gemma3_gguf.stat().st_size
    kernels = json.loads((folder / "edgelm.json").read_text())["parity"]
    assert kernels["max_abs_logit_diff"] <= kernels["tolerance"]
    default = real_default_packages("gemma3", gemma3_gguf)[1]["parity"]
    assert kernels["int8"]["mean_kl"] < default["int8"]["mean_kl"]
