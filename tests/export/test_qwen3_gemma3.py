"""Qwen3 and Gemma 3 beyond parity with transformers (tests/export/test_families.py, on the same tiny models of
tests/family_cases.py): what their GGUF files say and what llama.cpp's loader assumes where they are silent,
hostile metadata, Gemma's SentencePiece vocabulary, the genai type the manifest records, and the Gemma 3
options edgelm refuses."""

from __future__ import annotations

import json
import shutil

import pytest

gguf = pytest.importorskip("gguf")

from family_cases import SMALL, WINDOW  # noqa: E402
from helpers import rewrite_gguf  # noqa: E402

from edgelm.export.gguf import GGUFError, read_gguf  # noqa: E402

CASES = ("qwen3", "gemma3_text")  # tests/family_cases.py; their parity with transformers: tests/export/test_families.py

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_qwen3_gguf_config(families):
    config = read_gguf(families.gguf("qwen3")).hf_config
    assert config["model_type"] == "qwen3" and config["head_dim"] == 32 != SMALL["hidden_size"] // 6


HOSTILE = [  # (case, key, bad value): each file otherwise as written above
    ("qwen3", "qwen3.attention.key_length", "many"),
    ("qwen3", "qwen3.rope.freq_base", "many"),
    ("gemma3_text", "gemma3.attention.sliding_window", "many"),
    ("gemma3_text", "gemma3.attention.sliding_window", 0),
    ("gemma3_text", "gemma3.rope.freq_base_swa", "many"),
    ("gemma3_text", "gemma3.attention.sliding_window_pattern", "many"),
    ("gemma3_text", "gemma3.final_logit_softcapping", 30.0),
]


@pytest.mark.parametrize("case,key,value", HOSTILE)
def test_hostile_metadata_is_one_line_error(case, key, value, families, tmp_path):
    kind = {str: "add_string", float: "add_float32", int: "add_uint32"}[type(value)]

    def add(writer):
        getattr(writer, kind)(key, value)

    path = rewrite_gguf(families.gguf(case), tmp_path / "bad.gguf", {key: None}, add=add)
    with pytest.raises(GGUFError, match=key.replace(".", r"\.")) as error:
        read_gguf(path)
    assert "\n" not in str(error.value)


def test_gemma3_gguf_pattern_and_local_base_keys_are_read(families, tmp_path):
    """Newer writers' keys for what llama.cpp's Gemma 3 loader otherwise assumes."""
    pattern = [True, False, True, True, True, False]

    def add(writer):
        writer.add_sliding_window_pattern(pattern)
        writer.add_rope_freq_base_swa(5000.0)

    config = read_gguf(rewrite_gguf(families.gguf("gemma3_text"), tmp_path / "keys.gguf", {}, add=add)).hf_config
    assert config["layer_types"] == ["sliding_attention" if p else "full_attention" for p in pattern]
    assert config["rope_local_base_freq"] == 5000.0


def test_gemma3_gguf_config(families):
    """What llama.cpp's loader assumes for a Gemma 3 file: every 6th layer full, local base 10000."""
    config = read_gguf(families.gguf("gemma3_text")).hf_config
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == WINDOW and config["rope_local_base_freq"] == 10000.0
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0} and config["rope_theta"] == 1e5


def test_gemma3_gguf_weights_match_transformers_gguf_loader(families):
    """transformers' own GGUF reader (its Gemma 3 norm shift included) finds the HF weights in the file written
    above, so the test file's layout is llama.cpp's as transformers reads it too, not only as edgelm does. (Its
    config differs where the file is silent: query_pre_attn_scalar 256, no rope scaling; edgelm follows
    llama.cpp's loader there.)"""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    hf, _ = families.model("gemma3_text")
    path = families.gguf("gemma3_text")
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    expected = hf.state_dict()
    assert set(loaded) == set(expected)
    assert max((loaded[k] - expected[k]).abs().max().item() for k in expected) < 1e-6


GEMMA_PIECES = [  # a small SentencePiece vocabulary in Gemma 3's GGUF spelling: user-defined runs of spaces stored
    # as spaces, and a user-defined newline
    "▁", *"abcdefghijklmnopqrstuvwxyz", "  ", "   ", "\n", ",", "!", "H", "W", "th", "he", "▁t", "▁th", "▁the", "at",
    "▁c", "▁ca", "▁cat", "in", "▁in", "▁s", "▁sa", "▁sat", "ha", "▁h", "▁hat", "ll", "el", "ell", "ello", "He",
    "Hell", "Hello", "sp", "ac", "es", "ace", "aces", "spaces", "▁spaces", "us", "er", "user",
]  # fmt: skip


def test_gemma_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """A Gemma GGUF vocabulary (tokenizer model llama, no space prefix, byte fallback) gives transformers' GGUF
    tokenizer's ids. Its scores fall with the token's place in the file, as the real Gemma 3 file's do: transformers
    merges Gemma's pieces in file order, llama.cpp (whose ids edgelm gives: test_tokenizer_corpus.py) by score."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from edgelm.export.gguf_tokenizer import build_tokenizer_json

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens += [f"<0x{b:02X}>" for b in range(256)] + GEMMA_PIECES
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [4 if piece in ("  ", "   ", "\n") else 1 for piece in GEMMA_PIECES]
    writer = gguf.GGUFWriter(tmp_path / "tok.gguf", "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(index) for index in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = {field.name: field.contents() for field in gguf.GGUFReader(tmp_path / "tok.gguf").fields.values()}
    ours = Tokenizer.from_str(build_tokenizer_json(meta))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for text in ["the cat sat in the hat", "  two  spaces   here", "Hello, Wörld! 😀", "<start_of_turn>user\n", " the"]:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == text.replace("<start_of_turn>", "")


@pytest.mark.parametrize("case", CASES)
def test_genai_type_is_what_the_package_records_and_older_packages_keep_theirs(case, families):
    """The manifest records the family's genai type, and genai_config.json names it; a manifest from before
    that record still parses (its genai_config.json is the one written then), but the contract maps no family."""
    from edgelm.runtime.contract import GENAI_CONFIG_FILE, MANIFEST_FILE, Manifest, genai_config

    package = families.package(case, "fused")
    data = json.loads((package / MANIFEST_FILE).read_text())
    assert data["architecture"]["genai_type"] == case
    assert genai_config(Manifest.parse(data))["model"]["type"] == case
    assert json.loads((package / GENAI_CONFIG_FILE).read_text())["model"]["type"] == case
    del data["architecture"]["genai_type"]
    assert Manifest.parse(data).architecture.genai_type is None
    with pytest.raises(ValueError, match="no architecture.genai_type"):
        genai_config(Manifest.parse(data))


@pytest.mark.parametrize(
    "change",
    [{"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0}, {"attention_bias": True},
     {"hidden_activation": "silu"}, {"layer_types": ["sliding_attention"]}],
)  # fmt: skip
def test_gemma3_config_edgelm_does_not_implement_is_refused(change, families, tmp_path):
    from edgelm.export.checkpoint import CheckpointError
    from edgelm.export.onnx_export import open_source

    _, folder = families.model("gemma3_text")
    shutil.copytree(folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text()) | change
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=next(iter(change))) as error:
        open_source(tmp_path / "model")
    assert "\n" not in str(error.value)
