"""Batch composition: a row's greedy output must not depend on the other rows of its batch.

Prompts of 1 to 100 tokens in one batch, greedy, against each prompt run alone. fp32,
int8-weight-only (MatMulNBits 8-bit blocks: the kernel quantizes activations per row and block) and
int4 (the same kernel, 4-bit blocks) must agree on every row. Dynamic int8 (DynamicQuantizeMatMul)
takes one activation scale over the whole batch, and static int8's LM head does the same (its blocks
use calibrated, fixed scales): there a row can change with its batch, as the README says; those cases
hold the number of rows that differ to what was recorded, so that a change either way is noticed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import quiet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_hf_checkpoint
from edgelm.runtime import load

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"
NEW_TOKENS = 12
LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 80, 100, 1, 7, 64, 99, 40]
# Rows of LENGTHS that differ from the row alone, as recorded (onnxruntime 1.32, x86-64, one thread): dynamic
# int8 row 7 only, static int8 none. Integer kernels differ between CPUs (AVX2 saturates where VNNI does not),
# so the test allows a margin: a broken batch (padding, positions, masks) changes most rows, far past it.
MOST_ROWS_DIFFERING = {"dynamic": 4, "static": 4}


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    from edgelm.export.onnx_export import export_package
    from edgelm.quantize.quantize import quantize_package

    root = tmp_path_factory.mktemp("batch")
    checkpoint = make_hf_checkpoint(root / "ckpt", seed=3, n_positions=128)
    out = {"fp32": root / "fp32"}
    export_package(checkpoint, out["fp32"], progress=quiet)
    for mode in ("int8-weight-only", "int4", "dynamic", "static"):
        out[mode] = root / mode
        quantize_package(
            out["fp32"], out[mode], mode=mode, calibration_text=CALIBRATION, calibration_samples=4, progress=quiet
        )
    return out


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]  # id 0 is EOS


def rows_differing(model, batch: list[list[int]]) -> int:
    together = model.generate_batch(batch, NEW_TOKENS, ignore_eos=True)
    alone = [model.generate(p, NEW_TOKENS, ignore_eos=True) for p in batch]
    return sum(t.token_ids != a.token_ids for t, a in zip(together, alone, strict=True))


@pytest.mark.parametrize("precision", ["fp32", "int8-weight-only", "int4"])
def test_batch_invariant_precisions(packages, precision):
    model = load(packages[precision], provider="cpu", threads=1)
    assert model.spec.precision == precision
    assert rows_differing(model, prompts(model.vocab_size, LENGTHS)) == 0


@pytest.mark.parametrize("precision", ["dynamic", "static"])
def test_int8_with_run_time_activation_scales_can_depend_on_the_batch(packages, precision):
    model = load(packages[precision], provider="cpu", threads=1)
    assert model.spec.precision == f"int8-{precision}"
    differing = rows_differing(model, prompts(model.vocab_size, LENGTHS))
    print(f"{precision} int8: {differing} of {len(LENGTHS)} rows differ from the row alone")
    assert differing <= MOST_ROWS_DIFFERING[precision], (
        f"{precision} int8: {differing} of {len(LENGTHS)} rows differ from the row alone, more than the "
        f"{MOST_ROWS_DIFFERING[precision]} one activation scale over the batch explains"
    )


@settings(
    max_examples=15,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(lengths=st.lists(st.integers(1, 100), min_size=2, max_size=6), seed=st.integers(0, 1000))
def test_any_batch_composition_int8_weight_only(packages, lengths, seed):
    model = load(packages["int8-weight-only"], provider="cpu", threads=1)
    assert rows_differing(model, prompts(model.vocab_size, lengths, seed)) == 0
