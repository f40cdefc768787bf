"""benchmarks/peers/peer_models.py: the folders benchmarks/peers/peers.py starts every system from."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peers"))
import peer_models  # noqa: E402  (benchmarks/ is not a package)

transformers = pytest.importorskip("transformers")


def test_shape_reads_gpt2_and_grouped_query_llama_configs():
    gpt2 = transformers.GPT2Config(n_layer=3, n_embd=96, n_head=4, n_positions=256).to_dict()
    assert peer_models.shape(gpt2) == peer_models.Shape(3, 96, 256, 50257, 50256)
    llama = transformers.LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, eos_token_id=[2, 7]
    ).to_dict()
    shape = peer_models.shape(llama)
    assert shape.kv_width == 3 * 64  # KV heads x head size, not the model width
    assert (shape.n_layer, shape.eos_token_id) == (30, 2)


def test_llama_tiny_is_a_checkpoint_the_llama_peers_accept(tmp_path):
    folder = tmp_path / "llama-tiny"
    peer_models.make_llama_tiny(folder)
    assert peer_models.llama_checkpoint(folder) == folder
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) <= model.config.vocab_size


def test_llama_checkpoint_refuses_another_family_and_a_missing_tokenizer(tmp_path):
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a Llama-family"):
        peer_models.llama_checkpoint(tmp_path)
    llama = tmp_path / "llama"
    peer_models.make_llama_tiny(llama)
    (llama / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        peer_models.llama_checkpoint(llama)
