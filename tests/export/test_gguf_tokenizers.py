"""GGUF tokenizers against llama.cpp's own tokenizer tests: for each vocabulary-only GGUF file that llama.cpp keeps
(models/ggml-vocab-<name>.gguf, real models' tokenizers), the tokenizer edgelm builds from the file gives, on
every test text (.gguf.inp), the ids that llama.cpp's tests/test-tokenizer-0 requires of llama.cpp (.gguf.out:
the model's own tokenizer's ids, no BOS, special-token text read as text). Plus BPE's ignore_merges on Llama 3's
whole vocabulary, BOS as llama.cpp adds it, and a one-line error for a label llama.cpp does not know."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from edgelm.export.gguf_header import read_header
from edgelm.export.gguf_tokenizer import PRE_TOKENIZERS, build_tokenizer_json
from edgelm.export.tokenizer_config import tokenizer_config
from edgelm.runtime.contract import MANIFEST_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Manifest

pytestmark = pytest.mark.slow  # every llama.cpp vocabulary file against llama.cpp's tokenizer tests


SEPARATOR = "\n__ggml_vocab_test__\n"  # between texts in a .inp file (test-tokenizer-0.cpp's read_tests)
# vocabulary -> whether llama.cpp adds BOS with add_special: the file's add_bos_token, else the default of its
# tokenizer (SentencePiece and Llama 3's pre-tokenizer: yes; other BPE: no)
ADDS_BOS = {
    "command-r": True,  # add_bos_token true
    "deepseek-coder": True,  # add_bos_token true
    "deepseek-llm": True,  # add_bos_token true
    "falcon": False,
    "gemma-4": True,  # add_bos_token true
    "gpt-2": False,
    "llama-bpe": True,  # no key: llama-bpe's default
    "llama-spm": True,  # add_bos_token true
    "mpt": False,
    "phi-3": True,  # add_bos_token true
    "qwen2": False,
    "qwen35": False,
    "refact": False,
    "starcoder": False,
}


def read_tests(gguf: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs as test-tokenizer-0.cpp reads them: texts split at the separator (the last one ends
    the file), one line of space-separated ids per text."""
    raw = Path(f"{gguf}.inp").read_bytes().decode("utf-8")  # bytes: a "\r" in a text stays
    texts = raw.split(SEPARATOR)
    if texts[-1] == "":
        texts.pop()
    lines = Path(f"{gguf}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{gguf.name}: {len(texts)} texts, {len(lines)} id lines"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


@functools.cache
def vocabulary(gguf: Path) -> tuple[dict, HFTokenizer, str]:
    """The file's metadata, the tokenizer.json edgelm builds from it, and that tokenizer encoding special-token
    text as text (as llama.cpp's test does: parse_special false; edgelm's runtime Tokenizer.encode_text does too)."""
    meta = read_header(gguf).metadata
    tokenizer_json = build_tokenizer_json(meta)
    tokenizer = HFTokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True
    return meta, tokenizer, tokenizer_json


@pytest.fixture(scope="module")
def built(llamacpp_vocab):
    return lambda name: vocabulary(llamacpp_vocab / f"ggml-vocab-{name}.gguf")


@pytest.mark.parametrize("name", sorted(ADDS_BOS))
def test_ids_are_llamacpps(name, built, llamacpp_vocab):
    """Every test text, encoded as plain text (special-token text stays text, like llama.cpp's parse_special
    false) and without BOS, gives llama.cpp's expected ids."""
    cases = read_tests(llamacpp_vocab / f"ggml-vocab-{name}.gguf")
    _, tokenizer, _ = built(name)
    wrong = [
        (text, ids, got) for text, ids in cases if (got := tokenizer.encode(text, add_special_tokens=False).ids) != ids
    ]
    first = f"; first: {wrong[0][0]!r:.60} expected {wrong[0][1][:12]} got {wrong[0][2][:12]}" if wrong else ""
    assert not wrong, f"{name}: {len(cases) - len(wrong)}/{len(cases)} texts match{first}"
    assert [text for text, ids in cases if tokenizer.decode(ids, skip_special_tokens=False) != text] == []


@pytest.mark.parametrize("name", sorted(ADDS_BOS))
def test_bos_is_added_as_llamacpp_adds_it(name, built):
    meta, tokenizer, _ = built(name)
    plain = tokenizer.encode("Hello world", add_special_tokens=False).ids
    full = tokenizer.encode("Hello world", add_special_tokens=True).ids
    assert full == [meta["tokenizer.ggml.bos_token_id"]] * ADDS_BOS[name] + plain


def test_llama3_ignore_merges(built):
    """Llama 3's tokenizer (llama.cpp: ignore_merges for llama-bpe) takes a word that is a token whole: every
    ordinary token whose text is valid UTF-8 and one word encodes as its own id. Without it (smaug-bpe, the
    same words, every one merged) 588 do not, " việc" among them."""
    meta, tokenizer, _ = built("llama-bpe")
    ordinary = [i for i, kind in enumerate(meta["tokenizer.ggml.token_type"]) if kind == 1]
    texts = [tokenizer.decode([i]) for i in ordinary]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    others = [(i, text) for i, text, got in zip(ordinary, texts, encoded, strict=True) if got.ids != [i]]
    words = [(i, text) for i, text in others if "\ufffd" not in text]  # a partial character decodes as U+FFFD
    several = [(i, text) for i, text in words if len(tokenizer.pre_tokenizer.pre_tokenize_str(text)) == 1]
    assert len(ordinary) == 128_000 and len(others) < 2000 and several == []
    assert tokenizer.encode(" việc", add_special_tokens=False).ids == [100769]
    merged = HFTokenizer.from_str(build_tokenizer_json(meta | {"tokenizer.ggml.pre": "smaug-bpe"}))
    assert merged.encode(" việc", add_special_tokens=False).ids == [3355, 26298, 66]


@pytest.mark.parametrize("name", ["gemma-4", "llama-bpe"])
def test_onnxruntime_genai_reads_the_tokenizer_alike(name, built, llamacpp_vocab, package, tmp_path):
    """A package holding the file's tokenizer (the tiny GPT-2 package with its tokenizer files replaced):
    onnxruntime-genai's tokenizer gives llama.cpp's ids too, and adds BOS as llama.cpp does. (It refuses
    DeepSeek's pre-tokenizer regexes and misreads Falcon's, as it does the models' own tokenizer.json files.)"""
    og = pytest.importorskip("onnxruntime_genai")
    meta, _, tokenizer_json = built(name)
    folder = Path(shutil.copytree(package, tmp_path / "pkg"))
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    eos = meta["tokenizer.ggml.eos_token_id"]
    ids = {"bos_token_id": meta["tokenizer.ggml.bos_token_id"], "eos_token_ids": [eos]}
    manifest["tokenizer"] |= ids | {"pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos)}
    config = tokenizer_config(tokenizer_json, Manifest.parse(manifest), chat_template=None)
    (folder / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config), encoding="utf-8")
    genai = og.Tokenizer(og.Model(str(folder)))
    cases = read_tests(llamacpp_vocab / f"ggml-vocab-{name}.gguf")
    wrong = [text for text, expected in cases if [int(i) for i in genai.encode(text)] != expected]
    assert not wrong, f"{name}: onnxruntime-genai matches {len(cases) - len(wrong)}/{len(cases)}; first {wrong[0]!r}"
    plain = [int(i) for i in genai.encode("Hello world")]
    genai.update_options(add_special_tokens="true")
    assert [int(i) for i in genai.encode("Hello world")] == [ids["bos_token_id"]] * ADDS_BOS[name] + plain


def test_single_regex_labels_are_transformers_gguf_splits():
    """transformers' GGUF reader (an independent reading of llama.cpp's labels and the models' tokenizer.json)
    cuts words with the same one regex for every label both know: Llama 3's, Qwen2's, Qwen3.5's, tekken's,
    GPT-4o's. (Its other labels, and llama.cpp's multi-regex ones, it leaves to GPT-2's split.)"""
    splits = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping").GGUF_PRE_TOKENIZER_SPLITS
    shared = sorted(set(splits) & set(PRE_TOKENIZERS))
    assert {"llama-bpe", "smaug-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"} <= set(shared)
    for label in shared:
        assert PRE_TOKENIZERS[label].regexes == (splits[label],), label


def test_every_label_builds():
    """Each row of the table makes a tokenizer (its regexes compile) on a small byte-level vocabulary."""
    tokens = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ", "he", "ll", "llo", "hello"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens}
    meta["tokenizer.ggml.merges"] = ["h e", "l l", "ll o", "he llo"]
    for label, split in PRE_TOKENIZERS.items():
        if split.byte_level:
            tokenizer = HFTokenizer.from_str(build_tokenizer_json(meta | {"tokenizer.ggml.pre": label}))
            assert tokenizer.encode("hello", add_special_tokens=False).tokens == ["hello"], label


def test_unknown_pre_tokenizer_is_one_line_naming_the_key(built, llamacpp_vocab):
    """(read_gguf's one-line GGUFError for it: test_gguf_metadata's BAD table.)"""
    meta, _, _ = built("gpt-2")
    with pytest.raises(ValueError, match=r"unknown BPE pre-tokenizer 'no-such-bpe' \(tokenizer.ggml.pre\)") as error:
        build_tokenizer_json(meta | {"tokenizer.ggml.pre": "no-such-bpe"})
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"tokenizer model 'bert' \(tokenizer.ggml.model\) is not supported"):
        build_tokenizer_json(read_header(llamacpp_vocab / "ggml-vocab-bert-bge.gguf").metadata)


def test_a_file_without_label_gets_llamacpps_default_split():
    """No tokenizer.ggml.pre is llama.cpp's "default": punctuation runs and 3-digit groups split off, unlike in
    GPT-2's words."""
    tokens = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "do"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["d o"]}

    def words(meta: dict) -> list[str]:
        pre_tokenizer = HFTokenizer.from_str(build_tokenizer_json(meta)).pre_tokenizer
        return [word for word, _ in pre_tokenizer.pre_tokenize_str("don't 12345")]

    assert words(meta) == ["don", "'", "t", "Ġ", "123", "45"]
    assert words(meta | {"tokenizer.ggml.pre": "gpt-2"}) == ["don", "'t", "Ġ12345"]
