"""GGUF tokenizers against llama.cpp on texts real use produces: for every vocabulary edgelm builds (llama.cpp's
vocabulary-only test files and the two real files, Gemma 3 270M and SmolLM2-135M), the package tokenizer built
from the file, read by the runtime, gives llama.cpp's ids on every text of tests/data/tokenizer_corpus/texts.json
(code with indentation, runs of spaces, CRLF, scripts, emoji, numbers, special-token look-alikes, ...).

The expected ids are recorded from llama.cpp itself (llama-cpp-python, `vocab_only`) by
scripts/record_llamacpp_ids.py into tests/data/tokenizer_corpus/llamacpp_ids.json, whose header says how; CI
never runs llama.cpp, it compares with that file."""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from pathlib import Path

import pytest

from edgelm.export.gguf_header import read_header
from edgelm.export.gguf_tokenizer import build_tokenizer_json
from edgelm.runtime.text import Tokenizer

pytestmark = pytest.mark.slow  # every llama.cpp vocabulary against llama.cpp's recorded ids


CORPUS = Path(__file__).parents[1] / "data" / "tokenizer_corpus" / "texts.json"
RECORDED = json.loads(CORPUS.with_name("llamacpp_ids.json").read_text(encoding="utf-8"))
TEXTS = {item["name"]: item["text"] for item in json.loads(CORPUS.read_text(encoding="utf-8"))["texts"]}
VOCABULARIES = sorted(RECORDED["vocabularies"])
REAL = {"gemma3": "gemma3_gguf", "smollm2": "smollm2_gguf"}  # recorded name -> the conftest fixture of the file


@functools.cache
def built(path: Path) -> Tokenizer:
    """The runtime's Tokenizer over the tokenizer.json export writes for the file."""
    with tempfile.TemporaryDirectory() as folder:
        written = Path(folder) / "tokenizer.json"
        written.write_text(build_tokenizer_json(read_header(path).metadata), encoding="utf-8")
        return Tokenizer(written)


@pytest.fixture
def vocabulary(request) -> tuple[dict, Tokenizer]:
    """(what llama.cpp gave for the vocabulary, edgelm's tokenizer of the same file); skipped where the file is
    absent and cannot be fetched."""
    name = request.param
    recorded = RECORDED["vocabularies"][name]
    if name in REAL:
        path = request.getfixturevalue(REAL[name])
    else:
        path = request.getfixturevalue("llamacpp_vocab") / Path(recorded["file"]).name
    return recorded, built(path)


def mismatches(recorded: dict, encode, key: str = "ids") -> list[tuple[str, list[int], list[int]]]:
    """(text name, llama.cpp's ids, edgelm's) for every text where they differ."""
    wrong = []
    for name, entry in recorded["texts"].items():
        expected = entry.get(key, entry["ids"])
        if (got := encode(TEXTS[name])) != expected:
            wrong.append((name, expected, got))
    return wrong


def report(wrong: list, total: int) -> str:
    if not wrong:
        return ""
    name, expected, got = wrong[0]
    same = [a == b for a, b in zip(expected, got, strict=False)]  # the shorter's length where one extends the other
    at = same.index(False) if False in same else len(same)
    return (
        f"{total - len(wrong)}/{total} texts match; first: {name} ({TEXTS[name][:40]!r}) differs at id {at}: "
        f"llama.cpp {expected[at : at + 8]}, edgelm {got[at : at + 8]}"
    )


def test_recorded_ids_are_for_this_corpus():
    """The recorded ids were made from the corpus as it is (rerun scripts/record_llamacpp_ids.py after an edit),
    for every text, and for both real files and llama.cpp's test vocabularies."""
    assert RECORDED["corpus_sha256"] == hashlib.sha256(CORPUS.read_bytes()).hexdigest()
    assert {"gemma3", "smollm2", "llama-spm", "gpt-2", "qwen2"} <= set(VOCABULARIES)
    for name, vocab in RECORDED["vocabularies"].items():
        assert list(vocab["texts"]) == list(TEXTS), name
    assert len(TEXTS) >= 40 and "" in TEXTS.values() and " " in TEXTS.values()
    assert "e\u0301" in TEXTS["combining_marks"] and "\r\n" in TEXTS["crlf"]  # not normalized by an editor


@pytest.mark.parametrize("vocabulary", VOCABULARIES, indirect=True)
def test_ids_are_llamacpps(vocabulary):
    """Plain text (llama.cpp's parse_special false: control-token text is text, user-defined tokens match), no
    BOS: the runtime's encode_text gives llama.cpp's ids for every text."""
    recorded, tokenizer = vocabulary
    wrong = mismatches(recorded, lambda text: tokenizer.encode_text(text, at_start=True))
    assert not wrong, report(wrong, len(recorded["texts"]))


@pytest.mark.parametrize("vocabulary", VOCABULARIES, indirect=True)
def test_ids_with_special_tokens_are_llamacpps(vocabulary):
    """Control-token text parsed as the tokens (llama.cpp's parse_special true, a rendered chat template):
    the runtime's encode gives llama.cpp's ids."""
    recorded, tokenizer = vocabulary
    wrong = mismatches(recorded, tokenizer.encode, "ids_special")
    assert not wrong, report(wrong, len(recorded["texts"]))


@pytest.mark.parametrize("vocabulary", VOCABULARIES, indirect=True)
def test_decoding_gives_the_text_back(vocabulary):
    """Where llama.cpp's detokenize gives a text back from its ids, edgelm's decode does too."""
    recorded, tokenizer = vocabulary
    wrong = [
        name
        for name, entry in recorded["texts"].items()
        if entry["detokenizes"] and tokenizer.decode(entry["ids"], skip_special=False) != TEXTS[name]
    ]
    assert not wrong, f"{len(wrong)} texts decode otherwise, first {wrong[0]}"


@pytest.mark.parametrize("vocabulary", VOCABULARIES, indirect=True)
def test_bos_and_vocabulary_size_are_llamacpps(vocabulary):
    """A text prompt gets BOS where llama.cpp's tokenize adds it by default (the runtime's encode with
    add_special_tokens), and the tokenizer has exactly the file's tokens: every added token kept its id."""
    recorded, tokenizer = vocabulary
    bos = recorded["bos"]
    assert tokenizer.encode(bos["text"], add_special_tokens=True) == bos["default_ids"]
    assert tokenizer.vocab_size == recorded["n_tokens"]


def test_gemma3_keeps_its_user_defined_tokens(gemma3_gguf):
    """Gemma 3's 262,144 tokens, its runs of spaces (ids 138-167, stored as spaces) among them, llama.cpp adding
    BOS; two spaces in code are its own token, not new ids past the vocabulary."""
    recorded = RECORDED["vocabularies"]["gemma3"]
    assert recorded["n_tokens"] == 262_144 and recorded["bos"]["adds_bos"]
    tokenizer = built(gemma3_gguf)
    assert tokenizer.vocab_size == 262_144
    assert [tokenizer.encode_text(" " * n, at_start=True) for n in (2, 3, 31)] == [[138], [139], [167]]


def test_a_tokenizer_that_is_not_the_files_is_refused():
    """Two tokens spelled alike would leave one id without a token: export refuses the file (ValueError)
    rather than write a tokenizer whose size is not the model's."""
    tokens = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "ab", "ab"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ValueError, match=r"the tokenizer built from the file has 96 tokens, the file 97"):
        build_tokenizer_json(meta)
