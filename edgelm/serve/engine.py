"""The server's side of the Python API: one loaded Model, its names, worker slots, and the prompt cache.

Policy (docs/serve.md, "Policies"):

- Worker slots: `parallel` requests generate at once, each on a thread of its own (ONNX Runtime sessions run
  concurrently; every generation keeps its own cache). Up to `queue` more wait for a slot in arrival order;
  a request beyond those is answered 503 at once (OpenAI's error object, `Retry-After: 1`).
- Cancellation: every request carries a threading.Event the runtime checks at each decode step (`cancel=`);
  the HTTP side sets it when the client goes away, so a slot is freed within one step, and a request that
  was still waiting never starts.
- Prompt cache: chat requests run in Conversations (runtime/chat.py) that keep their KV cache. Up to
  `prompt_cache` idle ones are kept, least recently used dropped first; a request takes the one whose cached
  ids share the longest prefix with its rendered prompt (same adapter), and the Conversation feeds only the
  rest (rewinding the cache to the common prefix). No match: a fresh Conversation. One request at a time
  uses a Conversation; the ids it reused are reported as usage.prompt_tokens_details.cached_tokens.
- Shutdown: stop() (edgelm/serve/server.py calls it when the grace period ends) sets every accepted request's
  cancel event; each then ends within one decode step with a 503 `server_shutting_down` error (a stream's last
  event), so streams end as streams do rather than by a dropped connection. Requests submitted after it: 503.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from edgelm.runtime import Conversation, EdgelmError, GenerationResult, Model

from .errors import APIError

Emit = Callable[[tuple[str, Any]], None]  # ("start", None), ("piece", text), ("end", (result, cached)), ("error", e)


class PromptCache:
    """Idle Conversations kept for the prefix their KV caches hold; see the module docstring."""

    def __init__(self, model: Model, size: int, template: str | None = None):
        self.model, self.size, self.template = model, size, template
        self._idle: list[Conversation] = []  # least recently used first
        self._lock = threading.Lock()

    def take(self, adapter: str | None, ids: list[int]) -> tuple[Conversation, int]:
        """The idle Conversation sharing the longest prefix with ids (taken out of the cache), and that length;
        a new Conversation and 0 when none shares any."""
        with self._lock:
            best, best_length = None, 0
            for conversation in self._idle:
                if conversation.adapter == adapter:
                    length = conversation.shared_prefix(ids)
                    if length > best_length:
                        best, best_length = conversation, length
            if best is not None:
                self._idle.remove(best)
                return best, best_length
        return self.model.conversation(template=self.template, adapter=adapter), 0

    def give_back(self, conversation: Conversation) -> None:
        with self._lock:
            self._idle.append(conversation)
            del self._idle[: max(0, len(self._idle) - self.size)]

    def __len__(self) -> int:
        return len(self._idle)


def runtime_features(model: Model) -> set[str]:
    """What the runtime takes beyond plain generation, probed once from its public API: "tools" (tools,
    tool_choice and template variables on chat: docs/apps.md) and "structured" (response_format)."""
    features = set()
    if "tools" in inspect.signature(model.conversation).parameters:
        features.add("tools")
    try:
        model.options(1, response_format={"type": "text"})
        features.add("structured")
    except TypeError:  # an unknown option: this runtime has no structured output
        pass
    except EdgelmError:  # it knows the option (and says what it is missing when a request uses it)
        features.add("structured")
    return features


@dataclass
class Settings:
    parallel: int = 2  # requests generating at once
    queue: int = 16  # requests waiting for a slot at most; beyond: 503
    prompt_cache: int = 4  # idle conversations kept for their KV caches (0: none)
    max_tokens: int | None = None  # a chat reply's length when the request sets none (None: the rest of the context)
    chat_template: str | None = None  # Jinja source used instead of the package's chat template


class Engine:
    """The model and its names, the slots requests run in, and the jobs they run (on a worker thread each)."""

    def __init__(self, model: Model, *, name: str, settings: Settings | None = None):
        self.model, self.name = model, name
        self.settings = settings or Settings()
        self.executor = ThreadPoolExecutor(max_workers=self.settings.parallel, thread_name_prefix="edgelm-serve")
        self.cache = PromptCache(model, self.settings.prompt_cache, self.settings.chat_template)
        self.accepted = 0  # running or waiting; read and written on the event loop's thread only
        self.stopping = False  # set by stop(): cancelled generations end as server_shutting_down errors
        self._cancels: set[threading.Event] = set()  # accepted requests' cancel events (the event loop's thread)
        self.finished: collections.Counter[str] = collections.Counter()  # finish reasons, "error" included
        self._finished_lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._renderer: Conversation | None = None  # renders requests' messages to ids (its template)
        self.features = runtime_features(model)
        self.has_chat_template = self.settings.chat_template is not None or model.spec.chat_template_path is not None

    # ---- names ------------------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return [self.name, *self.model.adapters]

    def adapter_for(self, name: str) -> str | None:
        """The adapter a request's `model` selects (None: the base); APIError 404 for a name not served."""
        if name == self.name:
            return None
        if name in self.model.adapters:
            return name
        served = ", ".join(self.model_names())
        raise APIError(
            404, f"the model {name!r} does not exist (served: {served})", param="model", code="model_not_found"
        )

    # ---- slots ------------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return min(self.accepted, self.settings.parallel)

    @property
    def waiting(self) -> int:
        return max(0, self.accepted - self.settings.parallel)

    def submit(self, job: Callable[..., None], *, cancel: threading.Event) -> Callable[[], None]:
        """Run job(cancel=cancel) on a worker slot (called on the event loop); APIError 503 when every slot and
        place is taken, or the server is stopping. Returns the slot's release, for the caller to call (on the
        loop) as soon as the job has reported its end, so that a client's next request never finds its own
        finished one still counted; the job's thread ending releases it too."""
        if self.stopping:
            raise shutting_down()
        if self.accepted >= self.settings.parallel + self.settings.queue:
            raise APIError(
                503,
                f"the server is busy ({self.settings.parallel} requests running, {self.settings.queue} waiting); "
                "retry shortly",
                code="server_overloaded",
            )
        self.accepted += 1
        self._cancels.add(cancel)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.accepted -= 1
                self._cancels.discard(cancel)

        def done(future: asyncio.Future) -> None:
            release()
            if not future.cancelled():
                future.exception()  # jobs report through emit; this only marks it retrieved

        asyncio.wrap_future(self.executor.submit(job, cancel=cancel)).add_done_callback(done)
        return release

    def stop(self) -> None:
        """Cancel every accepted request (on the event loop): each ends within one decode step with a 503
        server_shutting_down error, and later submits are refused the same way."""
        self.stopping = True
        for cancel in list(self._cancels):
            cancel.set()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ---- jobs (on a worker thread) ------------------------------------------------------------------

    def chat_ids(self, messages: list[dict], options: dict) -> list[int]:
        """The request's prompt ids (its template variables among options: docs/apps.md), rendered once: they pick
        the kept conversation sharing most of them, and that conversation feeds them (stream_reply's prompt_ids)."""
        with self._render_lock:
            if self._renderer is None:
                # ChatTemplateError without a chat template
                self._renderer = self.model.conversation(template=self.settings.chat_template)
            return self._renderer.ids_of(messages, **options)

    def chat_job(
        self, messages: list[dict], *, adapter, max_tokens: int | None, options: dict, cancel, emit: Emit
    ) -> None:
        """Reply to messages in a cached Conversation; reports through emit (see Emit)."""
        if cancel.is_set():  # the client left while the request waited, or the server is stopping
            return self._cancelled(emit)
        try:
            ids = self.chat_ids(messages, options)
            room = self.model.context_length - len(ids)
            default = room if self.settings.max_tokens is None else min(room, self.settings.max_tokens)
            max_new = max(1, default) if max_tokens is None else max_tokens  # 1: the runtime says it does not fit
            conversation, _ = self.cache.take(adapter, ids)
        except Exception as error:
            return self._fail(emit, error)
        try:
            conversation.system = None  # the request's messages are the whole history, its system message included
            stream = conversation.stream_reply(messages, max_new, prompt_ids=ids, cancel=cancel, **options)
            self._stream(stream, emit, lambda: conversation.last_turn.reused_tokens)
        except Exception as error:
            self._fail(emit, error)
        finally:
            self.cache.give_back(conversation)

    def completion_job(
        self, prompt: str | list[int], *, adapter, max_tokens: int, options: dict, cancel, emit: Emit
    ) -> None:
        """Continue a prompt (Model.stream); reports through emit."""
        if cancel.is_set():
            return self._cancelled(emit)
        try:
            stream = self.model.stream(prompt, max_tokens, adapter=adapter, cancel=cancel, **options)
            self._stream(stream, emit, lambda: None)
        except Exception as error:
            self._fail(emit, error)

    def _stream(self, stream, emit: Emit, cached: Callable[[], int | None]) -> None:
        emit(("start", None))
        for piece in stream:
            emit(("piece", piece))
        result: GenerationResult = stream.result
        if result.finish_reason == "cancelled" and self.stopping:
            return self._fail(emit, shutting_down())
        self._end(emit, (result, cached()))

    def _cancelled(self, emit: Emit) -> None:
        """A request cancelled before it started: by its client (no answer: it is gone) or by stop()."""
        if self.stopping:
            return self._fail(emit, shutting_down())
        self._end(emit, None)

    def _count(self, reason: str) -> None:
        with self._finished_lock:
            self.finished[reason] += 1

    def _end(self, emit: Emit, outcome) -> None:
        self._count("cancelled" if outcome is None else outcome[0].finish_reason)
        emit(("end", outcome))

    def _fail(self, emit: Emit, error: Exception) -> None:
        self._count("error")
        emit(("error", error))


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another or later", code="server_shutting_down")
