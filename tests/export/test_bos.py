"""Text prompts get the special tokens the tokenizer adds, as transformers' tokenizer.encode(text) and llama.cpp add
them: BOS first where tokenizer.json's post-processor puts it (Llama 2, Mistral, Gemma, Llama 3 base), from a
GGUF file's tokenizer.ggml.add_bos_token; none where it does not. generate, stream, generate_batch and eval take
them; add_special_tokens=False (CLI --no-bos) leaves them out; a chat template writes its own BOS and gets no
second one (transformers' apply_chat_template tokenizes with add_special_tokens=False)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import edgelm, quiet, save_random_model
from test_genai_tokenizer import add_spm_tokenizer, spm_metadata
from test_llama_export import SMALL

from edgelm.export.gguf_tokenizer import build_tokenizer_json
from edgelm.export.onnx_export import export_package
from edgelm.runtime import InvalidParameterError, load

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEXTS = ["hello world", "a b c", " leading space", "x"]
BOS = 1
TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"


def _folder(folder: Path, *, bos: bool) -> Path:
    """A tiny Llama with a SentencePiece tokenizer.json whose post-processor adds BOS or not, and a
    tokenizer_config.json saying the opposite (transformers 5 follows tokenizer.json, and so does edgelm)."""
    save_random_model(folder, ("LlamaConfig", "LlamaForCausalLM"), {**SMALL, "bos_token_id": BOS, "eos_token_id": 2})
    (folder / "tokenizer.json").write_text(build_tokenizer_json(spm_metadata() | {"tokenizer.ggml.add_bos_token": bos}))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "add_bos_token": not bos, "chat_template": TEMPLATE}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _gguf(folder: Path, *, bos: bool) -> Path:
    import test_gguf
    from gguf import GGMLQuantizationType as Q

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_gguf, "_add_tokenizer", lambda writer, add_bos=False: add_spm_tokenizer(writer, add_bos=bos))
        return test_gguf.write_gguf(folder, "llama", kinds=(Q.F16,))


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, tuple[Path, Path, bool]]:
    """name -> (source, package, whether BOS is added)."""
    root = tmp_path_factory.mktemp("bos")
    out = {}
    for name, make, bos in (("folder-bos", _folder, True), ("folder-plain", _folder, False),
                            ("gguf-bos", _gguf, True), ("gguf-plain", _gguf, False)):  # fmt: skip
        (root / name).mkdir()
        source = make(root / name / "src" if name.startswith("folder") else root / name, bos=bos)
        export_package(source, root / name / "pkg", progress=quiet)
        out[name] = (source, root / name / "pkg", bos)
    return out


@pytest.mark.parametrize("name", ["folder-bos", "folder-plain"])
def test_text_prompts_as_transformers_encodes_them(packages, name):
    from transformers import AutoTokenizer

    source, package, bos = packages[name]
    reference = AutoTokenizer.from_pretrained(source)
    model = load(package, provider="cpu", threads=1)
    for text in TEXTS:
        expected = reference.encode(text)
        assert (expected[0] == BOS) == bos, text  # the case is what it says
        assert model.encode(text) == expected, text
        assert model.generate(text, 1).prompt_token_ids == expected, text
        stream = model.stream(text, 1)
        list(stream)
        assert stream.result.prompt_token_ids == expected, text
        plain = reference.encode(text, add_special_tokens=False)
        assert model.generate(text, 1, add_special_tokens=False).prompt_token_ids == plain, text
    batch = model.generate_batch(TEXTS[:2], 1)
    assert [r.prompt_token_ids for r in batch] == [reference.encode(t) for t in TEXTS[:2]]


@pytest.mark.parametrize("name", ["gguf-bos", "gguf-plain"])
def test_gguf_add_bos_token(packages, name):
    """llama.cpp's rule: BOS first when tokenizer.ggml.add_bos_token is true."""
    _, package, bos = packages[name]
    model = load(package, provider="cpu", threads=1)
    for text in TEXTS:
        plain = model.encode(text, add_special_tokens=False)
        assert plain[0] != BOS
        assert model.generate(text, 1).prompt_token_ids == [BOS] * bos + plain, text


def test_chat_templates_write_their_own_bos(packages):
    """The template writes BOS; the ids hold it once, as transformers' apply_chat_template gives them."""
    from transformers import AutoTokenizer

    source, package, _ = packages["folder-bos"]
    messages = [{"role": "user", "content": "hello world"}]
    expected = AutoTokenizer.from_pretrained(source).apply_chat_template(messages, tokenize=True, return_dict=False)
    assert expected.count(BOS) == 1
    reply = load(package, provider="cpu", threads=1).chat(messages, max_new_tokens=1)
    assert reply.prompt_token_ids == list(expected)


def test_switch_and_cli(packages):
    _, package, _ = packages["folder-bos"]
    with pytest.raises(InvalidParameterError, match="add_special_tokens"):
        load(package, provider="cpu", threads=1).generate("x", 1, add_special_tokens="no")
    counts = []
    for extra in ((), ("--no-bos",)):
        done = edgelm("generate", package, "hello world", "--max-new-tokens", "1", "--json", *extra)
        assert done.returncode == 0, done.stderr
        counts.append(json.loads(done.stdout)["prompt_tokens"])
    assert counts[0] == counts[1] + 1


@pytest.mark.parametrize("name", ["folder-bos", "folder-plain"])
def test_eval_scores_the_text_after_the_tokenizers_bos(packages, name, tmp_path):
    """eval streams its text, and the ids it scores start with what transformers' tokenizer.encode(text) puts
    first: BOS where the post-processor adds it (the first scored token is the text's first), none otherwise."""
    from transformers import AutoTokenizer

    from edgelm.quantize.evaluate import evaluate_package

    source, package, bos = packages[name]
    text = tmp_path / "text.txt"
    text.write_text("hello world a b c hello world x")
    expected = AutoTokenizer.from_pretrained(source).encode(text.read_text())
    assert (expected[0] == BOS) is bos
    report = evaluate_package(package, text)
    assert report["tokens"] == len(expected) - 1  # every id after the first is scored
