"""Load a model package and generate from it: onnxruntime + numpy + tokenizers, nothing else (chat adds jinja2,
imported by chat() and conversation() when first used).

    model = load("models/shakespeare-onnx")
    result = model.generate("ROMEO:", max_new_tokens=64, temperature=0.8, top_k=40, seed=0)
    for piece in model.stream("JULIET:", max_new_tokens=64):
        print(piece, end="", flush=True)

`Model` keeps loading, the package's facts, input validation and the public API; the decode loop it
drives (feed the prompt, then sample, append, feed one token, until EOS, a stop string, the token
budget or a cancellation) is runtime/decode.py, shared with chat.py's Conversation, and the KV cache
it steps is runtime/kvcache.py. Model is the runner both need (runtime/runner.py).

One loaded Model may be shared by threads: ONNX Runtime sessions run concurrently, and every call
keeps its own cache, binding and random generator.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .adapters import AdapterMixin
from .decode import DecodeState, GenerationOptions, decode, decode_texts, generation_options, text_pieces
from .errors import ContextLengthError, InvalidInputError, InvalidParameterError, PackageError, ProviderError
from .kvcache import plain_feed
from .onnx_external import external_data_locations
from .package import PackageSpec, read_package
from .packed import kernel_path
from .results import GenerationResult, Stream, Timings, make_timings
from .session import PROVIDERS, check_io, check_threads, open_session, ort_reason, resolve_providers
from .text import TextAssembler, Tokenizer

if TYPE_CHECKING:
    from .chat import Conversation
    from .runner import Runner

__all__ = ["GenerationResult", "Model", "Stream", "Timings", "load", "resolve_providers"]


def load(path: str | Path, provider: str = "auto", threads: int | None = None, *, verify: bool = True) -> Model:
    """Load a package folder. provider: "cpu", "cuda" or "auto" (CUDA when available, else CPU);
    threads: intra-op threads (None = ONNX Runtime's default, one per physical core);
    verify: check every file against the manifest's sha256 first."""
    return Model(path, provider=provider, threads=threads, verify=verify)


def package_tokenizer(spec: PackageSpec) -> Tokenizer | None:
    """The package's tokenizer (None: it has none); PackageError when it names ids the model does not have.
    Export calls it on what it wrote before it reports success."""
    if spec.tokenizer_path is None:
        return None
    tokenizer = Tokenizer(spec.tokenizer_path)
    if tokenizer.vocab_size > spec.arch.vocab_size:
        raise PackageError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {spec.arch.vocab_size}")
    return tokenizer


def model_bytes(model_path: Path) -> int:
    """The model file's size plus each external-data file it names (the weights, model.onnx.data), counted once."""
    folder = model_path.parent
    files = {model_path.resolve(), *((folder / location).resolve() for location in external_data_locations(model_path))}
    return sum(path.stat().st_size for path in files)


class Model(AdapterMixin):
    def __init__(self, path: str | Path, *, provider: str = "auto", threads: int | None = None, verify: bool = True):
        check_threads(threads)
        started = time.perf_counter()
        providers = resolve_providers(provider)
        # the model file's sha256 is computed while ONNX Runtime builds the session (it releases the GIL);
        # nothing runs on the session before the hash matched, and a mismatch wins over a build error
        self.spec: PackageSpec = read_package(path, verify=verify, background_hashes=True)
        try:
            self.tokenizer = package_tokenizer(self.spec)
            self.session = open_session(self.spec.model_path, providers, threads)
        finally:
            self.spec.finish_verification()
        if provider == "cuda" and PROVIDERS["cuda"] not in self.session.get_providers():
            raise ProviderError("the CUDA provider is installed but failed to start (check the CUDA/cuDNN libraries)")
        self.device = "cuda" if PROVIDERS["cuda"] in self.session.get_providers() else "cpu"
        facts = check_io(self.spec, self.session)
        self.uses_position_ids, self.kv_dtype, self.logits_dtype = (
            facts.uses_position_ids,
            facts.kv_dtype,
            facts.logits_dtype,
        )
        self._init_adapters()  # LoRA slots and the adapters loaded for them (runtime/adapters.py)
        self.threads, self._drafts = threads, {}
        self.load_s = time.perf_counter() - started  # from the call to a model ready to generate

    # ---- package facts -------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.spec.arch.context_length

    @property
    def vocab_size(self) -> int:
        return self.spec.arch.vocab_size

    def info(self) -> dict:
        s = self.spec
        manifest = s.manifest
        # file sizes are unchecked when loaded with verify=False: any JSON at all
        sizes = [f.get("bytes") for f in manifest.files.values() if isinstance(f, dict)] if manifest else []
        sizes = [n for n in sizes if isinstance(n, int) and not isinstance(n, bool)]
        return {
            "package": str(s.folder),
            "kind": s.kind,
            "verified": s.verified,  # False when loaded with verify=False: no sha256 was checked
            "architecture": s.arch.type,
            "layers": s.arch.n_layer,
            "heads": s.arch.n_head,
            "kv_heads": s.arch.n_kv_head,
            "head_dim": s.arch.head_dim,
            "vocab_size": s.arch.vocab_size,
            "context_length": s.arch.context_length,
            "precision": s.precision,
            "kv_cache": s.io.kv_cache,  # "shared_buffer": the fused graph; "concat": standard ops
            "recipe": manifest.recipe if manifest else None,
            "eos_token_ids": s.tokens.eos_token_ids,
            "bos_token_id": s.tokens.bos_token_id,
            "tokenizer": s.tokenizer_path.name if s.tokenizer_path else None,
            "chat_template": s.chat_template_path is not None,
            "provider": self.session.get_providers()[0],
            "kernels": kernels.to_json() if (kernels := kernel_path(self.session)) else None,  # GGUF blocks as stored
            "size_bytes": sum(sizes) if sizes else model_bytes(s.model_path),
            "parity": manifest.parity if manifest else None,
            "evaluation": manifest.evaluation if manifest else None,
            "lora_slots": self.lora_slots.to_json() if self.lora_slots else None,
            "adapters": [self._adapters[name].info() for name in self.adapters],
        }

    def forward(
        self, input_ids: np.ndarray, past: list | None = None, *, adapter: str | None = None
    ) -> tuple[np.ndarray, list]:
        """One plain run, for evaluation and calibration: input_ids (B, T) after `past` (the present
        list of the previous call, or None for an empty cache). Returns logits (B, T, V) for every
        position (the graph's default) and the present keys/values. adapter: a loaded LoRA adapter's name."""
        arch = self.spec.arch
        names = [self.spec.io.logits, *arch.present_names(self.spec.io)]
        feed = plain_feed(self, input_ids, past) | ({} if adapter is None else self._adapter(adapter).arrays)
        try:
            outputs = self.session.run(names, feed)
        except Exception as e:  # onnxruntime's pybind types
            raise PackageError(f"ONNX Runtime failed running {self.spec.model_path.name}: {ort_reason(e)}") from None
        return outputs[0], outputs[1:]

    def load_draft(self, path: str | Path) -> Model:
        """A draft package for speculative decoding (runtime/speculative.py), loaded once per folder with this
        model's provider and threads."""
        key = str(Path(path).resolve())
        if key not in self._drafts:
            self._drafts[key] = Model(path, provider=self.device, threads=self.threads)
        return self._drafts[key]

    # ---- chat (runtime/chat.py) ----------------------------------------------------------------

    def chat(
        self, messages: list[dict], max_new_tokens: int = 256, *, template=None, adapter=None, **options
    ) -> GenerationResult:
        """The assistant's reply to messages ([{"role": ..., "content": ...}]), rendered with the package's chat
        template (or `template`, Jinja source). Options as generate's, and tools, documents, enable_thinking,
        template_vars, tool_choice (docs/apps.md); ContextLengthError when they do not fit. The result's content,
        reasoning and tool_calls are the reply parsed by the template's convention (runtime/tool_calls.py)."""
        return self.chat_stream(messages, max_new_tokens, template=template, adapter=adapter, **options).finish()

    def chat_stream(
        self, messages: list[dict], max_new_tokens: int = 256, *, template=None, adapter=None, **options
    ) -> Stream:
        """chat as a Stream of pieces (each a str, with .content, .reasoning and .tool_calls); .result at the end."""
        from .chat import Conversation  # the chat template machinery (jinja2) is imported when chat is first used

        conversation = Conversation(self, template=template, adapter=adapter)
        return conversation.stream_reply(messages, max_new_tokens=max_new_tokens, **options)

    def conversation(
        self,
        system: str | None = None,
        *,
        template=None,
        adapter=None,
        tools=None,
        documents=None,
        enable_thinking=None,
        template_vars=None,
    ) -> Conversation:
        """A multi-turn chat that keeps its KV cache between turns: .send(message), .stream(message), .undo(),
        .reset(). adapter: a loaded LoRA adapter's name; send/stream(..., adapter=) switches it (and re-prefills).
        tools, documents, enable_thinking, template_vars: the template variables of every turn (docs/apps.md)."""
        from .chat import Conversation  # jinja2 is imported when chat is first used

        return Conversation(
            self,
            system=system,
            template=template,
            adapter=adapter,
            tools=tools,
            documents=documents,
            enable_thinking=enable_thinking,
            template_vars=template_vars,
        )

    # ---- input handling ------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        """Text or token ids -> validated token ids (an empty prompt becomes [BOS] when there is one). Text gets
        the special tokens the tokenizer adds (BOS where its add_bos_token says so: docs/tokenization.md) unless
        add_special_tokens is False; token ids are taken as they are."""
        if not isinstance(add_special_tokens, bool):
            raise InvalidParameterError(f"add_special_tokens must be True or False, got {add_special_tokens!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError("this package has no tokenizer.json: pass token ids instead of text")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad UTF-16 decode
                raise InvalidInputError(f"the prompt is not valid Unicode text: {e.reason} at {e.start}") from None
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
                raise InvalidInputError(f"a token-id array must be one-dimensional, got shape {prompt.shape}")
            ids = list(prompt)
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                    raise InvalidInputError(f"token ids must be integers, got {i!r}")
                if not 0 <= i < self.spec.arch.vocab_size:
                    raise InvalidInputError(f"token id {i} is outside the vocabulary [0, {self.spec.arch.vocab_size})")
            ids = [int(i) for i in ids]
        else:
            raise InvalidInputError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            if self.spec.tokens.bos_token_id is None:
                raise InvalidInputError("the prompt is empty and the package has no BOS token to start from")
            ids = [self.spec.tokens.bos_token_id]
        return ids

    def _fit_context(self, ids: list[int], options: GenerationOptions) -> list[int]:
        """ids, or their newest part with options.truncate_prompt, so that they and max_new_tokens fit the context."""
        limit, max_new_tokens = self.spec.arch.context_length, options.max_new_tokens
        if len(ids) + max_new_tokens <= limit:
            return ids
        if not options.truncate_prompt:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} "
                f"exceeds the context length {limit}; shorten the prompt, lower max_new_tokens, "
                "or pass truncate_prompt=True to drop the oldest prompt tokens"
            )
        if max_new_tokens >= limit:
            raise ContextLengthError(f"max_new_tokens ({max_new_tokens}) must be below the context length {limit}")
        return ids[len(ids) + max_new_tokens - limit :]

    # ---- generation (the loop itself: runtime/decode.py) ----------------------------------------

    def run(self, binding) -> None:
        """Run the session on an IO binding (the KV-cache drivers' one way in: runtime/runner.py)."""
        try:
            self.session.run_with_iobinding(binding)
        except Exception as e:  # onnxruntime's pybind types; inputs were validated, so the package is at fault
            raise PackageError(
                f"ONNX Runtime failed running {self.spec.model_path.name}: {ort_reason(e)} (does the package's "
                "JSON match its model, e.g. context length or vocabulary size?)"
            ) from None

    def options(self, max_new_tokens: int = 64, **options: Any) -> GenerationOptions:
        """Validate generation options once (TypeError for an unknown name, InvalidParameterError for a bad value)."""
        return generation_options(max_new_tokens, options, tokenizer=self.tokenizer, runner=self)

    def _prepare(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: Any, options: dict, *, caller: str, batch: bool
    ) -> tuple[Runner, list[list[int]], GenerationOptions]:
        """Everything a generation is given, checked once and before anything runs: the adapter's runner, the
        options (runtime/decode.py generation_options; a batch may give a constraint per row) and each prompt
        encoded and fitted to the context with them."""
        runner = self.runner(options.pop("adapter", None))
        add_special_tokens = options.pop("add_special_tokens", True)
        checked = generation_options(
            max_new_tokens, options, tokenizer=self.tokenizer, caller=caller, runner=self,
            rows=len(prompts) if batch else None,
        )  # fmt: skip
        encoded = [self._fit_context(self.encode(p, add_special_tokens=add_special_tokens), checked) for p in prompts]
        return runner, encoded, checked

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64, **options: Any
    ) -> list[GenerationResult]:
        """Generate for several prompts at once (padding + attention mask). Options (runtime/decode.py's
        GenerationOptions): temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty, seed, stop, cancel,
        truncate_prompt, ignore_eos (keep generating past EOS, for benchmarks), speculative ("lookup", a draft
        package or Model: runtime/speculative.py; a batch of several prompts decodes plainly). Row r samples with
        seed + r; greedy output equals running each prompt alone, except with dynamic/static int8 packages, whose
        activation scale spans the batch (README, "Batches"). adapter: a loaded LoRA adapter's name, None = base.
        add_special_tokens: False tokenizes text prompts without the BOS the tokenizer adds (docs/tokenization.md)."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise InvalidInputError("prompts must be a non-empty list of strings or token-id lists")
        started = time.perf_counter()
        caller = "generate_batch()"
        runner, encoded, checked = self._prepare(prompts, max_new_tokens, options, caller=caller, batch=True)
        state = DecodeState.start(len(encoded))
        generated, texts = decode_texts(runner, encoded, state, checked, self.tokenizer)
        ended = time.perf_counter()
        return [
            GenerationResult(
                texts[row],
                generated[row],
                state.finish[row],
                ids,
                make_timings(started, state.first_token_time, ended, len(ids), len(generated[row]), state=state),
            )
            for row, ids in enumerate(encoded)
        ]

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **options: Any) -> GenerationResult:
        """Generate from one prompt (text or token ids). Options as generate_batch's. Returns text, token ids,
        finish reason and timings."""
        return self.generate_batch([prompt], max_new_tokens, **options)[0]

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **options: Any) -> Stream:
        """Like generate, but returns a Stream: iterate it for text pieces as they are generated
        (never half a character, never part of a stop string); its .result is set at the end.
        Options are validated here, before the first piece is asked for."""
        started = time.perf_counter()
        runner, (ids,), checked = self._prepare([prompt], max_new_tokens, options, caller="stream()", batch=False)
        if self.tokenizer is None:
            raise InvalidInputError("streaming text needs a tokenizer, and this package has none")
        stream: Stream

        def pieces() -> Iterator[str]:
            # a generator: the model call for token n+1 runs only after the consumer took the piece
            # of token n, so a slow consumer slows generation and nothing piles up
            assembler = TextAssembler(self.tokenizer, checked.stops)
            state = DecodeState.start(1)
            yield from text_pieces(decode(runner, [ids], state, checked), assembler, state)
            tail = assembler.flush()
            if tail:
                yield tail
            new = len(assembler.ids)
            timings = make_timings(started, state.first_token_time, time.perf_counter(), len(ids), new, state=state)
            stream.result = GenerationResult(assembler.text, list(assembler.ids), state.finish[0], ids, timings)

        stream = Stream(pieces())
        return stream
