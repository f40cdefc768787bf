"""Export's proof separates right from wrong: it passes correct graphs whose int8 activations move logits far (tiny
files with the activation statistics of trained models, as a real Gemma 3 270M's move by 11) and refuses every
deliberate mistake of tests/mistakes.py, injected into the graph of a tiny model of each family it applies to,
on the float path (a folder's fused graph) and on the int8-activation path (a GGUF file's kept blocks). The same
mistakes on the two real files: benchmarks/proof_mistakes.py (docs/export.md, "The proof")."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import quiet  # noqa: E402
from mistakes import MISTAKES, NotApplicable, injected  # noqa: E402
from test_gguf import write_gguf  # noqa: E402
from test_gguf_export import KEEP_KINDS  # noqa: E402

from edgelm.export.onnx_export import export_package  # noqa: E402

OLD_INT8_BOUND = 4.0  # the proof's bound on an int8-activation graph's max |logit difference| before the float twin
REALISTIC = {"q8_0": (Q.Q8_0,), "mixed": KEEP_KINDS}
# (family case, mistakes that apply to it): the float path, a fused graph from each tiny folder
FLOAT_CASES = {
    "llama-llama3-tied": ["rope_base", "rope_scaling", "head_order", "gate_up", "attention_scale"],
    "qwen3": ["rope_base", "head_order", "gate_up", "attention_scale"],
    "gemma3_text": [
        "rope_base", "rope_scaling", "norm_plus_one", "head_order", "gate_up", "sliding_window", "embedding_scale",
        "attention_scale",
    ],
    "gemma4_text-shared": ["rope_base", "head_order", "softcap", "sliding_window", "embedding_scale", "kv_source"],
}  # fmt: skip
INT8_MISTAKES = ["rope_base", "rope_scaling", "head_order", "gate_up", "attention_scale"]


@pytest.fixture(scope="module")
def realistic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("realistic")
    return {name: write_gguf(folder / name, "llama", kinds=kinds, real_stats=True) for name, kinds in _mkdirs(folder)}


def _mkdirs(folder):
    for name, kinds in REALISTIC.items():
        (folder / name).mkdir()
        yield name, kinds


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_realistic_int8_models_pass_the_proof_the_old_bound_refused(name, realistic, tmp_path):
    """Massive activations, outlier channels and a large logit scale: int8 activations move the logits past the
    old bound while the distributions barely move; the float twin is float32-exact."""
    manifest = export_package(realistic[name], tmp_path / "pkg", progress=quiet)
    parity = manifest["parity"]
    assert parity["int8"]["max_abs_logit_diff"] > OLD_INT8_BOUND, "today's proof would refuse this model"
    assert parity["max_abs_logit_diff"] <= parity["tolerance"]
    assert parity["int8"]["mean_kl"] < 0.01 and parity["int8"]["top1_agreement"] >= 0.9


@pytest.mark.parametrize("mistake", INT8_MISTAKES)
def test_every_mistake_is_refused_on_the_int8_path(mistake, realistic, tmp_path):
    with injected(mistake), pytest.raises(RuntimeError, match="with float activations the graph") as info:
        export_package(realistic["mixed"], tmp_path / "pkg", progress=quiet)
    assert "accuracy" not in str(info.value), "no accuracy level makes a wrong graph right"
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize(
    ("case", "mistake"), [(case, mistake) for case, names in FLOAT_CASES.items() for mistake in names]
)
def test_every_mistake_is_refused_on_the_float_path(case, mistake, families, tmp_path):
    folder = families.model(case)[1]
    with injected(mistake), pytest.raises(RuntimeError, match="ONNX Runtime and PyTorch disagree"):
        export_package(folder, tmp_path / "pkg", progress=quiet)


def test_every_mistake_is_tried_somewhere():
    tried = set(INT8_MISTAKES).union(*FLOAT_CASES.values())
    assert tried == set(MISTAKES) - {"embedding_scale_bf16"}, "a mistake no case tries proves nothing"


def test_a_mistake_that_does_not_apply_says_so(families, tmp_path):
    with injected("softcap"), pytest.raises(NotApplicable):
        export_package(families.model("qwen3")[1], tmp_path / "pkg", progress=quiet)
