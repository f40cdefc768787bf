"""Chat: the assistant's reply to messages, and conversations that keep their KV cache between turns.

    reply = model.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=128)
    conv = model.conversation(system="You answer in one sentence.")
    print(conv.send("What is ONNX?").text)
    for piece in conv.stream("And ONNX Runtime?"):
        print(piece, end="", flush=True)

Every turn renders the whole history with the chat template and the generation prompt (as transformers'
apply_chat_template(..., add_generation_prompt=True)), tokenizes that text (special-token text from the
messages as plain text: runtime/template/prompt_ids.py), and compares the ids with the ids whose keys/values the
conversation's cache holds (llama.cpp's prompt cache, genai's rewind):

- "prefix": the cached ids are a prefix of the new ones; only the rest is fed (the usual follow-up turn);
- "rewind": they differ somewhere (a template that rewrites earlier turns, a reply that tokenizes differently
  from how it was generated, a reply cut at a stop string): the cache rewinds to the longest common prefix;
- "full": nothing in common (the first turn).

So the model always sees exactly the ids of rendering the whole history; `last_turn` says which path a turn
took. After a turn the cache holds the prompt and the reply's ids that were fed; the end-of-turn id the model
sampled (any of the package's EOS ids) is not fed: the next turn's rendering brings it.

Context full: when the rendered history and max_new_tokens do not fit the context, the oldest exchanges
(never the system message) are dropped from the history, and `messages` no longer shows them; the rest is
fed again after the common prefix (usually the system prompt). A reply cancelled mid-stream (`cancel` set, or
the stream closed) is kept as the assistant's message, as far as it got, with finish_reason "cancelled":
the history shows what the user saw; `undo()` removes it. Bad messages (ChatTemplateError), options
(InvalidParameterError) or a message too long for the context (ContextLengthError) raise before anything
changes. A Conversation is used by one thread at a time; many may share one Model.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .chat_inputs import TURN_VARIABLES, new_messages, template_variables
from .decode import TURN_OPTIONS, DecodeState, GenerationOptions, decode, generation_options, with_text
from .errors import ChatTemplateError, ContextLengthError, InvalidInputError, InvalidParameterError
from .kvcache import Cache, make_cache
from .replies import Reply
from .results import GenerationResult, Piece, Stream, make_timings
from .template import ChatTemplate, chat_prompt_ids, read_template_file, validate_messages
from .text import TextAssembler
from .tool_calls import Convention, convention_for

if TYPE_CHECKING:
    from .runner import TextModel

DEFAULT_MAX_NEW_TOKENS = 256
MAX_CHARS_PER_TOKEN = 16  # a message longer than this many characters per context token is only counted so far


@dataclass
class TurnStats:
    """How one turn's prompt reached the model: how much of it the KV cache already held."""

    path: str  # "prefix", "rewind" or "full" (see the module docstring)
    prompt_tokens: int  # ids of the whole history rendered with the generation prompt
    reused_tokens: int  # of them, already in the cache from earlier turns
    prefilled_tokens: int  # fed in this turn's prompt pass: prompt_tokens - reused_tokens
    dropped_messages: int = 0  # oldest messages dropped from the history to fit the context
    adapter: str | None = None  # the LoRA adapter this turn ran with (None: the base model)
    adapter_switched: bool = False  # another adapter than the last turn's: the cache was dropped, all prefilled


@dataclass
class _Turn:
    """A turn checked and planned by Conversation._start, run by the stream's pieces."""

    history: list[dict]  # the history this turn answers (after dropping the oldest exchanges)
    ids: list[int]  # the history rendered and tokenized, with the generation prompt
    reused: int  # of ids, those already in the cache
    starts: list[int]  # the cache length each exchange's turn started from, this one's last
    options: GenerationOptions
    started: float  # time.perf_counter() when the turn was asked for
    variables: dict  # the template variables this turn rendered with (tools, documents, ...)
    parse_calls: bool  # tool_choice is not "none": tool calls are parsed out of the reply


def package_template(model: TextModel, template: ChatTemplate | str | None = None) -> ChatTemplate:
    """The chat template to use: `template` (compiled, or Jinja source) or else the package's own."""
    if isinstance(template, ChatTemplate):
        return template
    if template is None:
        path = model.spec.chat_template_path
        if path is None:
            raise ChatTemplateError(
                f"the package {model.spec.folder.name} has no chat template: pass template=<Jinja source>, "
                "or use generate() for plain completion"
            )
        template = read_template_file(path)
    if not isinstance(template, str):
        raise ChatTemplateError(f"template must be Jinja source text or a ChatTemplate, got {type(template).__name__}")
    tokens, name = model.spec.tokens, model.tokenizer.token_text
    bos = name(tokens.bos_token_id) if tokens.bos_token_id is not None else None
    return ChatTemplate(template, bos_token=bos, eos_token=name(tokens.eos_token_ids[0]))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Conversation:
    """A chat history and the KV cache that holds it; see the module docstring."""

    def __init__(
        self,
        model: TextModel,
        *,
        system: str | None = None,
        template: ChatTemplate | str | None = None,
        adapter: str | None = None,
        tools: list | None = None,
        documents: list | None = None,
        enable_thinking: bool | None = None,
        template_vars: dict | None = None,
    ):
        if model.tokenizer is None:
            raise InvalidInputError("chat needs a tokenizer, and this package has none")
        if system is not None and not isinstance(system, str):
            raise ChatTemplateError(f"system must be a string or None, got {type(system).__name__}")
        self._base, self.adapter = model, adapter  # a LoRA adapter's name (runtime/adapters.py), None: the base
        self.model = model if adapter is None else model.runner(adapter)
        self.template = package_template(model, template)
        self.convention: Convention = convention_for(self.template.source)  # runtime/tool_calls.py
        self.system = system
        # template variables every turn renders with; send/stream may replace them for one turn
        self.tools, self.documents, self.enable_thinking = tools, documents, enable_thinking
        self.template_vars = template_vars
        template_variables(tools, documents, enable_thinking, template_vars)  # bad values raise here
        self.last_turn: TurnStats | None = None
        self._history: list[dict] = []  # the messages after the system message
        self._cache: Cache | None = None  # made by the first turn (runtime/kvcache.py)
        self._ids: list[int] = []  # the ids whose keys/values the cache holds, in order
        self._turn_starts: list[int] = []  # per exchange in _history: the cache length its turn started from
        self._pending: Iterator[str] | None = None  # the pieces of a stream not yet finished

    # ---- the public API -------------------------------------------------------------------------

    @property
    def messages(self) -> list[dict]:
        """A copy of the history, the system message first."""
        return copy.deepcopy(self._head() + self._history)

    def send(self, message: str | dict | list[dict], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **options: Any):
        """Add a message and return the assistant's reply (a GenerationResult with content, reasoning and
        tool_calls: docs/apps.md). message: a user message's text, a message dict (a tool's result:
        {"role": "tool", "tool_call_id": ..., "content": ...}) or a list of them. Options as Model.generate's
        (temperature, top_k, top_p, min_p, repetition_penalty, seed, stop, cancel, response_format, regex,
        grammar), and for this turn only: tools, documents, enable_thinking, template_vars, tool_choice."""
        stream = self.stream(message, max_new_tokens, **options)
        for _ in stream:
            pass
        return stream.result

    def stream(self, message: str | dict | list[dict], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **options: Any):
        """Like send, but returns a Stream of text pieces (Piece: also .content, .reasoning, .tool_calls) whose
        .result is set at the end. Everything is checked here, before the first piece is asked for; the turn
        enters the history when the stream ends."""
        self._close_pending()
        history = [*self._history, *new_messages(message)]
        return self._start(history, max_new_tokens, options, drop_oldest=True)

    def reply_to(self, messages: list[dict], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **options: Any):
        """The reply to a whole list of messages (Model.chat): they replace the history; none is dropped."""
        stream = self.stream_reply(messages, max_new_tokens, **options)
        for _ in stream:
            pass
        return stream.result

    def stream_reply(
        self,
        messages: list[dict],
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        *,
        prompt_ids: list[int] | None = None,
        **options: Any,
    ):
        """reply_to as a Stream (Model.chat_stream). prompt_ids: what ids_of(messages, **options) gave for them,
        so the messages are not rendered again (a server renders a request once, to pick the conversation)."""
        self._close_pending()
        messages = validate_messages(messages)
        if messages and messages[0]["role"] == "system":
            self.system, messages = messages[0]["content"], messages[1:]
        return self._start(messages, max_new_tokens, options, drop_oldest=False, prompt_ids=prompt_ids)

    @property
    def cached_ids(self) -> list[int]:
        """A copy of the ids whose keys/values the cache holds (what a next turn can reuse)."""
        return list(self._ids)

    def ids_of(self, messages: list[dict], **options: Any) -> list[int]:
        """The ids stream_reply(messages, **options) feeds a conversation whose `system` is None: the whole message
        list rendered with the generation prompt and the template variables among options (checked; the other
        options are ignored); nothing changes. ChatTemplateError when the template fails on them."""
        messages = validate_messages(messages)
        system = None
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        return self._render(messages, self._variables(dict(options)), system)

    def shared_prefix(self, ids: list[int]) -> int:
        """How many of ids the cache holds already: their common prefix with cached_ids."""
        return common_prefix(self._ids, ids)

    def prompt_ids(self, text: str) -> list[int]:
        """The ids the template renders for the history plus a user message `text`, with the generation prompt;
        nothing changes. ChatTemplateError when the template fails on them (a CLI checks its template with it)."""
        if not isinstance(text, str):
            raise InvalidInputError(f"a message must be a string, got {type(text).__name__}")
        history = [*self._history, {"role": "user", "content": text}]
        variables = self._variables({})
        return chat_prompt_ids(self.template, self.model.tokenizer, self._head() + history, **variables)

    def undo(self) -> None:
        """Remove the last exchange (the last user message and what followed it); the cache rewinds to before it."""
        self._close_pending()
        users = [i for i, message in enumerate(self._history) if message["role"] == "user"]
        if not users:
            raise InvalidInputError("there is no exchange to undo")
        self._history = self._history[: users[-1]]
        start = self._turn_starts.pop() if self._turn_starts else 0
        self._rewind(min(start, len(self._ids)))

    def reset(self) -> None:
        """Forget every message but the system message. The cache is left as it is: the next turn rewinds it
        to what it shares with the new rendering (the system prompt), so that part is not fed again."""
        self._close_pending()
        self._history, self._turn_starts = [], []

    # ---- a turn ---------------------------------------------------------------------------------

    def _variables(self, options: dict) -> dict:
        """The template variables of a turn: the conversation's, or those given to this turn (taken from options)."""
        given = {name: options.pop(name) for name in TURN_VARIABLES if name in options}
        values = {name: given.get(name, getattr(self, name)) for name in TURN_VARIABLES}
        return template_variables(**values)

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def _render(self, history: list[dict], variables: dict, system: str | None) -> list[int]:
        """A history's ids after the system prompt, with the generation prompt (a template that renders nothing:
        BOS)."""
        head = [{"role": "system", "content": system}] if system is not None else []
        ids = chat_prompt_ids(self.template, self.model.tokenizer, head + history, **variables)
        return ids or self.model.encode("")

    def _rewind(self, length: int) -> None:
        if self._cache is not None:
            self._cache.rewind(length)
        self._ids = self._ids[:length]

    def _close_pending(self) -> None:
        if self._pending is not None:
            self._pending.close()  # commits the partial reply (see _start's finally)
            self._pending = None

    def _fit(
        self,
        history: list[dict],
        max_new_tokens: int,
        drop_oldest: bool,
        variables: dict,
        rendered: list[int] | None = None,
    ) -> tuple[list[dict], list[int], int]:
        """Render and tokenize (unless `rendered` holds the history's ids already: ids_of's); drop the oldest
        exchanges until the prompt and max_new_tokens fit the context."""
        limit, dropped = self.model.context_length, 0
        if max_new_tokens >= limit:
            raise ContextLengthError(f"max_new_tokens ({max_new_tokens}) must be below the context length {limit}")
        while True:
            if rendered is not None:
                ids, rendered = list(rendered), None
            else:
                try:
                    ids = self._render(history, variables, self.system)
                except ChatTemplateError:  # a message of megabytes stops the sandbox: blame the message
                    self._check_each_fits(history, max_new_tokens, drop_oldest)
                    raise
            if len(ids) + max_new_tokens <= limit:
                return history, ids, dropped
            users = [i for i, message in enumerate(history) if message["role"] == "user"]
            if not drop_oldest or len(users) < 2:
                self._check_each_fits(history, max_new_tokens, drop_oldest)
                what = "the system prompt or the message" if drop_oldest else "the messages (or drop earlier ones)"
                raise ContextLengthError(
                    f"the prompt ({len(ids)} tokens with the chat template) + max_new_tokens ({max_new_tokens}) "
                    f"exceeds the context length {limit}; shorten {what} or lower max_new_tokens"
                )
            dropped += users[1]  # the oldest exchange: everything before the second user message
            history = history[users[1] :]

    def _check_each_fits(self, history: list[dict], max_new_tokens: int, drop_oldest: bool) -> None:
        """ContextLengthError naming the longest of the system prompt and the messages when it alone leaves
        max_new_tokens no room."""
        limit = self.model.context_length
        head = self._head()
        named = [("the system prompt", message) for message in head]
        for index, message in enumerate(history):
            last = drop_oldest and index == len(history) - 1  # send(): the new message
            where = "the message" if last else f"message {index + len(head)} ({message['role']})"
            named.append((where, message))
        longest = (0, "", False)  # tokens, who, whether counted in full
        for where, message in named:
            content = message.get("content")
            if not isinstance(content, str) or 4 * len(content) + 1 <= limit - max_new_tokens:
                continue  # too few characters to be too many tokens: a token holds a UTF-8 byte (+1: a word mark)
            counted = content[: MAX_CHARS_PER_TOKEN * limit]  # enough to show a message too long, not more
            tokens = len(self.model.tokenizer.encode_text(counted, at_start=False))
            longest = max(longest, (tokens, where, len(counted) == len(content)))
        tokens, where, whole = longest
        if tokens + max_new_tokens > limit:
            size = f"{tokens:,} tokens" if whole else f"more than {tokens:,} tokens"
            it = where if where == "the system prompt" else "it"
            advice = f"shorten {it}" + (" or lower max_new_tokens" if tokens < limit else "")
            raise ContextLengthError(
                f"{where} alone is {size}, which with max_new_tokens ({max_new_tokens}) exceeds the context "
                f"length {limit}; {advice}"
            )

    def _start(
        self,
        history: list[dict],
        max_new_tokens: Any,
        options: dict,
        *,
        drop_oldest: bool,
        prompt_ids: list[int] | None = None,
    ) -> Stream:
        """Check everything and plan the turn (which ids the cache already holds); the stream then runs it."""
        started = time.perf_counter()
        variables = self._variables(options)
        tool_choice = options.pop("tool_choice", None)
        parse_calls = tool_choice != "none"
        if tool_choice not in (None, "auto", "none"):
            from .constraints import tool_choice_grammar  # llguidance only when a call is forced

            if any(options.get(name) is not None for name in ("response_format", "grammar", "regex")):
                raise InvalidParameterError("tool_choice forces tool calls: give no response_format, grammar or regex")
            options["grammar"] = tool_choice_grammar(
                self.convention, variables.get("tools"), tool_choice, self.model.tokenizer
            )
        adapter = options.pop("adapter", self.adapter)
        runner = self.model if adapter == self.adapter else self._base.runner(adapter)  # an unknown name raises
        checked = generation_options(
            max_new_tokens,
            options,
            tokenizer=self.model.tokenizer,
            allowed=TURN_OPTIONS,
            caller="a chat turn",
            runner=self._base,  # the Model, which loads a draft package (an adapter's runner does not)
        )
        history, ids, dropped = self._fit(history, checked.max_new_tokens, drop_oldest, variables, prompt_ids)
        switched = adapter != self.adapter
        if switched:  # the cache holds another adapter's keys and values: start it afresh
            self.model, self.adapter, self._cache, self._ids = runner, adapter, None, []
        # at least two ids are fed (one for a one-id prompt): their last logits start the reply. A step of one row
        # runs other kernels than a prompt's step of several in some packages (MatMulNBits at accuracy level 4),
        # so a question asked again after reset() or undo() gets a fresh conversation's answer only when its last
        # id is fed beside another, as a fresh prefill feeds it; steps of two or more rows agree with each other
        reused = max(0, min(common_prefix(self._ids, ids), len(ids) - 2))
        if self._cache is not None:  # a state that keeps only some lengths (runtime/kvcache.py's Cache)
            reused = self._cache.rewind_point(reused)
        path = "full" if reused == 0 else "prefix" if reused == len(self._ids) else "rewind"
        stats = TurnStats(path, len(ids), reused, len(ids) - reused, dropped, adapter, switched)
        earlier = sum(message["role"] == "user" for message in history) - 1  # exchanges before this one
        starts = self._turn_starts[max(0, len(self._turn_starts) - earlier) :] if earlier > 0 else []
        turn = _Turn(history, ids, reused, starts + [reused], checked, started, variables, parse_calls)
        stream: Stream

        def finished(result: GenerationResult) -> None:
            stream.result = result
            self.last_turn = stats

        stream = Stream(self._pieces(turn, finished))
        self._pending = stream._pieces
        return stream

    def _pieces(self, turn: _Turn, finished: Callable[[GenerationResult], None]) -> Iterator[Piece]:
        """Run a planned turn: extend (or rewind) the cache, decode, and commit the turn when it ends."""
        ids, options = turn.ids, turn.options
        cache = self._prepare_cache(turn.reused, len(ids) + options.max_new_tokens)
        assembler = TextAssembler(self.model.tokenizer, options.stops)
        reply = Reply(self.model.tokenizer, self.convention, ids, turn.parse_calls, options.token_mask is not None)
        state = DecodeState.start(1)
        last, last_calls = None, []
        try:
            decoding = decode(self.model, [ids], state, options, cache=cache, feed=ids[turn.reused :])
            for _, token, piece in with_text(decoding, [assembler], state):
                update = reply.add(token, assembler)
                if piece or update is not None:
                    yield reply.piece(piece, update)
            tail = assembler.flush()
        except GeneratorExit:  # the stream was closed before its end: a cancelled reply
            state.finish[0] = "cancelled"
            assembler.flush()
            raise
        except BaseException:  # a failed model call: the cache may be half-written, start it afresh
            self._cache, self._ids, self._pending = None, [], None
            raise
        finally:
            if self._cache is cache:
                last, parsed = reply.finish(assembler)
                last_calls = reply.register(last) if last is not None else []
                calls = reply.calls
                self._commit(turn.history, ids, assembler, cache, turn.starts, reply.message(parsed, calls, assembler))
                new = len(assembler.ids)
                ended = time.perf_counter()
                timings = make_timings(turn.started, state.first_token_time, ended, len(ids), new, state=state)
                result = GenerationResult(assembler.text, list(assembler.ids), state.finish[0], ids, timings)
                result.content, result.reasoning, result.tool_calls = parsed.content, parsed.reasoning, calls
                finished(result)
        if tail or last is not None:
            yield reply.piece(tail, last, last_calls)

    def _prepare_cache(self, reused: int, capacity: int) -> Cache:
        if self._cache is None:
            self._cache = make_cache(self.model, [[0]], capacity=capacity)
            self._cache.rewind(0)  # an empty cache: every turn extends it
        self._cache.rewind(reused)
        self._ids = self._ids[:reused]
        return self._cache

    def _commit(
        self,
        history: list[dict],
        ids: list[int],
        assembler: TextAssembler,
        cache: Cache,
        starts: list[int],
        reply: dict,
    ) -> None:
        """The turn enters the history; the cache holds the prompt and the reply's ids that were fed."""
        held = int(cache.lengths[0])
        self._ids = (ids + list(assembler.ids))[:held]
        self._history = [*history, reply]
        self._turn_starts = starts
        self._pending = None
