"""Hugging Face config.json values checked like GGUF metadata (tests/export/test_gguf_metadata.py): every number the
loaders read is one number of its type, in range, before anything is built from it; `int(1.5)` no longer reads a
broken config as a working one. The rotary tables export builds per position are bounded before they are built."""

from __future__ import annotations

import json

import pytest

from conftest import make_hf_checkpoint, make_tokenizer
from edgelm.cli import main
from edgelm.export.checkpoint import CheckpointError
from edgelm.export.families.gemma3 import config_from_hf as gemma3_config_from_hf
from edgelm.export.families.gpt2 import config_from_hf
from edgelm.export.families.llama import config_from_hf as llama_config_from_hf
from edgelm.export.models.llama import LlamaConfig, rope_cos_sin

NAN = float("nan")
LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
             num_hidden_layers=2, intermediate_size=96, max_position_embeddings=128, hidden_act="silu")  # fmt: skip
GPT2 = dict(model_type="gpt2", vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=4)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

LLAMA_BAD = {
    "rope_theta NaN": (dict(rope_theta=NAN), "rope_theta = nan is out of range"),
    "rope_theta 0": (dict(rope_theta=0), "rope_theta = 0.0"),
    "rope_theta negative (transformers 5)": (dict(rope_parameters={"rope_theta": -1e4}), "rope_theta = -10000.0"),
    "rope_theta string": (dict(rope_theta="1e4"), "rope_theta should be a single float"),
    "linear factor NaN": (dict(rope_scaling={"rope_type": "linear", "factor": NAN}), "factor = nan"),
    "linear factor 0": (dict(rope_scaling={"rope_type": "linear", "factor": 0.0}), "factor = 0.0"),
    "llama3 factor negative": (dict(rope_scaling=LLAMA3 | {"factor": -8.0}), "factor = -8.0"),
    "llama3 equal band": (dict(rope_scaling=LLAMA3 | {"high_freq_factor": 1.0}), "above its low_freq_factor"),
    "epsilon NaN": (dict(rms_norm_eps=NAN), "rms_norm_eps = nan"),
    "epsilon 0": (dict(rms_norm_eps=0.0), "rms_norm_eps = 0.0"),
    "epsilon 2": (dict(rms_norm_eps=2.0), "below 1"),
    "heads 6.5": (dict(num_attention_heads=6.5), "num_attention_heads should be a single int, not 6.5"),
    "heads 6.0": (dict(num_attention_heads=6.0), "not 6.0"),
    "heads true": (dict(num_attention_heads=True), "not True"),
    "heads 0": (dict(num_attention_heads=0), "num_attention_heads = 0"),
    "kv heads negative": (dict(num_key_value_heads=-2), "num_key_value_heads = -2"),
    "layers list": (dict(num_hidden_layers=[2]), "not [2]"),
    "context 2**31": (dict(max_position_embeddings=2**31), "max_position_embeddings = 2147483648 is out of range"),
    "context 2**31 - 1": (dict(max_position_embeddings=2**31 - 1), "limit of 16777216 (2**24) positions"),
    "context 4": (dict(max_position_embeddings=4), "below 8 positions"),
    "context 128.5": (dict(max_position_embeddings=128.5), "not 128.5"),
    "window 1.5": (dict(model_type="mistral", sliding_window=1.5), "sliding_window should be a single int"),
    "window 4": (dict(model_type="mistral", sliding_window=4), "sliding_window = 4 is below 8 positions"),
}


@pytest.mark.parametrize("name", sorted(LLAMA_BAD))
def test_llama_config_values_are_checked(name):
    overrides, expected = LLAMA_BAD[name]
    with pytest.raises(CheckpointError) as info:
        llama_config_from_hf(LLAMA | overrides)
    assert expected in str(info.value), str(info.value)


def test_llama_config_good_values_pass():
    config = llama_config_from_hf(LLAMA | dict(rope_theta=500000, rms_norm_eps=1e-5, rope_scaling=LLAMA3))
    assert config.rope_theta == 500000.0 and config.rms_norm_eps == 1e-5
    assert config.rope_scaling == LLAMA3 | {"original_max_position_embeddings": 128}


GEMMA3 = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
              sliding_window=8)  # fmt: skip
NESTED = {"full_attention": {"rope_type": "default", "rope_theta": 1e5}, "sliding_attention": {"rope_theta": 2e4}}
LINEAR = {"rope_type": "linear", "factor": 4.0}
GEMMA3_READ = {  # configs transformers' Gemma3TextConfig reads: the rotary parameters it arrives at are ours
    "transformers 4: flat keys": dict(rope_theta=5e5, rope_local_base_freq=3e4, rope_scaling=LINEAR),
    "transformers 5: per layer type": dict(rope_parameters=NESTED),
    "a legacy rope_scaling beside rope_parameters, merged": dict(rope_parameters=NESTED, rope_scaling=LINEAR),
    "rope_parameters' bases win over the flat keys": dict(rope_parameters=NESTED, rope_theta=7.0,
                                                          rope_local_base_freq=9.0),
    "only the full layers' entry": dict(rope_parameters={"full_attention": LINEAR}, rope_local_base_freq=3e4),
    "the defaults": dict(),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GEMMA3_READ))
def test_gemma3_rotary_parameters_are_read_as_transformers_reads_them(name):
    from transformers import Gemma3TextConfig

    hf = json.loads(json.dumps(GEMMA3 | GEMMA3_READ[name]))  # transformers changes the dicts it is given
    theirs = Gemma3TextConfig(**{k: v for k, v in json.loads(json.dumps(hf)).items() if k != "model_type"})
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    ours = gemma3_config_from_hf(hf)
    assert ours.rope_theta == full["rope_theta"] and ours.rope_local_theta == local["rope_theta"]
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    assert ours.rope_scaling == (None if scaling["rope_type"] == "default" else scaling)


GEMMA3_BAD = {
    "yarn beside rope_parameters": (
        dict(rope_parameters=NESTED, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"
    ),
    "rope_scaling named by 'type'": (dict(rope_scaling={"type": "linear", "factor": 4.0}), "names no rope_type"),
    "rope_scaling a list": (dict(rope_scaling=[LINEAR]), "rope_scaling must be an object"),
    "rope_parameters a list": (dict(rope_parameters=[NESTED]), "rope_parameters must be an object"),
    "rope_parameters flat": (dict(rope_parameters=LINEAR | {"rope_theta": 1e4}), "rope_parameters holds 'factor'"),
    "full entry a string": (dict(rope_parameters={"full_attention": "linear"}), "rope_parameters.full_attention must"),
    "local base a string": (dict(rope_local_base_freq="1e4"), "rope_local_base_freq should be a single float"),
    "local base negative": (dict(rope_local_base_freq=-1e4), "rope_local_base_freq = -10000.0 is out of range"),
    "nested local base a string": (
        dict(rope_parameters={"sliding_attention": {"rope_theta": "x"}}),
        "rope_parameters.sliding_attention.rope_theta should be a single float",
    ),
    "nested full base 0": (
        dict(rope_parameters={"full_attention": {"rope_theta": 0}}), "rope_parameters.full_attention.rope_theta = 0.0"
    ),
    "final softcapping 0": (dict(final_logit_softcapping=0.0), "final_logit_softcapping=0.0"),
    "attention softcapping 0": (dict(attn_logit_softcapping=0), "attn_logit_softcapping=0"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GEMMA3_BAD))
def test_gemma3_config_values_are_one_line_errors_naming_the_key(name):
    overrides, expected = GEMMA3_BAD[name]
    with pytest.raises(CheckpointError) as info:
        gemma3_config_from_hf(GEMMA3 | overrides)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


GPT2_BAD = {
    "epsilon NaN": (dict(layer_norm_epsilon=NAN), "layer_norm_epsilon = nan"),
    "epsilon negative": (dict(layer_norm_epsilon=-1e-5), "above 0"),
    "eos id 1.5": (dict(eos_token_id=1.5), "eos_token_id should be a single int, not 1.5"),
    "bos id list": (dict(bos_token_id=[0]), "bos_token_id should be a single int"),
    "bos id negative": (dict(bos_token_id=-1), "bos_token_id = -1 is out of range"),
    "heads 4.5": (dict(n_head=4.5), "n_head should be a single int"),
    "context 2**31 - 1": (dict(n_positions=2**31 - 1), "limit of 16777216"),
    "n_ctx 2**24 + 1": (dict(n_positions=None, n_ctx=2**24 + 1), "n_ctx = 16777217 is above"),
    "inner 0": (dict(n_inner=0), "n_inner = 0"),
}


@pytest.mark.parametrize("name", sorted(GPT2_BAD))
def test_gpt2_config_values_are_checked(name):
    overrides, expected = GPT2_BAD[name]
    with pytest.raises(CheckpointError) as info:
        config_from_hf(GPT2 | overrides)
    assert expected in str(info.value), str(info.value)


def test_gpt2_null_ids_take_the_defaults():
    config = config_from_hf(GPT2 | dict(bos_token_id=None, n_inner=None))
    assert config.bos_token_id == 50256 and config.n_inner is None


def test_cli_gpt2_config_eos_1_5_exits_1_and_writes_nothing(tmp_path, capsys):
    folder = make_hf_checkpoint(tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": 1.5}))
    capsys.readouterr()  # transformers' progress bar while the checkpoint was written
    assert main(["export", str(folder), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eos_token_id should be a single int, not 1.5" in err, err
    assert not (tmp_path / "out").exists()


def test_rotary_tables_are_bounded_before_they_are_built(monkeypatch):
    monkeypatch.setattr("edgelm.runtime.kvcache.available_memory_bytes", lambda: 1 << 20)
    config = LlamaConfig(vocab_size=256, n_positions=1 << 16, n_embd=48, n_layer=2, n_head=6, n_kv_head=2, n_inner=96)
    with pytest.raises(MemoryError, match=r"rotary cos and sin tables.*65536 positions need 0\.0 GiB while they are"):
        rope_cos_sin(config, config.n_positions)  # twice 65536 * 8 * 4 bytes = 4 MiB > 1 MiB
    cos, sin = rope_cos_sin(config, 1 << 14)  # twice 16384 * 8 * 4 bytes = 1 MiB: fits
    assert cos.shape == sin.shape == (1 << 14, 4)


def test_cli_tokenizer_larger_than_the_embedding_exits_1(tmp_path, capsys):
    folder = make_hf_checkpoint(tmp_path / "ckpt")  # 320 embedding rows
    make_tokenizer(folder, 400)
    capsys.readouterr()
    assert main(["export", str(folder), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 400 tokens but the model's embedding only 320 rows" in err, err
    assert not (tmp_path / "out").exists()


def test_cli_tokenizer_that_does_not_load_exits_1(tmp_path, capsys):
    folder = make_hf_checkpoint(tmp_path / "ckpt")
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    capsys.readouterr()
    assert main(["export", str(folder), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer.json does not load as a tokenizer" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(n_positions=2**24), "'transformer.wpe.weight' has shape (64, 32) but the config expects (16777216, 32)"),
        (dict(vocab_size=2**31 - 1), "'transformer.wte.weight' has shape (320, 32) but the config expects (2147483647"),
    ],
)
def test_gpt2_config_sizes_are_checked_against_the_tensors_before_allocating(tmp_path, overrides, expected):
    """The config's sizes are claims: the model was built (2 GiB of position table, 256 GiB of embedding, randomly
    initialised) before the tensors' shapes were compared with them."""
    from edgelm.export.families.gpt2 import load_checkpoint

    folder = make_hf_checkpoint(tmp_path / "ckpt", tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | overrides))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert expected in str(info.value), str(info.value)
