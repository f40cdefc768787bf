"""The bundled default model: its data, its size, its training record, and that it is a real GPT-2
checkpoint (Hugging Face transformers loads it and computes the same logits as edgelm's model)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers import quiet

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "shakespeare"
DATA_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def test_training_text_is_the_public_domain_tiny_shakespeare():
    raw = (REPO / "data" / "tinyshakespeare.txt").read_bytes()
    assert len(raw) == 1_115_394
    assert hashlib.sha256(raw).hexdigest() == DATA_SHA256
    text = raw.decode("utf-8")
    split = int(0.9 * len(text))
    assert (REPO / "data" / "shakespeare-heldout.txt").read_text(encoding="utf-8") == text[split:]
    assert text[:split].startswith((REPO / "data" / "shakespeare-calibration.txt").read_text(encoding="utf-8"))


def test_checkpoint_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in BUNDLED.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json"):
        assert name in files, name
    assert sum(files.values()) <= 20 * 1024 * 1024


def test_training_record_is_complete():
    record = json.loads((BUNDLED / "training.json").read_text())
    for key in ("command", "seed", "steps", "wall_time_minutes", "heldout_bits_per_byte", "history"):
        assert key in record, key
    assert min(h["heldout_bits_per_byte"] for h in record["history"]) == record["heldout_bits_per_byte"]
    # a regression check on what training reached (2.1522); the 2.0 target was withdrawn (docs/results.md)
    assert record["heldout_bits_per_byte"] <= 2.16


def test_heldout_bits_per_byte_reproduces_through_the_runtime(tmp_path):
    """The recorded figure, recomputed by edgelm eval on the exported package (sliding windows give
    each token more context than the training script's non-overlapping windows, so it is no worse)."""
    from edgelm.export.onnx_export import export_package
    from edgelm.quantize.evaluate import evaluate_package

    export_package(BUNDLED, tmp_path / "fp32", progress=quiet)
    report = evaluate_package(tmp_path / "fp32", REPO / "data" / "shakespeare-heldout.txt")
    recorded = json.loads((BUNDLED / "training.json").read_text())["heldout_bits_per_byte"]
    # agrees with the record: no worse, and better only by what the extra context of overlapping windows gives
    assert recorded - 0.02 <= report["bits_per_byte"] <= recorded + 1e-3


def test_loads_in_transformers_as_gpt2_with_the_same_logits():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from edgelm.export.families.gpt2 import load_checkpoint

    hf = transformers.GPT2LMHeadModel.from_pretrained(BUNDLED).eval()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode("ROMEO:\nWhat light through yonder window breaks?")])
    ours = load_checkpoint(BUNDLED)
    with torch.no_grad():
        expected = hf(ids).logits
        actual, _ = ours(ids)
    assert torch.allclose(actual, expected, atol=1e-5), (actual - expected).abs().max()


def test_tokenizer_is_byte_level_bpe_with_an_end_of_text_token():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    config = json.loads((BUNDLED / "config.json").read_text())
    assert tokenizer.token_to_id("<|endoftext|>") == config["eos_token_id"]
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    text = "Wherefore art thou — Roméo? 🙂"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text  # byte-level: any text round-trips
