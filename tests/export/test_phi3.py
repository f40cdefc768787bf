"""Phi-3's LongRoPE while generating past the original context (64 tokens in tests/family_cases.py's
phi3-longrope-short): each step rotates its new keys by the short factors while the sequence is within the
original context and by the long ones after, and keys already cached keep theirs, as transformers' model does
when run step by step with its cache. (transformers' `generate` instead recomputes the whole sequence with the
long factors at the switch, Phi3ForCausalLM.prepare_inputs_for_generation; edgelm, like onnxruntime-genai, keeps
the cache.) Each row of a padded batch switches at its own length, as it would alone."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

from edgelm.runtime import load

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASE = "phi3-longrope-short"
NEW_TOKENS = 24
PROMPTS = [[(37 * i + 11) % 2000 + 5 for i in range(50)], [(53 * i + 7) % 2000 + 5 for i in range(44)]]


def stepwise_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' model fed the prompt, then one token at a time with its cache."""
    tokens = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([tokens[-1:]]), cache=out.past_key_values, use_cache=True)
    return tokens


@pytest.fixture(scope="module")
def expected(families):
    hf, _ = families.model(CASE)
    return [stepwise_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.mark.parametrize("source", ["fused", "standard"])
def test_generation_past_the_original_context_equals_transformers(source, families, expected):
    model = load(families.package(CASE, source), provider="cpu")
    assert model.generate(PROMPTS[0], NEW_TOKENS, temperature=0, ignore_eos=True).token_ids == expected[0]
    batch = model.generate_batch(PROMPTS, NEW_TOKENS, temperature=0, ignore_eos=True)
    assert [row.token_ids for row in batch] == expected


def test_transformers_generate_recomputes_at_the_switch(families, expected):
    """The one place edgelm and transformers' generate part: the step that crosses the original context."""
    hf, _ = families.model(CASE)
    generated = hf_greedy(hf, PROMPTS[0], NEW_TOKENS)
    switch = 64 - len(PROMPTS[0])  # the first token whose step rotates by the long factors
    assert generated[:switch] == expected[0][:switch]
    assert generated != expected[0]


def test_a_gguf_window_too_short_to_export_is_named_by_its_gguf_key():
    from edgelm.export.families.phi3 import gguf_config
    from edgelm.export.gguf_metadata import GGUFError

    meta = {
        "phi3.attention.head_count": 4, "phi3.embedding_length": 128, "phi3.attention.head_count_kv": 2,
        "phi3.context_length": 128, "phi3.feed_forward_length": 256, "phi3.block_count": 2,
        "phi3.attention.layer_norm_rms_epsilon": 1e-5,
    }  # fmt: skip
    for window in (0, 16, 128, 4096):  # none, a window that caps the context, one past it
        config = gguf_config(meta | {"phi3.attention.sliding_window": window}, {}, 2048)
        assert config["sliding_window"] == (window or None)
    with pytest.raises(GGUFError, match=r"phi3\.attention\.sliding_window = 1 is below 8") as caught:
        gguf_config(meta | {"phi3.attention.sliding_window": 1}, {}, 2048)
    assert "config.json" not in str(caught.value)
