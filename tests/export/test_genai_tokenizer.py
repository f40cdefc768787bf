"""Every package, from every kind of source, is complete for onnxruntime-genai's tokenizer: `og.Tokenizer`
loads it, and encodes and decodes as edgelm's tokenizer does (with BOS where the model's tokenizer adds
one) and as transformers' AutoTokenizer does on the same folder. Sources: the bundled GPT-2 folder, a tiny
Llama folder with a SentencePiece-style tokenizer and a hostile tokenizer_config.json of its own, GGUF
files with byte-level and SentencePiece vocabularies, and the real SmolLM2 GGUF (skipped where absent)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

og = pytest.importorskip("onnxruntime_genai")
gguf = pytest.importorskip("gguf")
import test_gguf  # noqa: E402  (pytest puts tests/ on the path)
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import quiet, save_random_model  # noqa: E402

from edgelm.export.gguf_tokenizer import build_tokenizer_json  # noqa: E402
from edgelm.export.onnx_export import export_package  # noqa: E402
from edgelm.runtime.text import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BPE = json.loads((REPO / "models" / "shakespeare" / "tokenizer.json").read_text())
TEXTS = [
    "Hello, world!",
    "ROMEO:\n  But soft,   what light through yonder window breaks?",
    "It's 1234 o'clock",
    "é 東京 🙂 naïve",
    " leading space and trailing  ",
    "tab\tand\r\nnewlines\n\n",
]


def spm_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary (tokens, scores, GGUF token types) made from the bundled BPE's
    printable pieces: <unk> <s> </s>, 256 byte tokens, then pieces with "▁" for the space."""
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    for piece, _ in sorted(BPE["model"]["vocab"].items(), key=lambda item: item[1]):
        text = piece.replace("Ġ", " ")
        if text.isascii() and text.isprintable() and "<" not in text and text.replace(" ", "▁") not in tokens:
            tokens.append(text.replace(" ", "▁"))
            types.append(1)
    tokens, types = tokens[: len(BPE["model"]["vocab"])], types[: len(BPE["model"]["vocab"])]  # the models' 2048
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def spm_metadata() -> dict:
    tokens, scores, types = spm_vocabulary()
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def add_spm_tokenizer(writer, *, add_bos: bool = True) -> None:
    meta = spm_metadata()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")


def llama_folder(folder: Path) -> Path:
    """A tiny random Llama saved by transformers, with a SentencePiece-style tokenizer.json (BOS added by its
    post-processor) and a tokenizer_config.json of its own whose settings would change genai's decoding."""
    from family_cases import SMALL

    save_random_model(folder, ("LlamaConfig", "LlamaForCausalLM"), {**SMALL, "bos_token_id": 1, "eos_token_id": 2})
    spm = build_tokenizer_json(spm_metadata() | {"tokenizer.ggml.add_bos_token": True})
    (folder / "tokenizer.json").write_text(spm)
    source_config = {
        "tokenizer_class": "LlamaTokenizer",
        "clean_up_tokenization_spaces": True,  # would turn "a ." into "a." on decode
        "add_bos_token": False,  # a lie: tokenizer.json adds it
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "auto_map": {"AutoTokenizer": ["custom.Tokenizer", None]},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(source_config))
    return folder


def spm_gguf(folder: Path, monkeypatch) -> Path:
    monkeypatch.setattr(test_gguf, "_add_tokenizer", lambda writer, add_bos=False: add_spm_tokenizer(writer))
    path = test_gguf.write_gguf(folder, "llama", kinds=(Q.Q8_0, Q.F16))
    monkeypatch.undo()
    return path


@pytest.fixture(scope="module", params=["gpt2-folder", "llama-folder", "gguf-bpe", "gguf-spm"])
def package(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2-folder":
        source = REPO / "models" / "shakespeare"
    elif request.param == "llama-folder":
        source = llama_folder(folder / "src")
    elif request.param == "gguf-bpe":
        source = test_gguf.write_gguf(folder, "llama", kinds=(Q.Q4_0, Q.F16), add_bos=True)
    else:
        with pytest.MonkeyPatch.context() as monkeypatch:
            source = spm_gguf(folder, monkeypatch)
    export_package(source, folder / "pkg", progress=quiet)
    return folder / "pkg"


def check_like_edgelm(package: Path, texts: list[str]) -> None:
    """genai's ids = edgelm's (genai, like edgelm, adds no special tokens by default); with its
    add_special_tokens option, BOS first where the package's tokenizer_config says the model adds it; genai's
    decode and its streaming decode = edgelm's for the ids after BOS, as a model sees them. Two differences of
    genai's SentencePiece decoding, which no tokenizer_config setting changes: without BOS it keeps the leading
    "▁" as a space that edgelm (and transformers) strip, and around a special token inside the ids it drops or
    keeps spaces differently: the first is checked as such, the second's decode is not compared."""
    config = json.loads((package / "tokenizer_config.json").read_text())
    bos = json.loads((package / "edgelm.json").read_text())["tokenizer"]["bos_token_id"]
    sentencepiece = '"Strip"' in (package / "tokenizer.json").read_text()  # the decoder drops the prefix space
    specials = {int(i) for i, token in config["added_tokens_decoder"].items() if token["special"]}
    ours = Tokenizer(package / "tokenizer.json")
    theirs = og.Tokenizer(og.Model(str(package)))
    with_specials = og.Tokenizer(og.Model(str(package)))
    with_specials.update_options(add_special_tokens="true")
    for text in texts:
        ids = ours.encode(text)
        assert list(theirs.encode(text)) == ids, text
        assert list(with_specials.encode(text)) == [bos] * config["add_bos_token"] + ids, text
        stream = theirs.create_stream()
        decoded = theirs.decode([bos] + ids)
        assert decoded == "".join(stream.decode(i) for i in [bos] + ids), text
        if sentencepiece and specials & set(ids):
            continue  # genai's spaces around a special token differ (docstring); its ids were checked
        assert decoded == ours.decode(ids), text
        prefix = " " if sentencepiece and ids and ours.token_text(ids[0]).startswith("▁") else ""
        assert theirs.decode(ids) == prefix + ours.decode(ids), text


def test_genai_tokenizer_encodes_and_decodes_like_edgelm(package):
    specials = [json.loads((package / "tokenizer_config.json").read_text())[key] for key in ("bos_token", "eos_token")]
    check_like_edgelm(package, [*TEXTS, f"a{specials[1]}b", f"{specials[0]} x {specials[1]}"])


def test_tokenizer_config_agrees_with_transformers(package):
    """transformers reads the same file: its AutoTokenizer on the package gives the same ids with special
    tokens, and decodes to the same text."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(package)
    ours = Tokenizer(package / "tokenizer.json")
    theirs = og.Tokenizer(og.Model(str(package)))
    theirs.update_options(add_special_tokens="true")
    for text in TEXTS:
        assert reference(text)["input_ids"] == list(theirs.encode(text)), text
        ids = ours.encode(text)
        assert reference.decode(ids, skip_special_tokens=True) == ours.decode(ids), text


def test_tokenizer_config_is_in_the_manifest_and_quantize_keeps_it(package, tmp_path):
    from edgelm.quantize.quantize import quantize_package
    from edgelm.runtime.package import file_sha256

    manifest = json.loads((package / "edgelm.json").read_text())
    assert manifest["files"]["tokenizer_config.json"]["sha256"] == file_sha256(package / "tokenizer_config.json")
    config = json.loads((package / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == manifest["architecture"]["context_length"]
    template = package / "chat_template.jinja"
    assert config.get("chat_template") == (template.read_text() if template.is_file() else None)
    source = package
    if manifest["recipe"].get("gguf_types"):  # kept GGUF blocks are not re-quantized: the fp32 export is
        source = tmp_path / "fp32"
        export_package(next(package.parent.glob("*.gguf")), source, dequantize=True, progress=quiet)
    quantize_package(source, tmp_path / "int8", mode="int8-weight-only", progress=quiet)
    copied = (tmp_path / "int8" / "tokenizer_config.json").read_bytes()
    assert copied == (package / "tokenizer_config.json").read_bytes()
    check_like_edgelm(tmp_path / "int8", TEXTS[:2])


def test_source_tokenizer_config_is_not_carried(tmp_path):
    """A folder's own tokenizer_config.json (a custom class, clean-up on decode, a wrong add_bos_token, a
    second chat template) is replaced by the package's: add_bos_token is what tokenizer.json does."""
    source = llama_folder(tmp_path / "src")
    export_package(source, tmp_path / "pkg", progress=quiet)
    config = json.loads((tmp_path / "pkg" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["clean_up_tokenization_spaces"] is False
    assert "auto_map" not in config and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == json.loads((source / "tokenizer_config.json").read_text())["chat_template"]
    check_like_edgelm(tmp_path / "pkg", ["a . b , c", "x"])


def test_smollm2_gguf_package(smollm2_gguf, tmp_path):
    export_package(smollm2_gguf, tmp_path / "pkg", progress=quiet)
    config = json.loads((tmp_path / "pkg" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    turn = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    check_like_edgelm(tmp_path / "pkg", [*TEXTS, turn, "x<|endoftext|>y"])
    shutil.rmtree(tmp_path / "pkg")
