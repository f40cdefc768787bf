"""How the SmolLM3, Granite and Phi-3 family modules read config.json: transformers' rules where a key is absent
or written the older way, and a one-line CheckpointError for what the reference model does not implement."""

from __future__ import annotations

import math

import pytest

from edgelm.export.checkpoint import CheckpointError
from edgelm.export.families import granite, phi3, smollm3

LLAMA = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
             intermediate_size=96, max_position_embeddings=4096, rms_norm_eps=1e-5, eos_token_id=0)  # fmt: skip
FACTORS = dict(short_factor=[1.0] * 6, long_factor=[2.0] * 6)  # head_dim 16, 3/4 of it rotating


def test_smollm3_nope_layers_from_the_interval_or_the_list():
    hf = LLAMA | dict(model_type="smollm3")
    assert smollm3.config_from_hf(hf).rotary_layers == [True, True, True, False] * 2
    assert smollm3.config_from_hf(hf | dict(no_rope_layer_interval=2)).rotary_layers == [True, False] * 4
    flags = [1, 0, 1, 1, 1, 1, 1, 0, 1]  # longer than the layers, as transformers allows
    assert smollm3.config_from_hf(hf | dict(no_rope_layers=flags)).rotary_layers == [bool(f) for f in flags[:8]]
    assert smollm3.config_from_hf(hf).rope_theta == 2_000_000.0  # SmolLM3Config.default_theta
    with pytest.raises(CheckpointError, match="no_rope_layers"):
        smollm3.config_from_hf(hf | dict(no_rope_layers=[1, 0]))


def test_granite_multipliers_default_to_transformers_ones():
    config = granite.config_from_hf(LLAMA | dict(model_type="granite", logits_scaling=8.0))
    assert (config.embedding_multiplier, config.attention_multiplier, config.residual_multiplier) == (1.0, 1.0, 1.0)
    assert config.logits_scaling == 8.0


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(layer_types=["attention", "mamba"] * 4), "Mamba"),
        (dict(num_local_experts=4), "num_local_experts"),
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
    ],
)
def test_granite_hybrid_refuses_what_is_not_dense(change, match):
    hf = LLAMA | dict(model_type="granitemoehybrid", layer_types=["attention"] * 8, num_local_experts=0)
    assert granite.hybrid_config_from_hf(hf | dict(position_embedding_type="rope")).rotary_layers is None
    assert granite.hybrid_config_from_hf(hf).rotary_layers == [False] * 8  # no position embedding: NoPE
    with pytest.raises(CheckpointError, match=match):
        granite.hybrid_config_from_hf(hf | change)


def test_phi3_longrope_as_transformers_reads_it():
    hf = LLAMA | dict(model_type="phi3", partial_rotary_factor=0.75, original_max_position_embeddings=1024)
    # 4.x's rope_scaling with type su; the top-level original context wins over the entry's own
    config = phi3.config_from_hf(
        hf | dict(rope_scaling=dict(type="su", original_max_position_embeddings=64, **FACTORS))
    )
    scaling = config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 1024
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024)))
    assert config.rotary_dim == 12
    # without the top-level key transformers' Phi3Config default, 4096, applies
    no_original = {k: v for k, v in hf.items() if k != "original_max_position_embeddings"}
    config = phi3.config_from_hf(no_original | dict(rope_parameters=dict(rope_type="longrope", **FACTORS)))
    assert config.rope_scaling["original_max_position_embeddings"] == 4096
    assert config.rope_scaling["attention_factor"] == 1.0  # max_position_embeddings / 4096 = 1: no factor


@pytest.mark.parametrize(
    "scaling, match",
    [
        (dict(rope_type="longrope", short_factor=[1.0] * 5, long_factor=[1.0] * 6), "short_factor"),
        (dict(rope_type="longrope", short_factor=[1.0] * 6), "long_factor"),
        (dict(rope_type="dynamic", factor=2.0), "dynamic"),
    ],
)
def test_phi3_refuses_bad_rope(scaling, match):
    with pytest.raises(CheckpointError, match=match):
        phi3.config_from_hf(LLAMA | dict(model_type="phi3", partial_rotary_factor=0.75, rope_scaling=scaling))
