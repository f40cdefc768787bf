"""Load a model package and generate from it: onnxruntime + numpy + tokenizers, nothing else.

    model = load("models/shakespeare-onnx")
    result = model.generate("ROMEO:", max_new_tokens=64, temperature=0.8, top_k=40, seed=0)
    for piece in model.stream("JULIET:", max_new_tokens=64):
        print(piece, end="", flush=True)

The decode loop has one shape (onnxruntime-genai's `while not generator.is_done()`): feed the
prompt, then sample, append, feed one token, until EOS, a stop string, the token budget or a
cancellation. The KV cache never goes through numpy and, with CUDA, stays on the device. How it
moves depends on the graph (the package's io.kv_cache): the fused graph (export's default) updates
one preallocated buffer per cache tensor in place, bound once as both past and present; the standard
graph returns past + new as new OrtValues, bound as the next step's past.

One loaded Model may be shared by threads: ONNX Runtime sessions run concurrently, and every call
keeps its own cache, binding and random generator.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import ContextLengthError, InvalidInputError, InvalidParameterError, PackageError, ProviderError
from .package import PackageSpec, check_generation_memory, read_package
from .sampling import SamplingParams, sample
from .text import TextAssembler, Tokenizer

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
_KV_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # cache and logits types
MAX_THREADS = 1024


def _ort_reason(error: Exception) -> str:
    """The useful part of an ONNX Runtime exception: its first line without the status-code prefix,
    the C++ source location and function signature, which mean nothing to a user."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"^(Load model from .*? failed:|Error in execution: )", "", text)
    text = re.sub(r"\S+\.(cc|cpp|h):\d+ (\S+\(.*?\)( const)? )?", "", text)
    return text.split("Status Message: ")[-1].strip()


@dataclass
class Timings:
    load_s: float = 0.0  # not per call: filled in by bench
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token_s: float = 0.0  # from the call to the first sampled token (prompt pass included)
    decode_tokens_per_s: float = 0.0  # tokens after the first, per second
    total_s: float = 0.0


@dataclass
class GenerationResult:
    text: str  # the generated text (a stop string is not included)
    token_ids: list[int]  # the generated ids (EOS not included)
    finish_reason: str  # "eos", "stop", "length" or "cancelled"
    prompt_token_ids: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_token_ids),
            "timings": self.timings.__dict__,
        }


class Stream:
    """An iterator of final text pieces; after it is exhausted, .result holds the GenerationResult."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)


def resolve_providers(provider: str) -> list[str]:
    available = ort.get_available_providers()
    if provider == "auto":
        return [PROVIDERS["cuda"], PROVIDERS["cpu"]] if PROVIDERS["cuda"] in available else [PROVIDERS["cpu"]]
    if not isinstance(provider, str) or provider not in PROVIDERS:
        raise ProviderError(f"unknown provider {provider!r}; choose one of 'cpu', 'cuda', 'auto'")
    name = PROVIDERS[provider]
    if name not in available:
        raise ProviderError(
            f"provider {provider!r} ({name}) is not available in this onnxruntime build; available: "
            f"{', '.join(available)}. For CUDA install onnxruntime-gpu instead of onnxruntime."
        )
    return [name] if provider == "cpu" else [name, PROVIDERS["cpu"]]


def load(path: str | Path, provider: str = "auto", threads: int | None = None, *, verify: bool = True) -> Model:
    """Load a package folder. provider: "cpu", "cuda" or "auto" (CUDA when available, else CPU);
    threads: intra-op threads (None = ONNX Runtime's default, one per physical core);
    verify: check every file against the manifest's sha256 first."""
    return Model(path, provider=provider, threads=threads, verify=verify)


class Model:
    def __init__(self, path: str | Path, *, provider: str = "auto", threads: int | None = None, verify: bool = True):
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS
        ):
            raise InvalidParameterError(f"threads must be an integer from 1 to {MAX_THREADS} or None, got {threads!r}")
        started = time.perf_counter()
        providers = resolve_providers(provider)
        self.spec: PackageSpec = read_package(path, verify=verify)
        self.tokenizer = Tokenizer(self.spec.tokenizer_path) if self.spec.tokenizer_path else None

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only: warnings about unused initializers are noise to users
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(self.spec.model_path), options, providers=providers)
        except Exception as e:  # onnxruntime raises its own pybind exception types
            raise PackageError(f"ONNX Runtime cannot load {self.spec.model_path.name}: {_ort_reason(e)}") from None
        if provider == "cuda" and PROVIDERS["cuda"] not in self.session.get_providers():
            raise ProviderError("the CUDA provider is installed but failed to start (check the CUDA/cuDNN libraries)")
        self.device = "cuda" if PROVIDERS["cuda"] in self.session.get_providers() else "cpu"
        self._check_io()
        self.load_s = time.perf_counter() - started

    # ---- package facts -------------------------------------------------------------------------

    def _check_io(self) -> None:
        """The graph's I/O against the package JSON, so that a mismatch is a PackageError at load
        time and not an ONNX Runtime failure in the middle of generation."""
        spec = self.spec
        name = spec.model_path.name
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        if 2 * spec.n_layer > len(inputs):  # before building 2 * n_layer names: n_layer may be huge
            raise PackageError(f"the package says {spec.n_layer} layers, but {name} has only {len(inputs)} inputs")
        self._past_names = [(spec.past_key % i, spec.past_value % i) for i in range(spec.n_layer)]
        self._present_names = [(spec.present_key % i, spec.present_value % i) for i in range(spec.n_layer)]
        needed_in = [spec.input_ids, spec.attention_mask, *[n for pair in self._past_names for n in pair]]
        needed_out = [spec.logits, *[n for pair in self._present_names for n in pair]]
        missing = [n for n in needed_in if n not in inputs] + [n for n in needed_out if n not in outputs]
        if missing:
            raise PackageError(
                f"{name} does not match its package description: no I/O named "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
            )
        self._use_position_ids = spec.position_ids is not None and spec.position_ids in inputs
        if spec.logits_to_keep and spec.logits_to_keep not in inputs:
            overridable = {i.name for i in self.session.get_overridable_initializers()}
            if spec.logits_to_keep not in overridable:
                raise PackageError(f"{name} has no input {spec.logits_to_keep}, which the package names logits_to_keep")
        bound = needed_in + ([spec.position_ids] if self._use_position_ids else [])
        if len(set(bound)) < len(bound) or len(set(needed_out)) < len(needed_out):
            raise PackageError(f"the package description gives two of {name}'s inputs or outputs the same name")
        unbound = sorted(set(inputs) - set(bound))
        if unbound:
            raise PackageError(f"{name} has inputs the package description does not name: {', '.join(unbound[:3])}")
        # fixed axes must agree with the JSON: caches (B, n_head, T, head_dim), logits (B, T, vocab)
        agrees = lambda dim, expected: not isinstance(dim, int) or dim == expected  # a symbolic axis always does
        for n in needed_in[2:] + needed_out[1:]:
            shape = inputs[n].shape if n in inputs else outputs[n].shape
            if len(shape) != 4 or not (agrees(shape[1], spec.n_head) and agrees(shape[3], spec.head_dim)):
                raise PackageError(
                    f"{n} in {name} has shape {shape}; the package says (batch, {spec.n_head}, length, {spec.head_dim})"
                )
        shape = outputs[spec.logits].shape
        if len(shape) != 3 or not agrees(shape[2], spec.vocab_size):
            raise PackageError(
                f"{spec.logits} in {name} has shape {shape}; the package says (batch, length, {spec.vocab_size})"
            )
        self._logits_dtype = _KV_DTYPES.get(outputs[spec.logits].type)
        if self._logits_dtype is None:
            raise PackageError(f"unsupported logits type {outputs[spec.logits].type}")
        self._kv_dtype = _KV_DTYPES.get(inputs[self._past_names[0][0]].type)
        if self._kv_dtype is None:
            raise PackageError(f"unsupported KV-cache type {inputs[self._past_names[0][0]].type}")
        if self.tokenizer is not None and self.tokenizer.vocab_size > spec.vocab_size:
            raise PackageError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model only {spec.vocab_size}"
            )

    @property
    def context_length(self) -> int:
        return self.spec.context_length

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def info(self) -> dict:
        s = self.spec
        files = s.manifest.get("files")  # unchecked when loaded with verify=False: any JSON at all
        sizes = [f.get("bytes") for f in files.values() if isinstance(f, dict)] if isinstance(files, dict) else []
        sizes = [n for n in sizes if isinstance(n, int) and not isinstance(n, bool)]
        return {
            "package": str(s.folder),
            "kind": s.kind,
            "verified": s.verified,  # False when loaded with verify=False: no sha256 was checked
            "architecture": "gpt2",
            "layers": s.n_layer,
            "heads": s.n_head,
            "head_dim": s.head_dim,
            "vocab_size": s.vocab_size,
            "context_length": s.context_length,
            "precision": s.precision,
            "kv_cache": s.kv_cache,  # "shared_buffer": the fused graph; "concat": standard ops
            "recipe": s.manifest.get("recipe"),
            "eos_token_ids": s.eos_token_ids,
            "bos_token_id": s.bos_token_id,
            "tokenizer": s.tokenizer_path.name if s.tokenizer_path else None,
            "provider": self.session.get_providers()[0],
            "size_bytes": sum(sizes) if sizes else s.model_path.stat().st_size,
            "parity": s.manifest.get("parity"),
            "evaluation": s.manifest.get("evaluation"),
        }

    # ---- input handling ------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text or token ids -> validated token ids (an empty prompt becomes [BOS] when there is one)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError("this package has no tokenizer.json: pass token ids instead of text")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad UTF-16 decode
                raise InvalidInputError(f"the prompt is not valid Unicode text: {e.reason} at {e.start}") from None
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
                raise InvalidInputError(f"a token-id array must be one-dimensional, got shape {prompt.shape}")
            ids = list(prompt)
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                    raise InvalidInputError(f"token ids must be integers, got {i!r}")
                if not 0 <= i < self.spec.vocab_size:
                    raise InvalidInputError(f"token id {i} is outside the vocabulary [0, {self.spec.vocab_size})")
            ids = [int(i) for i in ids]
        else:
            raise InvalidInputError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            if self.spec.bos_token_id is None:
                raise InvalidInputError("the prompt is empty and the package has no BOS token to start from")
            ids = [self.spec.bos_token_id]
        return ids

    def _fit_context(self, ids: list[int], max_new_tokens: int, truncate_prompt: bool) -> list[int]:
        limit = self.spec.context_length
        if len(ids) + max_new_tokens <= limit:
            return ids
        if not truncate_prompt:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} "
                f"exceeds the context length {limit}; shorten the prompt, lower max_new_tokens, "
                "or pass truncate_prompt=True to drop the oldest prompt tokens"
            )
        if max_new_tokens >= limit:
            raise ContextLengthError(f"max_new_tokens ({max_new_tokens}) must be below the context length {limit}")
        return ids[len(ids) + max_new_tokens - limit :]

    # ---- the decode loop -----------------------------------------------------------------------

    def _run(self, binding) -> None:
        try:
            self.session.run_with_iobinding(binding)
        except Exception as e:  # onnxruntime's pybind types; inputs were validated, so the package is at fault
            raise PackageError(
                f"ONNX Runtime failed running {self.spec.model_path.name}: {_ort_reason(e)} (does the package's "
                "JSON match its model, e.g. context length or vocabulary size?)"
            ) from None

    def _decode(
        self,
        prompts: list[list[int]],
        state: _DecodeState,
        *,
        max_new_tokens: int,
        params: SamplingParams,
        seed: int | None,
        cancel: threading.Event | None,
        ignore_eos: bool = False,
    ) -> Iterator[tuple[int, int]]:
        """Batched decoding, prompts padded as the package's cache wants (_ConcatCache, _SharedCache):
        yields (row, token id) for every new token of an unfinished row. state.finish[row] records why
        a row ended; the consumer may end a row itself (a stop string) by setting it."""
        batch = len(prompts)
        check_generation_memory(self.spec, list(map(len, prompts)), new_tokens=max_new_tokens, kv_dtype=self._kv_dtype)
        if self.spec.kv_cache == "shared_buffer":
            cache = _SharedCache(self, prompts, capacity=max(len(p) for p in prompts) + max_new_tokens)
        else:
            cache = _ConcatCache(self, prompts)
        rngs = [np.random.default_rng(None if seed is None else seed + row) for row in range(batch)]
        penalize = params.repetition_penalty != 1.0
        seen = [np.array(p, dtype=np.int64) for p in prompts]
        eos = set() if ignore_eos else set(self.spec.eos_token_ids)
        finish = state.finish
        next_ids = np.empty((batch, 1), dtype=np.int64)
        for step in range(max_new_tokens):
            if cancel is not None and cancel.is_set():
                for row in range(batch):
                    finish[row] = finish[row] or "cancelled"
                break
            logits = cache.prompt() if step == 0 else cache.next(next_ids)  # (B, V): each row's newest position
            live = [row for row in range(batch) if not finish[row]]
            if not np.isfinite(logits[live] if batch > 1 else logits).all():
                raise PackageError("the model produced non-finite logits (a broken or badly quantized package)")
            next_ids.fill(self.spec.pad_token_id)  # rows that have ended feed padding
            for row in live:
                token = sample(logits[row], params, rngs[row], seen[row] if penalize else None)
                if step == 0 and not state.first_token_time:
                    state.first_token_time = time.perf_counter()
                if token in eos:
                    finish[row] = "eos"
                    continue
                next_ids[row, 0] = token
                if penalize:
                    seen[row] = np.append(seen[row], token)
                yield row, token
            if all(finish):
                break
        for row in range(batch):
            finish[row] = finish[row] or "length"

    def _prepare(
        self,
        prompt,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        seed,
        stop,
        truncate_prompt,
        cancel=None,
    ):
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty
        )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise InvalidParameterError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InvalidParameterError(f"seed must be a non-negative integer or None, got {seed!r}")
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            raise InvalidParameterError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidParameterError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if stops and self.tokenizer is None:
            raise InvalidParameterError("stop strings need a tokenizer, and this package has none")
        if cancel is not None and not callable(getattr(cancel, "is_set", None)):
            raise InvalidParameterError(f"cancel must be a threading.Event or None, got {cancel!r}")
        prompts = [self._fit_context(self.encode(p), int(max_new_tokens), truncate_prompt) for p in prompt]
        return params, stops, prompts

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        cancel: threading.Event | None = None,
        truncate_prompt: bool = False,
        ignore_eos: bool = False,
    ) -> list[GenerationResult]:
        """Generate for several prompts at once (padding + attention mask). Row r samples with
        seed + r; greedy output equals running each prompt alone, except with dynamic/static int8
        packages, whose activation scale spans the batch (README, "Batches"). ignore_eos keeps
        generating past EOS (for benchmarks)."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise InvalidInputError("prompts must be a non-empty list of strings or token-id lists")
        started = time.perf_counter()
        params, stops, encoded = self._prepare(
            prompts,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            seed,
            stop,
            truncate_prompt,
            cancel,
        )
        assemblers = [TextAssembler(self.tokenizer, stops) if self.tokenizer else None for _ in encoded]
        generated: list[list[int]] = [[] for _ in encoded]
        state = _DecodeState(finish=[""] * len(encoded))
        for row, token in self._decode(
            encoded,
            state,
            max_new_tokens=int(max_new_tokens),
            params=params,
            seed=seed,
            cancel=cancel,
            ignore_eos=ignore_eos,
        ):
            generated[row].append(token)
            if assemblers[row] is not None:
                assemblers[row].add(token)
                if assemblers[row].stopped:
                    state.finish[row] = "stop"
        ended = time.perf_counter()
        return [
            GenerationResult(
                assemblers[row].text if assemblers[row] is not None else "",
                generated[row],
                state.finish[row],
                ids,
                _timings(started, state.first_token_time, ended, len(ids), len(generated[row])),
            )
            for row, ids in enumerate(encoded)
        ]

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **kwargs) -> GenerationResult:
        """Generate from one prompt (text or token ids). Keyword arguments as generate_batch:
        temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty, seed, stop, cancel,
        truncate_prompt, ignore_eos. Returns text, token ids, finish reason and timings."""
        return self.generate_batch([prompt], max_new_tokens, **kwargs)[0]

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **kwargs) -> Stream:
        """Like generate, but returns a Stream: iterate it for text pieces as they are generated
        (never half a character, never part of a stop string); its .result is set at the end.
        Parameters are validated here, before the first piece is asked for."""
        started = time.perf_counter()
        defaults = dict(  # in _prepare's order
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
            seed=None,
            stop=None,
            truncate_prompt=False,
            cancel=None,
        )
        ignore_eos = bool(kwargs.pop("ignore_eos", False))
        unknown = set(kwargs) - set(defaults)
        if unknown:
            raise TypeError(f"stream() got unexpected keyword argument(s) {', '.join(sorted(unknown))}")
        values = {**defaults, **kwargs}
        params, stops, (ids,) = self._prepare([prompt], max_new_tokens, *values.values())
        if self.tokenizer is None:
            raise InvalidInputError("streaming text needs a tokenizer, and this package has none")
        stream: Stream

        def pieces() -> Iterator[str]:
            # a generator: the model call for token n+1 runs only after the consumer took the piece
            # of token n, so a slow consumer slows generation and nothing piles up
            assembler = TextAssembler(self.tokenizer, stops)
            state = _DecodeState(finish=[""])
            for _, token in self._decode(
                [ids],
                state,
                max_new_tokens=int(max_new_tokens),
                params=params,
                seed=values["seed"],
                cancel=values["cancel"],
                ignore_eos=ignore_eos,
            ):
                piece = assembler.add(token)
                if piece:
                    yield piece
                if assembler.stopped:
                    state.finish[0] = "stop"
            tail = assembler.flush()
            if tail:
                yield tail
            stream.result = GenerationResult(
                assembler.text,
                list(assembler.ids),
                state.finish[0],
                ids,
                _timings(started, state.first_token_time, time.perf_counter(), len(ids), len(assembler.ids)),
            )

        stream = Stream(pieces())
        return stream


class _ConcatCache:
    """The standard graph's cache: past keys/values go in, past + new come out as new OrtValues, bound
    as the next step's past (never copied through numpy; with CUDA they stay on the device). Left
    padding, so every row's newest token is the last position."""

    def __init__(self, model: Model, prompts: list[list[int]]):
        spec = model.spec
        self.model, self.spec = model, spec
        batch, width = len(prompts), max(len(p) for p in prompts)
        self.input_ids = np.full((batch, width), spec.pad_token_id, dtype=np.int64)
        self.attention_mask = np.zeros((batch, width), dtype=np.int64)
        for row, ids in enumerate(prompts):
            self.input_ids[row, width - len(ids) :] = ids
            self.attention_mask[row, width - len(ids) :] = 1
        empty = np.zeros((batch, spec.n_head, 0, spec.head_dim), dtype=model._kv_dtype)
        self.past = [ort.OrtValue.ortvalue_from_numpy(empty, model.device) for _ in range(2 * spec.n_layer)]
        self.binding = model.session.io_binding()

    def prompt(self) -> np.ndarray:
        return self._step(self.input_ids)

    def next(self, next_ids: np.ndarray) -> np.ndarray:
        self.attention_mask = np.concatenate([self.attention_mask, np.ones((len(next_ids), 1), np.int64)], axis=1)
        return self._step(next_ids)

    def _step(self, input_ids: np.ndarray) -> np.ndarray:
        spec, binding, device = self.spec, self.binding, self.model.device
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(spec.input_ids, input_ids)
        binding.bind_cpu_input(spec.attention_mask, self.attention_mask)
        if self.model._use_position_ids:
            # positions count real tokens only, so a left-padded row starts at 0 like an unpadded one
            positions = np.cumsum(self.attention_mask, axis=1)[:, -input_ids.shape[1] :] - 1
            binding.bind_cpu_input(spec.position_ids, np.maximum(positions, 0).astype(np.int64))
        for (key_name, value_name), i in zip(self.model._past_names, range(0, len(self.past), 2), strict=True):
            binding.bind_ortvalue_input(key_name, self.past[i])
            binding.bind_ortvalue_input(value_name, self.past[i + 1])
        binding.bind_output(spec.logits, "cpu")
        for key_name, value_name in self.model._present_names:
            binding.bind_output(key_name, device)
            binding.bind_output(value_name, device)
        self.model._run(binding)
        outputs = binding.get_outputs()
        self.past = outputs[1:]
        return outputs[0].numpy()[:, -1, :]


class _SharedCache:
    """The fused graph's cache: one (B, n_head, capacity, head_dim) buffer per cache tensor, bound once
    as both past and present; the graph writes each row's new keys/values at that row's length, in
    place, so a step copies no cache. Right padding: row b's tokens are positions 0 .. length_b - 1,
    and attention_mask row b is length_b ones (then zeros: in decode steps the mask is as wide as the
    buffer). Decode steps bind nothing: their token, position, mask and logits arrays are bound once
    and rewritten in place."""

    def __init__(self, model: Model, prompts: list[list[int]], *, capacity: int):
        spec = model.spec
        self.model, self.spec = model, spec
        batch, width = len(prompts), max(len(p) for p in prompts)
        self.lengths = np.array([len(p) for p in prompts], dtype=np.int64)  # tokens in the cache after a step
        self.rows = np.arange(batch)
        self.input_ids = np.full((batch, width), spec.pad_token_id, dtype=np.int64)
        for row, ids in enumerate(prompts):
            self.input_ids[row, : len(ids)] = ids
        binding = self.binding = model.session.io_binding()
        binding.bind_output(spec.logits, "cpu")  # bound first: the prompt's logits are get_outputs()[0]
        shape = (batch, spec.n_head, capacity, spec.head_dim)
        self.buffers = []
        past = [name for pair in model._past_names for name in pair]
        present = [name for pair in model._present_names for name in pair]
        for past_name, present_name in zip(past, present, strict=True):
            self.buffers.append(ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, model._kv_dtype), model.device))
            binding.bind_ortvalue_input(past_name, self.buffers[-1])
            binding.bind_ortvalue_output(present_name, self.buffers[-1])
        self.keep = {}
        if spec.logits_to_keep:  # an overridable initializer: bound as an OrtValue
            self.keep = {k: ort.OrtValue.ortvalue_from_numpy(np.array(k, dtype=np.int64)) for k in (0, 1)}
        self.mask = (np.arange(capacity)[None, :] < self.lengths[:, None]).astype(np.int64)  # (B, capacity)
        # decode steps: mask, token, position and logits arrays bound once (as OrtValues sharing their
        # memory) and rewritten in place
        self.step_ids = np.zeros((batch, 1), dtype=np.int64)
        self.step_positions = np.zeros((batch, 1), dtype=np.int64)
        self.logits = np.empty((batch, 1, spec.vocab_size), dtype=model._logits_dtype)
        self._decode_bound = False

    def prompt(self) -> np.ndarray:
        batch, width = self.input_ids.shape
        mask = np.ascontiguousarray(self.mask[:, :width])
        uniform = bool(np.all(self.lengths == width))  # then only the last position needs logits
        binding, spec = self.binding, self.spec
        binding.bind_cpu_input(spec.input_ids, self.input_ids)
        binding.bind_cpu_input(spec.attention_mask, mask)
        if self.model._use_position_ids:
            binding.bind_cpu_input(spec.position_ids, np.arange(width)[None, :] * mask)
        if self.keep:
            binding.bind_ortvalue_input(spec.logits_to_keep, self.keep[1 if uniform else 0])
        self.model._run(binding)
        logits = binding.get_outputs()[0].numpy()  # (B, width or 1, V)
        if uniform:
            return logits[:, -1, :]
        return logits[np.arange(batch), self.lengths - 1]  # each row's last real position

    def next(self, next_ids: np.ndarray) -> np.ndarray:
        binding, spec = self.binding, self.spec
        if not self._decode_bound:
            # the mask keeps the buffer's width: every decode step then has the same input shapes,
            # so ONNX Runtime reuses its memory plan instead of making one per step
            binding.bind_ortvalue_input(spec.attention_mask, ort.OrtValue.ortvalue_from_numpy(self.mask))
            binding.bind_ortvalue_input(spec.input_ids, ort.OrtValue.ortvalue_from_numpy(self.step_ids))
            if self.model._use_position_ids:
                binding.bind_ortvalue_input(spec.position_ids, ort.OrtValue.ortvalue_from_numpy(self.step_positions))
            if self.keep:
                binding.bind_ortvalue_input(spec.logits_to_keep, self.keep[1])
            binding.bind_ortvalue_output(spec.logits, ort.OrtValue.ortvalue_from_numpy(self.logits))
            self._decode_bound = True
        self.step_ids[:] = next_ids
        self.step_positions[:, 0] = self.lengths  # the new token's position is the row's current length
        self.mask[self.rows, self.lengths] = 1
        self.lengths += 1
        self.model._run(binding)
        return self.logits[:, -1, :]


@dataclass
class _DecodeState:
    finish: list[str]  # per row: "" while running, then "eos", "stop", "length" or "cancelled"
    first_token_time: float = 0.0


def _timings(started: float, first: float, ended: float, prompt_tokens: int, new_tokens: int) -> Timings:
    ttft = (first - started) if first else 0.0
    decode_time = ended - first if first else 0.0
    rate = (new_tokens - 1) / decode_time if new_tokens > 1 and decode_time > 0 else 0.0
    return Timings(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        time_to_first_token_s=ttft,
        decode_tokens_per_s=rate,
        total_s=ended - started,
    )
