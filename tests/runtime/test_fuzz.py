"""Property-based fuzzing of the runtime's inputs with hypothesis: prompts (any text, token-id lists of
anything), sampling parameters of any type and value, load arguments, and corrupted
genai_config.json / edgelm.json. Every call must end in a result or one of the runtime's documented
errors (EdgelmError subclasses), never another exception, never a hang, and no error message may carry
ONNX Runtime's internals.

Examples per property are in EXAMPLES; a watchdog interrupts any example that runs longer than
HANG_SECONDS (hypothesis' own deadline only reports slow examples after they finish)."""

from __future__ import annotations

import copy
import json
import shutil
import signal
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from edgelm.runtime import (
    ContextLengthError,
    EdgelmError,
    InvalidInputError,
    InvalidParameterError,
    load,
)

pytestmark = pytest.mark.slow  # hypothesis runs hundreds of examples a property


EXAMPLES = {"text": 300, "token_ids": 300, "sampling": 300, "load": 150, "genai_config": 300, "manifest": 300}
HANG_SECONDS = 20
ORT_INTERNALS = ("[ONNXRuntimeError]", "onnxruntime::", "onnxruntime_src")
FINISH_REASONS = {"length", "eos", "stop", "cancelled"}
OUTCOMES: Counter = Counter()  # (property, "result" or an error class name): how the examples ended
PROVIDERS = {"cpu", "auto"} | ({"cuda"} if "CUDAExecutionProvider" in ort.get_available_providers() else set())


def fuzz_settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=timedelta(seconds=5),  # each example takes milliseconds; generous for a busy machine
        database=None,  # no .hypothesis folder in the repository
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


class Hang(BaseException):
    """Not an Exception: the runtime's `except Exception` blocks cannot turn it into a PackageError."""


@contextmanager
def watchdog(seconds: int = HANG_SECONDS):
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Hang(f"the example ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_message(error: Exception) -> None:
    message = str(error)
    assert message, f"{type(error).__name__} without a message"
    assert not any(internal in message for internal in ORT_INTERNALS), message


def check_result(model, result, max_new_tokens: int) -> None:
    assert result.finish_reason in FINISH_REASONS
    assert len(result.token_ids) <= max_new_tokens
    assert all(isinstance(t, int) and 0 <= t < model.vocab_size for t in result.token_ids)
    assert len(result.prompt_token_ids) + max_new_tokens <= model.context_length
    result.text.encode("utf-8")  # valid text: no lone surrogates, no half characters


def run(model, prompt, max_new_tokens, *, use_stream: bool = False, **options):
    """generate or stream (consumed to the end); returns the GenerationResult."""
    if use_stream:
        stream = model.stream(prompt, max_new_tokens, **options)
        text = "".join(stream)
        assert text == stream.result.text
        return stream.result
    return model.generate(prompt, max_new_tokens, **options)


# ---- prompts --------------------------------------------------------------------------------------

# every code point, control characters and lone surrogates included
any_char = st.characters(exclude_categories=())
any_text = st.one_of(
    st.text(any_char, max_size=40),
    st.text(any_char, min_size=200, max_size=2000),  # longer than the 64-token context
    st.builds(lambda piece, times: piece * times, st.text(any_char, min_size=1, max_size=4), st.integers(1, 3000)),
)


def has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@fuzz_settings(EXAMPLES["text"])
@given(text=any_text, max_new_tokens=st.integers(0, 4), truncate=st.booleans(), use_stream=st.booleans())
def test_any_text_prompt(model, text, max_new_tokens, truncate, use_stream):
    with watchdog():
        try:
            result = run(model, text, max_new_tokens, use_stream=use_stream, truncate_prompt=truncate)
        except InvalidInputError as e:
            OUTCOMES["text", type(e).__name__] += 1
            check_message(e)
            if has_surrogate(text):
                assert "not valid Unicode" in str(e)
            else:
                assert isinstance(e, ContextLengthError) and not truncate
                assert len(model.tokenizer.encode(text)) + max_new_tokens > model.context_length
            return
    OUTCOMES["text", "result"] += 1
    assert not has_surrogate(text)
    check_result(model, result, max_new_tokens)
    ids = model.tokenizer.encode(text) or [model.spec.tokens.bos_token_id]
    assert result.prompt_token_ids == ids[max(0, len(ids) + max_new_tokens - model.context_length) :]
    assert result.text == model.tokenizer.decode(result.token_ids)


def numpy_scalar():
    return st.one_of(
        st.integers(-(2**63), 2**63 - 1).map(np.int64),
        st.integers(0, 2**64 - 1).map(np.uint64),
        st.integers(0, 255).map(np.uint8),
        st.floats(width=32).map(np.float32),
        st.booleans().map(np.bool_),
    )


token = st.one_of(
    st.integers(0, 319),  # in the vocabulary
    st.integers(),
    st.integers(-(2**70), 2**70),
    numpy_scalar(),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
)
id_prompt = st.one_of(
    st.lists(st.integers(0, 319), max_size=70),
    st.lists(token, max_size=70),
    st.lists(token, max_size=5).map(tuple),
    arrays(
        st.sampled_from([np.int64, np.int32, np.uint16, np.float64, np.bool_]),
        array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=8),
    ),
    arrays(np.int64, st.integers(0, 70), elements=st.integers(0, 319)),
    st.sets(st.integers(0, 319), max_size=4),
    st.dictionaries(st.integers(0, 319), st.integers(), max_size=3),
    st.binary(max_size=8),
    st.integers(),
    st.none(),
)


def valid_ids(prompt, vocab_size: int) -> list[int] | None:
    """The token ids a prompt stands for, or None where the runtime must refuse it."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            return None
        prompt = list(prompt)
    if not isinstance(prompt, (list, tuple)):
        return None
    for i in prompt:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not 0 <= i < vocab_size:
            return None
    return [int(i) for i in prompt]


@fuzz_settings(EXAMPLES["token_ids"])
@given(prompt=id_prompt, max_new_tokens=st.integers(0, 4), truncate=st.booleans(), batch=st.booleans())
def test_any_token_id_prompt(model, prompt, max_new_tokens, truncate, batch):
    ids = valid_ids(prompt, model.vocab_size)
    with watchdog():
        try:
            if batch:
                result = model.generate_batch([prompt, "ROMEO:"], max_new_tokens, truncate_prompt=truncate)[0]
            else:
                result = model.generate(prompt, max_new_tokens, truncate_prompt=truncate)
        except InvalidInputError as e:
            OUTCOMES["token_ids", type(e).__name__] += 1
            check_message(e)
            if ids is not None:  # a valid prompt may only be refused for its length
                assert isinstance(e, ContextLengthError) and not truncate
                assert len(ids) + max_new_tokens > model.context_length
            return
    OUTCOMES["token_ids", "result"] += 1
    assert ids is not None, f"{prompt!r} should have been refused"
    check_result(model, result, max_new_tokens)
    ids = ids or [model.spec.tokens.bos_token_id]
    assert result.prompt_token_ids == ids[max(0, len(ids) + max_new_tokens - model.context_length) :]


# ---- sampling parameters --------------------------------------------------------------------------

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-3, 3),
    st.floats(),
    st.floats(0, 2),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
    numpy_scalar(),
)
VALID = {
    "temperature": st.one_of(st.just(0.0), st.floats(0, 3), st.floats(1e-300, 1e300)),
    "top_k": st.one_of(st.integers(0, 400), st.integers(0, 2**64 - 1).map(np.uint64)),
    "top_p": st.floats(0, 1, exclude_min=True),
    "min_p": st.floats(0, 1, exclude_max=True),
    "repetition_penalty": st.floats(0.01, 100),
    "seed": st.one_of(st.none(), st.integers(0, 2**100)),
    "max_new_tokens": st.integers(0, 6),
    "stop": st.one_of(
        st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)
    ),
    "truncate_prompt": st.booleans(),
    "ignore_eos": st.booleans(),
    "cancel": st.one_of(st.none(), st.builds(threading.Event)),
}


@st.composite
def sampling_options(draw):
    """Up to two parameters get anything at all, the others are absent or valid; returns (options,
    hostile), hostile being the names whose values came from `anything`."""
    hostile = draw(st.one_of(st.just(set()), st.sets(st.sampled_from(list(VALID)), min_size=1, max_size=2)))
    options = {}
    for name, valid in VALID.items():
        if name in hostile:
            options[name] = draw(anything)
        elif draw(st.booleans()):
            options[name] = draw(valid)
    return options, hostile


@fuzz_settings(EXAMPLES["sampling"])
@given(drawn=sampling_options(), use_stream=st.booleans())
def test_any_sampling_parameters(model, drawn, use_stream):
    options, hostile = drawn
    options = dict(options)
    max_new_tokens = options.pop("max_new_tokens", 4)
    if use_stream:
        options.pop("ignore_eos", None)  # a generate_batch option (benchmarks); stream does not take it
    with watchdog():
        try:
            result = run(model, "ROMEO:", max_new_tokens, use_stream=use_stream, **options)
        except (InvalidParameterError, ContextLengthError) as e:
            OUTCOMES["sampling", type(e).__name__] += 1
            check_message(e)
            assert hostile, f"valid options refused: {options!r}: {e}"
            if isinstance(e, InvalidParameterError):  # the message names the offending parameter
                assert any(name in str(e) for name in hostile), f"{e} does not name one of {hostile}"
            else:
                assert "max_new_tokens" in hostile
            return
        OUTCOMES["sampling", "result"] += 1
        check_result(model, result, max_new_tokens)
        if options.get("seed") is not None and not hostile and not use_stream:  # a seed reproduces a run
            assert model.generate("ROMEO:", max_new_tokens, **options).token_ids == result.token_ids


# ---- load arguments -------------------------------------------------------------------------------

LOAD_VALID = {
    "path": st.just("package"),
    "provider": st.sampled_from(sorted(PROVIDERS)),
    "threads": st.sampled_from([None, 1, 2]),
}
LOAD_HOSTILE = {
    "path": st.one_of(
        st.sampled_from(["model.onnx", "missing"]),
        st.text(any_char, max_size=20),
        st.text(min_size=300, max_size=5000),  # longer than a file name may be
        anything,
    ),
    "provider": st.one_of(st.sampled_from(["cuda", "tpu", "CPU", "", "CPUExecutionProvider"]), anything),
    # not 3 to 1024: a real pool of hundreds of threads would prove nothing and cost time
    "threads": st.one_of(st.integers(max_value=0), st.integers(min_value=1025), anything).filter(
        lambda t: not (isinstance(t, int) and 3 <= t <= 1024)
    ),
}


@fuzz_settings(EXAMPLES["load"])
@given(
    hostile=st.one_of(st.just(set()), st.sets(st.sampled_from(list(LOAD_VALID)), min_size=1, max_size=2)),
    data=st.data(),
)
def test_any_load_arguments(package, hostile, data):
    arguments = {
        name: data.draw((LOAD_HOSTILE if name in hostile else LOAD_VALID)[name], label=name) for name in LOAD_VALID
    }
    named = {"package": package, "model.onnx": package / "model.onnx", "missing": package / "missing"}
    path = arguments.pop("path")
    path = named[path] if isinstance(path, str) and path in named else path
    with watchdog():
        try:
            model = load(path, **arguments)
        except EdgelmError as e:
            OUTCOMES["load", type(e).__name__] += 1
            check_message(e)
            assert hostile, f"valid arguments refused: {arguments!r}: {e}"
            return
    OUTCOMES["load", "result"] += 1
    assert path == package and arguments["provider"] in PROVIDERS and arguments["threads"] in (None, 1, 2)
    assert model.generate("ROMEO:", 2).finish_reason in FINISH_REASONS


# ---- corrupted package JSON -----------------------------------------------------------------------

INTERESTING = [0, 1, 2, -1, 4, 8, 16, 32, 63, 64, 65, 319, 320, 321, 10**9, 2**63, -(2**63), 1.5, float("nan")]
INTERESTING += ["", "model.onnx", "tokenizer.json", "../model.onnx", "/etc/passwd", "input_ids", "attention_mask"]
INTERESTING += ["position_ids", "logits", "present.%d.key", "past_key_values.%d.value", "%d", "%s", "%(x)d"]
INTERESTING += ["%.999999999d", "gpt2", "edgelm-package", "fp16", [0], [], {}, None, True, False]
json_value = st.one_of(
    st.sampled_from(INTERESTING),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
        lambda children: st.one_of(
            st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children, max_size=3)
        ),
        max_leaves=6,
    ),
)


def node_paths(value, prefix=()):
    """Every path into a JSON document, the root () included."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from node_paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from node_paths(child, (*prefix, index))


@st.composite
def corrupted(draw, original: dict):
    """One to three edits of a JSON document: delete a key or item, or replace any value (the whole
    document included) with another JSON value of any type."""
    document = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(node_paths(document))))
        if not path:
            document = copy.deepcopy(draw(json_value))  # a drawn value may be shared; never nest it in itself
            continue
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(draw(json_value))
    return document


@pytest.fixture(scope="module")
def fuzz_folders(package, tmp_path_factory) -> dict[str, Path]:
    """Copies of the package, one per kind of folder; each example rewrites only the JSON file."""
    root = tmp_path_factory.mktemp("fuzz")
    edgelm = Path(shutil.copytree(package, root / "edgelm"))
    genai = Path(shutil.copytree(package, root / "genai"))
    (genai / "edgelm.json").unlink()
    return {"edgelm.json": edgelm, "genai_config.json": genai}


def load_corrupted(folder: Path, name: str, document, verify: bool) -> None:
    """Load, describe and generate (text, ids, a batch, the empty prompt) from a corrupted folder."""
    (folder / name).write_text(json.dumps(document))
    stage = "load"
    with watchdog():
        try:
            model = load(folder, provider="cpu", threads=1, verify=verify)
            stage = "generate"
            model.info()
            for prompt in ("ROMEO:", [1, 2, 3]):
                check_result(model, model.generate(prompt, 2), 2)
            check_result(model, model.generate_batch(["ROMEO: what", [4]], 2)[1], 2)
            check_result(model, model.generate("", 2), 2)
            stage = "result"
        except EdgelmError as e:
            check_message(e)
            stage = f"{type(e).__name__} at {stage}"
    OUTCOMES[name, stage] += 1


def original(package: Path, name: str) -> dict:
    return json.loads((package / name).read_text())


@pytest.fixture(scope="module")
def genai_document(package) -> dict:
    return original(package, "genai_config.json")


@pytest.fixture(scope="module")
def manifest_document(package) -> dict:
    return original(package, "edgelm.json")


@fuzz_settings(EXAMPLES["genai_config"])
@given(data=st.data())
def test_corrupted_genai_config(fuzz_folders, genai_document, data):
    document = data.draw(corrupted(genai_document))
    # no manifest: a genai folder loads only on purpose, unverified
    load_corrupted(fuzz_folders["genai_config.json"], "genai_config.json", document, verify=False)


@fuzz_settings(EXAMPLES["manifest"])
@given(data=st.data(), verify=st.booleans())
def test_corrupted_manifest(fuzz_folders, manifest_document, data, verify):
    document = data.draw(corrupted(manifest_document))
    load_corrupted(fuzz_folders["edgelm.json"], "edgelm.json", document, verify=verify)


def test_the_fuzz_folders_still_load(fuzz_folders, package, model):
    """The corruption came from the drawn documents: restored, both folders load and agree. And the
    fuzzing reached generation, not only refusals (where the properties above ran in this session)."""
    for name, folder in fuzz_folders.items():
        shutil.copy(package / name, folder / name)
        restored = load(folder, provider="cpu", threads=1, verify=name == "edgelm.json")
        assert restored.generate("ROMEO:", 6).token_ids == model.generate("ROMEO:", 6).token_ids
    print("\nfuzz outcomes:", file=sys.stderr)
    for (prop, outcome), count in sorted(OUTCOMES.items()):
        print(f"  {prop:18} {outcome:40} {count}", file=sys.stderr)
    for prop in {prop for prop, _ in OUTCOMES}:
        ended = {outcome for p, outcome in OUTCOMES if p == prop}
        assert "result" in ended and len(ended) > 1, f"{prop}: every example ended the same way: {ended}"


# ---- the samplers' numerics -------------------------------------------------------------------------

EXTREME_FLOATS = [1e-45, 5e-324, 1e-30, 1e-7, 0.5, 1.0, 2.0, 1e7, 1e30, 1e300, 1.7e308]


@st.composite
def extreme_params(draw):
    from edgelm.runtime.sampling import SamplingParams

    return SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.sampled_from(EXTREME_FLOATS), st.floats(0, 1e308))),
        top_k=draw(st.one_of(st.just(0), st.integers(1, 400), st.just(2**63))),
        top_p=draw(st.one_of(st.just(1.0), st.sampled_from([1e-300, 1e-45, 1e-7, 0.5, 0.999999]))),
        min_p=draw(st.one_of(st.just(0.0), st.sampled_from([1e-300, 0.5, 0.999999, 1 - 2**-53]))),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.sampled_from(EXTREME_FLOATS))),
    )


logit_values = st.one_of(
    st.floats(width=32, allow_nan=False), st.sampled_from([np.inf, -np.inf, 3.4e38, -3.4e38, 0.0, 1e-45])
)


@fuzz_settings(400)
@given(
    logits=arrays(np.float32, st.integers(1, 300), elements=logit_values),
    params=extreme_params(),
    seen=st.lists(st.integers(0, 299), max_size=20),
    seed=st.integers(0, 2**32),
)
def test_the_sampler_stays_finite_under_any_accepted_parameter(logits, params, seen, seed):
    """Any accepted parameter value, logits with +-inf and extremes: a valid token, never NaN, no
    warning; a row with no token that can be chosen (all -inf) is refused."""
    from edgelm.runtime.sampling import sample

    seen = np.array([s for s in seen if s < len(logits)], dtype=np.int64)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # unless handled on purpose; underflow is fine
        if np.isneginf(logits).all():
            with pytest.raises(InvalidInputError, match="-inf"):
                sample(logits, params, np.random.default_rng(seed), seen)
            return
        token = sample(logits, params, np.random.default_rng(seed), seen)
    assert 0 <= token < len(logits)
    assert logits[token] != -np.inf, "a token with probability 0 was drawn"


@pytest.mark.parametrize("penalty", [1e-45, 1e-30, 1e30, 1e300])
def test_extreme_repetition_penalties_stay_finite(model, penalty):
    """The issue's case: a penalty of 1e-45 made seen logits inf, then NaN, and the sampler drew from NaN.
    Now seen logits are clipped to the largest finite value: a tiny penalty strongly favours repeats (what
    it asks for), by the numbers, and a huge one makes them about as likely as a zero logit."""
    prompt = model.encode("ROMEO: and JULIET")
    for seed in range(3):
        result = model.generate(prompt, 12, temperature=0.8, repetition_penalty=penalty, seed=seed)
        check_result(model, result, 12)
        again = model.generate(prompt, 12, temperature=0.8, repetition_penalty=penalty, seed=seed)
        assert again.token_ids == result.token_ids
        if penalty < 1e-20:  # a seen token's positive logit is now the largest float: only seen tokens follow
            for i, token in enumerate(result.token_ids[1:], start=1):
                assert token in set(prompt) | set(result.token_ids[:i]), (i, result.token_ids)
