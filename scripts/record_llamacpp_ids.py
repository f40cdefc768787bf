"""Record llama.cpp's token ids for the tokenizer corpus, the expectations tests/export/test_tokenizer_corpus.py checks.

For every vocabulary edgelm builds a tokenizer from (tokenizer.ggml.model gpt2, llama or gemma4): llama.cpp's
vocabulary-only GGUFs that come with tokenizer tests (`ggml-vocab-*.gguf` with a `.inp` file, fetched by
scripts/fetch_llamacpp_vocab.py) and the two real files (scripts/fetch_real_models.py), each loaded with
llama-cpp-python's `Llama(model_path, vocab_only=True)`, and for every text of
tests/data/tokenizer_corpus/texts.json:

- `ids`: `tokenize(text, add_bos=False, special=False)`: special-token text read as text (user-defined tokens
  still match, as llama.cpp always matches them);
- `ids_special`, only where it differs: `tokenize(text, add_bos=False, special=True)`, control tokens parsed
  (a rendered chat template);
- `detokenizes`: whether `detokenize(ids)` gives the text's bytes back.

Per vocabulary also `bos`: `tokenize("Hello world")` with llama-cpp-python's default add_bos=True, and whether it
added the BOS id. It needs llama-cpp-python (a native build; never in CI: CI compares with the recorded file):

    .venv-llamacpp/bin/python scripts/record_llamacpp_ids.py  # writes tests/data/tokenizer_corpus/llamacpp_ids.json
    LLAMA_CPP_LIB_PATH=DIR PYTHONPATH=SDIST python scripts/record_llamacpp_ids.py  # the sdist's llama_cpp/ over the
                                                                                    # libllama.so its build made
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "data" / "tokenizer_corpus" / "texts.json"
OUT = CORPUS.with_name("llamacpp_ids.json")
KINDS = ("gpt2", "llama", "gemma4")  # the tokenizer.ggml.model values edgelm builds (export/gguf_tokenizer.py)
BOS_TEXT = "Hello world"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in it looks its module up
    spec.loader.exec_module(module)
    return module


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def vocabularies() -> dict[str, tuple[Path, str]]:
    """name -> (file, where it comes from): llama.cpp's test vocabularies by their name, the real files by theirs."""
    folder = _script("fetch_llamacpp_vocab").fetch_llamacpp_vocab()
    found = {
        path.name.removeprefix("ggml-vocab-").removesuffix(".gguf"): (path, f"llamacpp-vocab/{path.name}")
        for path in sorted(folder.glob("ggml-vocab-*.gguf"))
        if Path(f"{path}.inp").exists()
    }
    real = _script("fetch_real_models")
    for name, entry in real.REAL_FILES.items():
        found[name] = (real.fetch(name), entry.filename)
    return found


def record(path: Path, texts: list[dict]) -> dict | None:
    import llama_cpp

    llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    kind = llama.metadata.get("tokenizer.ggml.model")
    if kind not in KINDS:
        return None
    entries = {}
    for item in texts:
        raw = item["text"].encode("utf-8")
        ids = llama.tokenize(raw, add_bos=False, special=False)
        special = llama.tokenize(raw, add_bos=False, special=True)
        entry = {"ids": ids}
        if special != ids:
            entry["ids_special"] = special
        entry["detokenizes"] = llama.detokenize(ids) == raw
        entries[item["name"]] = entry
    plain = llama.tokenize(BOS_TEXT.encode(), add_bos=False, special=False)
    default = llama.tokenize(BOS_TEXT.encode(), special=False)  # add_bos=True: llama-cpp-python's default
    bos = llama.token_bos()
    assert default in (plain, [bos, *plain]), f"{path.name}: {default} is neither {plain} nor BOS + it"
    return {
        "tokenizer_model": kind,
        "n_tokens": llama.n_vocab(),
        "bos": {"text": BOS_TEXT, "default_ids": default, "bos_id": bos, "adds_bos": default != plain},
        "texts": entries,
    }


def dump(document: dict) -> str:
    """JSON with one line per text (an id list on one line), so a change reads as a short diff."""
    head = {key: value for key, value in document.items() if key != "vocabularies"}
    lines = ["{", *(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items())]
    lines.append('  "vocabularies": {')
    for v_index, (name, vocab) in enumerate(document["vocabularies"].items()):
        lines.append(f"    {json.dumps(name)}: {{")
        for key, value in vocab.items():
            if key != "texts":
                lines.append(f"      {json.dumps(key)}: {json.dumps(value)},")
        lines.append('      "texts": {')
        items = list(vocab["texts"].items())
        for t_index, (text_name, entry) in enumerate(items):
            comma = "," if t_index < len(items) - 1 else ""
            lines.append(f"        {json.dumps(text_name)}: {json.dumps(entry)}{comma}")
        lines.append("      }")
        lines.append("    }" + ("," if v_index < len(document["vocabularies"]) - 1 else ""))
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import llama_cpp

    texts = json.loads(CORPUS.read_text(encoding="utf-8"))["texts"]
    document = {
        "about": "llama.cpp's ids for tests/data/tokenizer_corpus/texts.json, made by scripts/record_llamacpp_ids.py "
        "(read its docstring for what each field is); tests/export/test_tokenizer_corpus.py compares edgelm's with "
        "them",
        "command": "python scripts/record_llamacpp_ids.py  (in a venv with llama-cpp-python)",
        "llama_cpp_python": llama_cpp.__version__,
        # the native library that ran: the package's own, or one named by LLAMA_CPP_LIB_PATH (built apart from
        # the same source distribution)
        "libllama_sha256": sha256(Path(llama_cpp.llama_cpp._lib._name).resolve()),
        "libllama_from_LLAMA_CPP_LIB_PATH": bool(os.environ.get("LLAMA_CPP_LIB_PATH")),
        "python": sys.version.split()[0],
        "corpus_sha256": sha256(CORPUS),
        "vocabularies": {},
    }
    for name, (path, source) in vocabularies().items():
        recorded = record(path, texts)
        if recorded is None:
            print(f"{name}: tokenizer model not built by edgelm, skipped", file=sys.stderr)
            continue
        document["vocabularies"][name] = {"file": source, "sha256": sha256(path)} | recorded
        print(f"{name}: {len(texts)} texts", file=sys.stderr)
    args.out.write_text(dump(document), encoding="utf-8")
    print(args.out)


if __name__ == "__main__":
    main()
