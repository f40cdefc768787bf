"""`edgelm info` tells the truth: a quantized package shows its own accuracy report (or says it has none), not its
fp32 source's export check; kept GGUF blocks show their real bit widths; the export check is explained (level-4
int8 activations are not a failure). Text output only: `--json` keeps the manifest's records as they are."""

from __future__ import annotations

import pytest
from helpers import copy_package, edit_manifest, quiet

from edgelm.cli import main
from edgelm.cli.describe import export_check, weights

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf import write_gguf  # noqa: E402


def info_lines(capsys, package) -> dict[str, str]:
    assert main(["info", str(package)]) == 0
    return dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())


def test_kept_blocks_show_their_bit_widths_and_the_check_is_explained(tmp_path, capsys):
    from edgelm.export.onnx_export import export_package

    path = write_gguf(tmp_path, "llama", kinds=(Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.F16))
    manifest = export_package(path, tmp_path / "pkg", progress=quiet)  # accuracy level 4
    kept = manifest["recipe"]["kept_bits"]
    assert manifest["precision"] == "int4" and kept["int8"] > 0  # "int4" alone would hide the 8-bit linears
    lines = info_lines(capsys, tmp_path / "pkg")
    assert lines["weights"].startswith(
        f"the GGUF file's own blocks (MatMulNBits): 4-bit {kept['int4']} linears, 8-bit {kept['int8']} linears, "
        f"{manifest['recipe']['float_linears']} float; LM head 4-bit; the file's tensors: "
    )
    assert lines["source"] == f"exported from tiny-llama.gguf (sha256 {manifest['source']['sha256'][:12]}...)"
    check = lines["export_check"]
    assert check.startswith("passed: ONNX Runtime against PyTorch float64") and "float twin" in check
    assert f"max |logit difference| {manifest['parity']['max_abs_logit_diff']:.1e} (allowed 1e-03)" in check
    assert f"mean KL {manifest['parity']['int8']['mean_kl']:.1e} nats (allowed 0.25)" in check
    assert "parity" not in lines


def test_a_quantized_package_shows_its_own_figures(package, tmp_path, capsys):
    from edgelm.quantize.quantize import quantize_package

    quantize_package(package, tmp_path / "int4", mode="int4", progress=quiet)
    lines = info_lines(capsys, tmp_path / "int4")
    assert lines["source"] == f"quantized from the package {package.name}"
    assert "max |logit difference|" not in " ".join(lines.values())  # the fp32 source's figure
    assert lines["export_check"].startswith(f"the one recorded is its source's ({package.name})")
    assert lines["accuracy"].startswith("not measured (quantized without --eval-text)")
    assert lines["weights"].startswith("int4 blocks of 32 (MatMulNBits, round to nearest), LM head int8")

    report = {"perplexity_ratio": 1.0123, "top1_agreement": 0.975, "mean_kl_nats": 0.0123, "tokens": 12345}
    report |= {"reference": package.name, "text": "heldout.txt"}
    folder = copy_package(tmp_path / "int4", tmp_path, "evaluated")
    edit_manifest(folder, lambda data: data.__setitem__("evaluation", report))
    assert info_lines(capsys, folder)["accuracy"] == (
        f"against {package.name} on heldout.txt (12,345 tokens): perplexity x1.0123, top-1 agreement 97.50%, "
        "mean KL 0.01230 nats"
    )


def test_weights_of_a_mostly_8_bit_file():
    """SmolLM2's Q4_K_M as llama.cpp writes it (docs/results.md): most linears Q5_0 or Q8_0 (8-bit nodes)."""
    recipe = {
        "mode": "gguf", "kept_bits": {"int4": 16, "int8": 104}, "float_linears": 0, "lm_head": "int8",
        "types": {"Q5_0": 90, "Q8_0": 16, "Q4_K": 16, "Q6_K": 14, "F32": 61},
    }  # fmt: skip
    assert weights("int4", recipe) == (
        "the GGUF file's own blocks (MatMulNBits): 4-bit 16 linears, 8-bit 104 linears; LM head 8-bit; the file's "
        "tensors: Q5_0 90, F32 61, Q8_0 16, Q4_K 16, Q6_K 14"
    )


def test_export_check_words():
    exact = {"max_abs_logit_diff": 3e-6, "tolerance": 1e-4, "decode_steps": 5, "batch": 2, "reference": "PyTorch"}
    assert export_check(exact, {}).endswith("max |logit difference| 3.0e-06 (allowed 1e-04): the same model")
    assert export_check(exact | {"max_abs_logit_diff": 2.0}, {}).startswith("FAILED")
    assert export_check(None, {}) is None
