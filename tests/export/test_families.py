"""Every family row (export/families/ FAMILIES) against transformers: a tiny random model of the row's
model_type (tests/family_cases.py) exported from its folder with both graphs and, where the row reads GGUF
files, from a GGUF file of the same weights as llama.cpp writes them; edgelm's runtime gives transformers'
logits and greedy tokens (batch 1 and a padded batch), the reference model gives its logits, and
onnxruntime-genai runs the fused package. A row without a case fails here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from family_cases import CASES, EOS, NEW_TOKENS, PROMPTS, quick_or_slow
from helpers import genai_greedy

from edgelm.export.families import FAMILIES
from edgelm.runtime import load

TOLERANCE = 1e-4
RUNS = [
    quick_or_slow(case, source)
    for case in sorted(CASES)
    for source in (*CASES[case].graphs, *(("gguf",) * CASES[case].gguf))
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def kv_heads(config) -> int:
    """The first layer's KV heads (Gemma 4's full layers may have others: transformers then refuses the attribute)."""
    return config.to_dict().get("num_key_value_heads") or config.num_attention_heads  # GPT-2: every head


def test_every_family_row_has_a_case():
    assert {case.model_type for case in CASES.values()} == set(FAMILIES)


@pytest.mark.parametrize("case,source", RUNS)
def test_logits_equal_transformers(case, source, families):
    hf, _ = families.model(case)
    model = load(families.package(case, source), provider="cpu")
    assert model.spec.arch.n_kv_head == kv_heads(hf.config)
    assert model.spec.arch.type == FAMILIES[CASES[case].model_type].name
    ids = np.array([PROMPTS[2]], dtype=np.int64)
    logits, present = model.forward(ids)
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids)).logits.numpy()
    difference = float(np.abs(logits - reference).max())
    print(f"{case} {source}: max |logit difference| {difference:.2e}")
    assert difference < TOLERANCE
    key = model.spec.arch.cache_kinds().index("key")  # a hybrid model's first layers may hold a state
    assert present[key].shape[1] == kv_heads(hf.config)  # the cache holds the KV heads only


@pytest.mark.parametrize("case,source", RUNS)
def test_greedy_equals_transformers_batch_1_and_padded(case, source, families):
    model = load(families.package(case, source), provider="cpu")
    tokens = families.expected(case)
    assert len(set(tokens[0])) > 4, tokens[0]  # a model repeating one token would make this test weak
    assert model.generate(PROMPTS[0], NEW_TOKENS, temperature=0, ignore_eos=True).token_ids == tokens[0]
    batch = model.generate_batch(PROMPTS, NEW_TOKENS, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in batch] == tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_model_equals_transformers(case, families):
    from edgelm.export.source import open_source

    hf, folder = families.model(case)
    source = open_source(folder)
    assert source.family is FAMILIES[CASES[case].model_type]
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert (source.model(ids)[0] - hf(ids).logits).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("case", [quick_or_slow(c) for c in sorted(CASES) if FAMILIES[CASES[c].model_type].genai_type])
def test_onnxruntime_genai_runs_the_package(case, families):
    package = families.package(case, CASES[case].graphs[0])
    genai = json.loads((package / "genai_config.json").read_text())
    assert genai["model"]["type"] == FAMILIES[CASES[case].model_type].genai_type
    assert genai["model"]["decoder"]["num_key_value_heads"] == kv_heads(families.model(case)[0].config)
    for prompt, tokens in zip(PROMPTS[:2], families.expected(case)[:2], strict=True):
        assert EOS not in tokens  # else genai would stop early, by design
        assert genai_greedy(package, prompt, NEW_TOKENS) == tokens
