"""The Llama-family reference model against transformers' LlamaForCausalLM, Qwen2ForCausalLM and
MistralForCausalLM: small random models saved with save_pretrained (plain, sharded, bf16) and loaded with
load_llama give the same logits (prompt, cached decode steps, a left-padded batch) and the same greedy
tokens; bad folders and configs give a clear CheckpointError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from edgelm.export.checkpoint import CheckpointError, read_extras, read_safetensors_folder
from edgelm.export.families.llama import config_from_hf as llama_config_from_hf
from edgelm.export.families.llama import load_llama
from edgelm.export.models.llama import Llama, LlamaConfig, rope_cos_sin

TOLERANCE = 1e-4
DECODE_STEPS = 4
GREEDY_TOKENS = 32
VOCAB = 256
# hidden 96 over 6 query heads and 2 KV heads: head_dim 16, GQA ratio 3.
SMALL = dict(
    vocab_size=VOCAB, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3,
    intermediate_size=128, max_position_embeddings=128, rope_theta=1e5, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
    # larger than the usual 0.02: a tiny model with small weights gives near-uniform logits and
    # repeats one token, so a wrong position or mask would not show
    initializer_range=0.15,
)  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
CASES = {
    # name: (transformers class name, config overrides, save options)
    "llama-llama3-untied": ("Llama", dict(rope_scaling=LLAMA3, tie_word_embeddings=False), {}),
    "llama-linear-tied-sharded": (
        "Llama",
        dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=True, num_hidden_layers=2),
        {"max_shard_size": "100KB"},
    ),
    "qwen2-biases-tied": ("Qwen2", dict(tie_word_embeddings=True), {}),
    "mistral-untied-bf16": ("Mistral", dict(tie_word_embeddings=False, sliding_window=4096), {"bf16": True}),
}


def make_hf_llama(folder: Path, family: str, overrides: dict, *, seed: int = 0, bf16: bool = False, **save):
    """A random transformers model saved with save_pretrained; returns it in fp32 (rounded through bf16 when
    the folder holds bf16 weights, so both sides compute with the same values)."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(**{**SMALL, **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):  # transformers initializes biases to zero: make them count
                param.normal_(0.0, 0.5)
            elif name.endswith("layernorm.weight") or name == "model.norm.weight":  # and the norms to one
                param.uniform_(0.5, 1.5)
    if bf16:
        model.to(torch.bfloat16).save_pretrained(folder, **save)
        # read back in fp32: .float() alone would keep the rotary frequencies rounded to bf16
        model = getattr(transformers, f"{family}ForCausalLM").from_pretrained(folder, dtype=torch.float32).eval()
    else:
        model.save_pretrained(folder, **save)
    model.generation_config.eos_token_id = None  # generate exactly GREEDY_TOKENS tokens
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, Llama, Path]:
    family, overrides, save = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_llama(folder, family, overrides, **save)
    return hf, load_llama(folder), folder


def test_folder_layout_is_what_the_case_says(pair) -> None:
    hf, ours, folder = pair
    name = folder.name
    assert (folder / "model.safetensors.index.json").is_file() == ("sharded" in name)
    assert ours.config.tie_word_embeddings == ("-tied" in name)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == ("-tied" in name)
    assert ours.config.attention_bias == ("qwen2" in name)
    assert ours.config.eos_token_ids == [2] and ours.config.bos_token_id == 1
    assert torch.equal(ours.inv_freq, hf.model.rotary_emb.inv_freq)


@torch.no_grad()
def test_logits_prompt_then_decode_batch_1(pair) -> None:
    hf, ours, _ = pair
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    out = hf(ids, use_cache=True)
    logits, present = ours(ids)
    assert (logits - out.logits).abs().max() < TOLERANCE
    assert present[0][0].shape == (1, ours.config.n_kv_head, 12, ours.config.head_dim)
    hf_cache, next_token = out.past_key_values, logits[:, -1:].argmax(-1)
    for _ in range(DECODE_STEPS):
        out = hf(next_token, past_key_values=hf_cache, use_cache=True)
        logits, present = ours(next_token, past_key_values=present)
        assert (logits - out.logits).abs().max() < TOLERANCE
        hf_cache, next_token = out.past_key_values, logits[:, -1:].argmax(-1)
    assert present[-1][1].shape == (1, ours.config.n_kv_head, 12 + DECODE_STEPS, ours.config.head_dim)


def left_padded_batch(lengths: list[int], seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, position_ids (B, T) for prompts of these lengths, padded on the left."""
    T = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), T), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, T - n :] = 1
    ids = ids.masked_fill(mask == 0, 0)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, position_ids


@torch.no_grad()
def test_logits_left_padded_batch_with_cache(pair) -> None:
    hf, ours, _ = pair
    ids, mask, position_ids = left_padded_batch([11, 7, 3])
    out = hf(ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    logits, present = ours(ids, mask, position_ids)
    real = mask.bool()  # padded positions' logits are meaningless on both sides
    assert (logits[real] - out.logits[real]).abs().max() < TOLERANCE
    assert not torch.isnan(logits).any()  # fully masked (padding) rows stay finite
    hf_cache, next_token = out.past_key_values, logits[:, -1:].argmax(-1)
    for _ in range(DECODE_STEPS):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        position_ids = position_ids[:, -1:] + 1
        out = hf(next_token, attention_mask=mask, position_ids=position_ids, past_key_values=hf_cache, use_cache=True)
        logits, present = ours(next_token, mask, position_ids, present)
        assert (logits - out.logits).abs().max() < TOLERANCE
        hf_cache, next_token = out.past_key_values, logits[:, -1:].argmax(-1)


@torch.no_grad()
def test_greedy_tokens_equal_transformers_generate(pair) -> None:
    hf, ours, _ = pair
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = hf.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)[:, prompt.shape[1] :]
    tokens = ours.generate_greedy(prompt, GREEDY_TOKENS)
    assert tokens.tolist() == expected.tolist()
    assert len(set(tokens[0].tolist())) > 3, "a degenerate model would not test much"


@torch.no_grad()
def test_greedy_tokens_left_padded_batch(pair) -> None:
    hf, ours, _ = pair
    ids, mask, position_ids = left_padded_batch([9, 5, 2], seed=4)
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=GREEDY_TOKENS, do_sample=False)[:, ids.shape[1] :]
    logits, past = ours(ids, mask, position_ids)
    tokens = [logits[:, -1:].argmax(-1)]
    for _ in range(GREEDY_TOKENS - 1):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        position_ids = position_ids[:, -1:] + 1
        logits, past = ours(tokens[-1], mask, position_ids, past)
        tokens.append(logits[:, -1:].argmax(-1))
    assert torch.cat(tokens, dim=1).tolist() == expected.tolist()


def test_rope_cos_sin_match_transformers_rotary(pair) -> None:
    hf, ours, _ = pair
    cos, sin = rope_cos_sin(ours.config, 40)
    hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1), torch.arange(40).unsqueeze(0))  # (1, 40, head_dim)
    half = ours.config.head_dim // 2
    assert cos.shape == (40, half)
    assert torch.allclose(cos, hf_cos[0, :, :half], atol=1e-6) and torch.allclose(cos, hf_cos[0, :, half:], atol=1e-6)
    assert torch.allclose(sin, hf_sin[0, :, :half], atol=1e-6)


# --- reading folders -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    make_hf_llama(folder, "Llama", dict(num_hidden_layers=2), max_shard_size="100KB")
    return folder


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def test_sharded_folder_reads_every_tensor(sharded_folder) -> None:
    index = json.loads((sharded_folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(read_safetensors_folder(sharded_folder)) == set(index["weight_map"])


def test_missing_shard_is_a_checkpoint_error(sharded_folder, tmp_path) -> None:
    folder = copy_of(sharded_folder, tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_llama(folder)


def test_tensor_missing_from_its_shard_is_a_checkpoint_error(sharded_folder, tmp_path) -> None:
    folder = copy_of(sharded_folder, tmp_path)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.layers.9.mlp.up_proj.weight"):
        read_safetensors_folder(folder)


def test_shard_name_leaving_the_folder_is_refused(sharded_folder, tmp_path) -> None:
    folder = copy_of(sharded_folder, tmp_path)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="invalid shard"):
        read_safetensors_folder(folder)


def test_truncated_safetensors_is_a_checkpoint_error(tmp_path) -> None:
    folder = tmp_path / "m"
    make_hf_llama(folder, "Llama", dict(num_hidden_layers=1))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_llama(folder)


def test_pytorch_bin_and_shape_and_name_errors(tmp_path) -> None:
    folder = tmp_path / "m"
    hf = make_hf_llama(folder, "Qwen2", dict(num_hidden_layers=1))
    (folder / "model.safetensors").unlink()
    state = {
        k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight" or not hf.config.tie_word_embeddings
    }
    torch.save(state, folder / "pytorch_model.bin")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert (load_llama(folder)(ids)[0] - hf(ids).logits).abs().max() < TOLERANCE

    torch.save({**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 96)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"k_proj.weight.*\(48, 96\).*\(32, 96\)"):
        load_llama(folder)
    torch.save({**state, "model.layers.0.self_attn.o_proj.bias": torch.zeros(96)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
        load_llama(folder)
    torch.save({k: v for k, v in state.items() if "q_proj.bias" not in k}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        load_llama(folder)


# --- config.json and extras -------------------------------------------------------------------------------


def hf_config(**overrides) -> dict:
    base = dict(model_type="llama", vocab_size=VOCAB, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                num_hidden_layers=2, intermediate_size=128, max_position_embeddings=128, hidden_act="silu")  # fmt: skip
    return {**base, **overrides}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_scaling type 'yarn'"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "'dynamic'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks"),
        (dict(model_type="gemma"), "unsupported model_type 'gemma'"),
        (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_key_value_heads=4), "multiple of n_kv_head"),
        ({"vocab_size": None}, "lacks the key 'vocab_size'"),
    ],
)
def test_config_errors(overrides: dict, message: str) -> None:
    config = hf_config(**overrides)
    with pytest.raises(CheckpointError, match=message):
        llama_config_from_hf(config)


def test_config_forms_and_defaults() -> None:
    old = llama_config_from_hf(hf_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    new = llama_config_from_hf(hf_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}))
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.tie_word_embeddings is False and old.head_dim == 16 and old.n_kv_head == 2
    llama3 = llama_config_from_hf(hf_config(rope_scaling={k: v for k, v in LLAMA3.items() if "original" not in k}))
    assert llama3.rope_scaling["original_max_position_embeddings"] == 128  # transformers' fallback
    assert llama_config_from_hf(hf_config(model_type="qwen2")).attention_bias is True
    assert llama_config_from_hf(hf_config(head_dim=32)).head_dim == 32
    # Mistral's sliding window caps the context so that it never applies; a larger window changes nothing.
    assert llama_config_from_hf(hf_config(model_type="mistral", sliding_window=64)).n_positions == 64
    assert llama_config_from_hf(hf_config(model_type="mistral", sliding_window=4096)).n_positions == 128
    assert llama_config_from_hf(hf_config(model_type="qwen2", sliding_window=64)).n_positions == 128  # not enabled
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'ntk'"):
        LlamaConfig(rope_scaling={"rope_type": "ntk"})


def test_read_extras(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf_config(bos_token_id=1, eos_token_id=2)))
    assert read_extras(tmp_path) == {
        "bos_token_id": 1,
        "eos_token_ids": [2],
        "pad_token_id": None,
        "chat_template": None,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 7], "pad_token_id": 0}))
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    extras = read_extras(tmp_path)
    assert extras == {"bos_token_id": 1, "eos_token_ids": [7, 2], "pad_token_id": 0, "chat_template": "{{ messages }}"}
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m }}{% endfor %}")
    assert read_extras(tmp_path)["chat_template"].startswith("{% for m")  # the file wins, as in transformers
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(CheckpointError, match="eos_token_id"):
        read_extras(tmp_path)
