"""The runtime against the PyTorch reference and against itself: greedy parity, batching, streaming,
stop strings, cancellation, threads, the three kinds of package folder, and every documented error."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from helpers import copy_package, edit_manifest

from conftest import make_hf_checkpoint
from edgelm.runtime import (
    ContextLengthError,
    EdgelmError,
    InvalidInputError,
    InvalidParameterError,
    PackageError,
    PackageNotFoundError,
    ProviderError,
    load,
)
from edgelm.runtime.text import REPLACEMENT, TextAssembler, Tokenizer

PROMPT = "ROMEO: what"
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


# ---- fixtures: a model with room for 64 new tokens and less uniform weights ----------------------


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory) -> Path:
    # context 128 so a prompt plus 64 new tokens fits; initializer_range 10x GPT-2's so the random model's
    # greedy text varies from token to token instead of repeating one token (which would prove little)
    folder = tmp_path_factory.mktemp("long") / "gpt2-ctx128"
    return make_hf_checkpoint(folder, n_positions=128, initializer_range=0.2)


@pytest.fixture(scope="module")
def long_package(long_checkpoint, tmp_path_factory) -> Path:
    from edgelm.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("long-pkg") / "gpt2-ctx128-onnx"
    export_package(long_checkpoint, out, progress=lambda _: None)
    return out


@pytest.fixture(scope="module")
def long_model(long_package):
    return load(long_package, provider="cpu", threads=1)


@pytest.fixture(scope="module")
def long_standard_model(long_checkpoint, tmp_path_factory):
    """The same checkpoint as the standard-ops graph: past + new concatenated, left padding."""
    from edgelm.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("long-pkg") / "gpt2-ctx128-standard"
    export_package(long_checkpoint, out, attention="standard", progress=lambda _: None)
    return load(out, provider="cpu", threads=1)


GRAPHS = ["long_model", "long_standard_model"]  # fused attention + shared KV buffer, and standard ops


# ---- parity with the PyTorch reference ------------------------------------------------------------


@pytest.mark.parametrize("graph", GRAPHS)
def test_greedy_tokens_match_the_pytorch_reference(long_checkpoint, graph, request):
    import torch

    long_model = request.getfixturevalue(graph)

    from edgelm.export.families.gpt2 import load_checkpoint

    result = long_model.generate(PROMPT, 64, ignore_eos=True)
    reference = load_checkpoint(long_checkpoint).generate_greedy(torch.tensor([result.prompt_token_ids]), 64)
    assert result.token_ids == reference[0].tolist()
    assert len(result.token_ids) == 64 and result.finish_reason == "length"
    assert len(set(result.token_ids)) > 10, "the sequence should exercise the cache, not repeat one token"
    assert result.text == long_model.tokenizer.decode(result.token_ids)
    assert result.timings.prompt_tokens == len(result.prompt_token_ids)
    assert result.timings.new_tokens == 64


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with the CUDA execution provider")
def test_cuda_greedy_tokens_match_cpu(long_package, long_model):
    cuda_model = load(long_package, provider="cuda")
    assert cuda_model.device == "cuda"
    expected = long_model.generate(PROMPT, 32, ignore_eos=True).token_ids
    assert cuda_model.generate(PROMPT, 32, ignore_eos=True).token_ids == expected


# ---- batching -------------------------------------------------------------------------------------

BATCH = ["ROMEO:", "JULIET: O Romeo, Romeo, wherefore", "A"]


@pytest.mark.parametrize("graph", GRAPHS)
def test_greedy_batch_equals_each_prompt_alone(graph, request):
    long_model = request.getfixturevalue(graph)
    batch = long_model.generate_batch(BATCH, 24)
    lengths = {len(r.prompt_token_ids) for r in batch}
    assert len(lengths) == 3, "the prompts must differ in length so that padding is exercised"
    for prompt, result in zip(BATCH, batch, strict=True):
        alone = long_model.generate(prompt, 24)
        assert result.token_ids == alone.token_ids
        assert result.text == alone.text
        assert result.finish_reason == alone.finish_reason


@pytest.mark.parametrize("graph", GRAPHS)
def test_sampled_batch_row_r_uses_seed_plus_r(graph, request):
    long_model = request.getfixturevalue(graph)
    batch = long_model.generate_batch(BATCH, 16, temperature=1.0, top_k=50, seed=10)
    for row, (prompt, result) in enumerate(zip(BATCH, batch, strict=True)):
        assert result.token_ids == long_model.generate(prompt, 16, temperature=1.0, top_k=50, seed=10 + row).token_ids


def test_eos_ends_one_row_while_the_others_continue(long_package, long_model, tmp_path):
    ids = long_model.generate(BATCH[1], 24).token_ids
    # make the token the model emits at some step (and not before) the package's EOS
    step = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    package = copy_package(long_package, tmp_path)
    edit_manifest(package, lambda m: m["tokenizer"].update(eos_token_ids=[ids[step]]))
    model = load(package, provider="cpu", threads=1)

    alone = model.generate(BATCH[1], 24)
    assert alone.finish_reason == "eos"
    assert alone.token_ids == ids[:step]  # EOS itself is not part of the output
    batch = model.generate_batch(BATCH, 24)
    assert batch[1].token_ids == ids[:step] and batch[1].finish_reason == "eos"
    for prompt, result in zip(BATCH, batch, strict=True):
        assert result.token_ids == model.generate(prompt, 24).token_ids


# ---- seeds ----------------------------------------------------------------------------------------


def test_same_seed_same_text_different_seed_different_text(long_model):
    options = dict(temperature=1.0, top_p=0.95)
    first = long_model.generate(PROMPT, 32, seed=1, **options)
    assert long_model.generate(PROMPT, 32, seed=1, **options).token_ids == first.token_ids
    assert long_model.generate(PROMPT, 32, seed=2, **options).token_ids != first.token_ids


# ---- streaming and stop strings -------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(temperature=1.0, seed=3),
        dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3, seed=7),
        dict(temperature=1.5, seed=11, stop=["e", "zz"]),
    ],
    ids=["greedy", "sampled", "all-filters", "sampled-stop"],
)
def test_stream_concatenates_to_the_generated_text(long_model, options):
    expected = long_model.generate(PROMPT, 48, **options)
    stream = long_model.stream(PROMPT, 48, **options)
    pieces = list(stream)
    assert all(pieces), "no empty pieces"
    assert "".join(pieces) == expected.text
    assert stream.result.text == expected.text
    assert stream.result.token_ids == expected.token_ids
    assert stream.result.finish_reason == expected.finish_reason
    assert stream.result.prompt_token_ids == expected.prompt_token_ids


def piece_starts(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """Character offset in the decoded text where each token's text starts."""
    return [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]


def test_stop_string_spanning_tokens_cuts_exactly(long_model):
    full = long_model.generate(PROMPT, 48)
    text, ids = full.text, full.token_ids
    starts = piece_starts(long_model.tokenizer, ids)
    # two characters around a token boundary, far enough in that the cut leaves some text
    boundary = next(s for s in starts[4:] if 0 < s < len(text) and REPLACEMENT not in text[s - 1 : s + 1])
    stop = text[boundary - 1 : boundary + 1]
    cut = text.find(stop)
    completing = next(i for i in range(len(ids)) if stop in long_model.tokenizer.decode(ids[: i + 1]))
    assert cut < starts[completing], "the stop string must begin before the token that completes it"

    result = long_model.generate(PROMPT, 48, stop=stop)
    assert result.finish_reason == "stop"
    assert result.text == text[:cut]
    assert stop not in result.text
    assert result.token_ids == ids[: completing + 1]  # generation ended at the token completing the stop
    stream = long_model.stream(PROMPT, 48, stop=["never-generated", stop])
    assert "".join(stream) == text[:cut]
    assert stream.result.finish_reason == "stop"


def test_stop_string_that_never_appears_changes_nothing(long_model):
    full = long_model.generate(PROMPT, 20)
    result = long_model.generate(PROMPT, 20, stop="~~never~~")
    assert (result.text, result.token_ids, result.finish_reason) == (full.text, full.token_ids, "length")


@pytest.fixture(scope="module")
def tokenizer(package) -> Tokenizer:
    return Tokenizer(package / "tokenizer.json")


MULTIBYTE = "héllo — 日本語 🙂"


def feed(assembler: TextAssembler, ids: list[int]) -> list[str]:
    pieces = [assembler.add(i) for i in ids]
    if not assembler.stopped:
        pieces.append(assembler.flush())
    return pieces


def test_text_assembler_decodes_long_and_random_id_sequences_as_a_full_decode_does(tokenizer):
    """The assembler decodes a window after an anchor, not every id every step: the text must still
    equal decoding all ids, for long generations and for id sequences that break characters anywhere."""
    rng = np.random.default_rng(0)
    sequences = [tokenizer.encode(MULTIBYTE * 40)] + [
        rng.integers(0, tokenizer.vocab_size, int(rng.integers(1, 120))).tolist() for _ in range(100)
    ]
    for ids in sequences:
        assembler = TextAssembler(tokenizer)
        pieces = feed(assembler, ids)
        assert assembler.text == tokenizer.decode(ids)
        assert "".join(pieces) == assembler.text


def test_text_assembler_never_emits_half_a_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    assert tokenizer.decode(ids) == MULTIBYTE
    assert any(REPLACEMENT in tokenizer.decode(ids[:i]) for i in range(len(ids))), "tokens must split characters"
    pieces = feed(TextAssembler(tokenizer), ids)
    for piece in pieces:
        assert REPLACEMENT not in piece
        piece.encode("utf-8")  # no lone surrogates either
    assert "".join(pieces) == MULTIBYTE


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("日本", "héllo — "),  # a stop string made of multi-byte characters split across tokens
        ("llo —", "hé"),
        ("o — 日", "héll"),
        ("🙂", "héllo — 日本語 "),
    ],
)
def test_text_assembler_cuts_at_a_stop_string_spanning_tokens(tokenizer, stop, expected):
    assembler = TextAssembler(tokenizer, (stop,))
    pieces = feed(assembler, tokenizer.encode(MULTIBYTE + " more"))
    assert assembler.stopped
    assert "".join(pieces) == expected == assembler.text
    assert all(REPLACEMENT not in p for p in pieces)


def test_text_assembler_releases_a_held_back_partial_stop(tokenizer):
    """'llama' starts like the 'll' of 'héllo': held back, then released when the text goes elsewhere,
    and a partial match at the very end is released by flush."""
    assembler = TextAssembler(tokenizer, ("llama", "🙂!"))
    pieces = feed(assembler, tokenizer.encode(MULTIBYTE))
    assert not assembler.stopped
    assert pieces[-1].endswith("🙂"), "the possible start of '🙂!' is only final at the end"
    assert "".join(pieces) == MULTIBYTE


# ---- cancellation ---------------------------------------------------------------------------------


class CancelDuringStep:
    """Stands in for model.session: during forward pass number `at`, a second thread sets the event."""

    def __init__(self, session, event: threading.Event, at: int):
        self._session, self.event, self.at = session, event, at
        self.steps = 0

    def run_with_iobinding(self, binding, *args, **kwargs):
        self.steps += 1
        if self.steps == self.at:
            setter = threading.Thread(target=self.event.set)
            setter.start()
            setter.join()
        return self._session.run_with_iobinding(binding, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_cancel_from_another_thread_stops_generate_within_one_step(long_package):
    model = load(long_package, provider="cpu", threads=1)
    cancel = threading.Event()
    model.session = CancelDuringStep(model.session, cancel, at=5)  # steps 1-4 made 4 tokens before the event
    result = model.generate(PROMPT, 40, cancel=cancel, ignore_eos=True)
    assert result.finish_reason == "cancelled"
    assert 4 <= len(result.token_ids) <= 4 + 1
    assert model.session.steps == 5, "no forward pass after the one during which the event was set"


def test_cancel_from_another_thread_stops_a_stream_within_one_step(long_package):
    model = load(long_package, provider="cpu", threads=1)
    counter = CancelDuringStep(model.session, threading.Event(), at=0)  # counts steps only
    model.session = counter
    cancel = threading.Event()
    stream = model.stream(PROMPT, 40, cancel=cancel)
    pieces, tokens_when_cancelled = [], None
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == 3:
            tokens_when_cancelled = counter.steps  # one token per forward pass
            setter = threading.Thread(target=cancel.set)
            setter.start()
            setter.join()
    assert tokens_when_cancelled is not None, "the stream should yield more than 3 pieces"
    assert stream.result.finish_reason == "cancelled"
    assert tokens_when_cancelled <= len(stream.result.token_ids) <= tokens_when_cancelled + 1
    assert "".join(pieces) == stream.result.text


def test_cancel_before_the_first_step_generates_nothing(long_model):
    cancel = threading.Event()
    cancel.set()
    result = long_model.generate(PROMPT, 10, cancel=cancel)
    assert (result.token_ids, result.text, result.finish_reason) == ([], "", "cancelled")


# ---- threads --------------------------------------------------------------------------------------


def test_threads_sharing_a_model_match_sequential_runs(long_model):
    jobs = [(prompt, seed) for seed, prompt in enumerate(["ROMEO:", "JULIET: O", "First Citizen:", "KING"])]
    options = dict(temperature=0.9, top_k=50, repetition_penalty=1.1)
    sequential = [long_model.generate(p, 24, seed=s, **options).token_ids for p, s in jobs]
    start = threading.Barrier(len(jobs))

    def run(job):
        start.wait()  # all four decode loops run at the same time
        prompt, seed = job
        return [long_model.generate(prompt, 24, seed=seed, **options).token_ids for _ in range(3)]

    with ThreadPoolExecutor(len(jobs)) as pool:
        concurrent = list(pool.map(run, jobs))
    for expected, repeats in zip(sequential, concurrent, strict=True):
        assert repeats == [expected] * 3
    assert len({tuple(t) for t in sequential}) == len(jobs)


# ---- the other kinds of package folder ------------------------------------------------------------


def test_genai_config_only_folder_gives_the_same_tokens(long_package, long_model, tmp_path):
    folder = copy_package(long_package, tmp_path, "genai")
    (folder / "edgelm.json").unlink()
    model = load(folder, provider="cpu", threads=1, verify=False)  # unsigned: loaded on purpose
    assert model.spec.kind == "genai"
    assert (model.context_length, model.vocab_size) == (128, 320)
    expected = long_model.generate(PROMPT, 32)
    result = model.generate(PROMPT, 32)
    assert (result.token_ids, result.text) == (expected.token_ids, expected.text)


def test_optimum_style_folder_gives_the_same_tokens(long_checkpoint, long_package, long_model, tmp_path):
    folder = tmp_path / "optimum"
    folder.mkdir()
    shutil.copy(long_package / "model.onnx", folder)
    shutil.copy(long_package / "model.onnx.data", folder)  # its weights, as ONNX external data
    shutil.copy(long_checkpoint / "config.json", folder)  # the Hugging Face config, as Optimum writes it
    shutil.copy(long_checkpoint / "tokenizer.json", folder)
    model = load(folder, provider="cpu", threads=1, verify=False)  # unsigned: loaded on purpose
    assert model.spec.kind == "optimum"
    assert (model.context_length, model.vocab_size, model.spec.tokens.eos_token_ids) == (128, 320, [0])
    expected = long_model.generate(PROMPT, 32)
    result = model.generate(PROMPT, 32)
    assert (result.token_ids, result.text) == (expected.token_ids, expected.text)


# ---- the runtime alone ----------------------------------------------------------------------------

NO_TORCH = """
import sys

class Blocker:
    # refuse torch and the two rooms that may use it, as on a machine where they are not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch" or name.startswith(("edgelm.export", "edgelm.quantize")):
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, Blocker())
try:
    import torch  # noqa
    raise SystemExit("the blocker does not work")
except ImportError:
    pass

import edgelm.runtime
model = edgelm.runtime.load(sys.argv[1], provider="cpu", threads=1)
result = model.generate("ROMEO:", 8)
stream_text = "".join(model.stream("ROMEO:", 8))
assert "torch" not in sys.modules, "the runtime imported torch"
assert not [m for m in sys.modules if m.startswith(("edgelm.export", "edgelm.quantize"))]
print(" ".join(map(str, result.token_ids)))
"""


def test_runtime_never_imports_torch(package, model):
    done = subprocess.run([sys.executable, "-c", NO_TORCH, str(package)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(t) for t in model.generate("ROMEO:", 8).token_ids]


# ---- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [PackageError, PackageNotFoundError, ProviderError, InvalidParameterError, InvalidInputError, ContextLengthError],
)
def test_every_error_is_an_edgelm_error_and_a_value_error(error):
    assert issubclass(error, EdgelmError) and issubclass(error, ValueError)


@pytest.mark.skipif(HAS_CUDA, reason="onnxruntime here has the CUDA provider")
def test_cuda_on_a_cpu_only_onnxruntime_names_the_available_providers(package):
    with pytest.raises(ProviderError) as raised:
        load(package, provider="cuda")
    for name in ort.get_available_providers():
        assert name in str(raised.value)


def test_unknown_provider(package):
    with pytest.raises(ProviderError, match="unknown provider 'tpu'"):
        load(package, provider="tpu")


@pytest.mark.parametrize(
    ("bad", "name"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.2), "repetition_penalty"),
        (dict(seed=-1), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(truncate_prompt="no"), "truncate_prompt"),
        (dict(truncate_prompt=1), "truncate_prompt"),
        (dict(ignore_eos="no"), "ignore_eos"),
    ],
)
def test_bad_parameters_raise_before_generating(model, bad, name):
    with pytest.raises(InvalidParameterError, match=name):
        model.generate("ROMEO:", **bad)
    with pytest.raises(InvalidParameterError, match=name):
        model.stream("ROMEO:", **bad)  # a stream validates when it is created, not at the first piece


def test_bad_thread_count(package, monkeypatch):
    from edgelm.runtime import session

    with pytest.raises(InvalidParameterError, match="threads"):
        load(package, provider="cpu", threads=0)
    # more threads than the CPUs this process may use are refused before ONNX Runtime tries to start them (a
    # thousand may not start under a memory limit, where it hangs); as many as there are CPUs are fine
    limit = session.max_threads()
    with pytest.raises(InvalidParameterError, match=f"threads must be an integer from 1 to {limit} "):
        load(package, provider="cpu", threads=limit + 1)
    monkeypatch.setattr(session, "max_threads", lambda: 3)
    load(package, provider="cpu", threads=3)
    with pytest.raises(InvalidParameterError, match="from 1 to 3 "):
        load(package, provider="cpu", threads=4)
    from helpers import edgelm

    run = edgelm("generate", package, "x", "--threads", str(limit + 1))
    assert run.returncode == 1 and len(run.stderr.splitlines()) == 1 and "--threads" in run.stderr, run.stderr


@pytest.mark.parametrize("prompt", [[-1], [320], [5, 6, 1000], [1.5], b"ROMEO:", None])
def test_bad_prompts(model, prompt):
    with pytest.raises(InvalidInputError):
        model.generate(prompt, 4)


def test_an_empty_batch(model):
    with pytest.raises(InvalidInputError, match="non-empty"):
        model.generate_batch([], 4)


def test_zero_new_tokens(model):
    result = model.generate("ROMEO:", 0)
    assert (result.token_ids, result.text, result.finish_reason) == ([], "", "length")
    stream = model.stream("ROMEO:", 0)
    assert list(stream) == [] and stream.result.finish_reason == "length"


def test_a_bad_prompt_in_a_batch_is_named(model):
    with pytest.raises(InvalidInputError, match="token id 320 is outside the vocabulary"):
        model.generate_batch(["ROMEO:", [1, 320]], 4)


def test_empty_prompt_starts_from_bos(model):
    result = model.generate("", 4)
    assert result.prompt_token_ids == [0]
    assert model.generate([], 4).token_ids == result.token_ids


def test_empty_prompt_without_bos(package, tmp_path):
    folder = copy_package(package, tmp_path)
    edit_manifest(folder, lambda m: m["tokenizer"].update(bos_token_id=None))
    model = load(folder, provider="cpu", threads=1)
    assert model.spec.tokens.bos_token_id is None
    for empty in ("", []):
        with pytest.raises(InvalidInputError, match="empty"):
            model.generate(empty, 4)
    assert len(model.generate("ROMEO:", 4).token_ids) == 4


def test_context_length(model):
    assert model.context_length == 64
    ids = list(range(1, 61))  # 60 tokens, none of them EOS (0)
    assert model.generate(ids[:54], 10, ignore_eos=True).token_ids  # 54 + 10 = 64 fits exactly
    with pytest.raises(ContextLengthError, match="exceeds the context length 64"):
        model.generate(ids, 10)
    with pytest.raises(ContextLengthError):
        model.stream(ids, 10)
    with pytest.raises(ContextLengthError):
        model.generate([1], 64)
    with pytest.raises(ContextLengthError, match="max_new_tokens"):
        model.generate(ids, 64, truncate_prompt=True)  # no prompt at all would fit


def test_truncate_prompt_keeps_the_last_tokens(model):
    ids = list(range(1, 61))
    result = model.generate(ids, 10, truncate_prompt=True, ignore_eos=True)
    assert result.prompt_token_ids == ids[-54:]
    assert result.token_ids == model.generate(ids[-54:], 10, ignore_eos=True).token_ids
    assert model.generate(ids[:20], 10, truncate_prompt=True).prompt_token_ids == ids[:20]  # fits: untouched


def test_missing_package_folder(tmp_path):
    with pytest.raises(PackageNotFoundError, match="does not exist"):
        load(tmp_path / "no-such-package", provider="cpu")


@pytest.mark.parametrize("verify", [True, False])
def test_package_without_model_onnx(package, tmp_path, verify):
    folder = copy_package(package, tmp_path)
    (folder / "model.onnx").unlink()
    with pytest.raises(PackageNotFoundError, match="model.onnx"):
        load(folder, provider="cpu", verify=verify)


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data"])
def test_tampered_model_onnx(package, tmp_path, name):
    folder = copy_package(package, tmp_path)
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit (in model.onnx.data, a weight): ONNX Runtime would load it without complaint
    (folder / name).write_bytes(bytes(data))
    with pytest.raises(PackageError, match=f"{name} does not match its sha256"):
        load(folder, provider="cpu")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_model_onnx_without_verification(package, tmp_path, damage):
    folder = copy_package(package, tmp_path)
    path = folder / "model.onnx"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"this is not an ONNX model\n" * 10)
    with pytest.raises(PackageError, match="model.onnx"):
        load(folder, provider="cpu", verify=False)


@pytest.mark.parametrize("contents", [[], ["model.onnx"], ["model.onnx", "tokenizer.json"]])
def test_folder_without_package_json(package, tmp_path, contents):
    folder = tmp_path / "not-a-package"
    folder.mkdir()
    for name in contents:
        shutil.copy(package / name, folder)
    with pytest.raises(PackageError, match="is not a model package"):
        load(folder, provider="cpu")


def test_manifest_that_is_not_json(package, tmp_path):
    folder = copy_package(package, tmp_path)
    (folder / "edgelm.json").write_text("{ not json")
    with pytest.raises(PackageError, match="edgelm.json is not valid JSON"):
        load(folder, provider="cpu")


def test_a_file_instead_of_a_folder(package):
    with pytest.raises(PackageError, match="not a folder"):
        load(package / "model.onnx", provider="cpu")


class _Poisoned:
    """A KV-cache driver whose logits get one bad value: NaN, +inf or -inf at `where` (every id for "all")."""

    def __init__(self, cache, value: float, where):
        self.cache, self.value, self.where = cache, value, where

    def _poison(self, logits: np.ndarray) -> np.ndarray:
        logits = logits.copy()
        logits[..., self.where] = self.value
        return logits

    def prompt(self):
        return self._poison(self.cache.prompt())

    def next(self, next_ids):
        return self._poison(self.cache.next(next_ids))


POISONS = {"NaN": (float("nan"), 7), "+inf": (float("inf"), 7), "all -inf": (float("-inf"), slice(None))}
DECODING = {"greedy": {}, "sampled": {"temperature": 0.8, "seed": 1}, "penalized": {"repetition_penalty": 1.3}}


@pytest.mark.parametrize("decoding", DECODING)
@pytest.mark.parametrize("poison", POISONS)
def test_non_finite_logits_from_the_model_are_a_package_error(model, monkeypatch, poison, decoding):
    from edgelm.runtime import decode as generator  # the decode loop makes its caches

    real = generator.make_cache
    monkeypatch.setattr(generator, "make_cache", lambda *a, **k: _Poisoned(real(*a, **k), *POISONS[poison]))
    with pytest.raises(PackageError, match="non-finite logits"):
        model.generate([1, 2, 3], 4, ignore_eos=True, **DECODING[decoding])


def test_a_minus_inf_logit_beside_finite_ones_leaves_greedy_unchanged(model, monkeypatch):
    from edgelm.runtime import decode as generator  # the decode loop makes its caches

    clean = model.generate([1, 2, 3], 6, ignore_eos=True).token_ids
    real = generator.make_cache
    # -inf on a token greedy never picks here: the pick is the same, and nothing is refused
    unused = next(i for i in range(model.spec.arch.vocab_size) if i not in clean)
    monkeypatch.setattr(generator, "make_cache", lambda *a, **k: _Poisoned(real(*a, **k), float("-inf"), unused))
    assert model.generate([1, 2, 3], 6, ignore_eos=True).token_ids == clean
