"""The HTTP routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, and /health, on FastAPI.

Each generating route validates its request (edgelm/serve/protocol.py), picks the model or adapter by name,
and hands a job to the Engine (edgelm/serve/engine.py), whose worker thread reports back through a queue:
a start, text pieces, then the result or an error. A streamed answer is server-sent events in OpenAI's chunk
format ending with `data: [DONE]`; when the client goes away the request's cancel event is set and the
generation stops within one decode step. Every error is OpenAI's error object (edgelm/serve/errors.py).
An outer ASGI layer checks the API key on /v1 and logs one line per request when its response ends.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from edgelm.runtime import untrusted

from . import protocol
from .engine import Engine
from .errors import APIError, from_runtime

log = logging.getLogger("edgelm.serve")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY_BYTES = 32 * 2**20  # a request is read into memory: far more than any context's worth of text
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away; only ever logged
UNSUPPORTED_BUILD = "is not supported by this server build (its edgelm runtime has no {})"


def api_extras(request: protocol.ChatCompletionRequest, features: set[str]) -> dict[str, Any]:
    """Tools, template variables and structured output as the runtime's keyword arguments (docs/apps.md): the one
    place they are wired. A field the runtime cannot take (engine.runtime_features) is refused with a 400 rather
    than answered without it."""

    def need(feature: str, param: str) -> None:
        if feature not in features:
            what = "tools or template variables" if feature == "tools" else "structured output"
            raise APIError(400, f"{param} {UNSUPPORTED_BUILD.format(what)}", param=param, code="unsupported_parameter")

    extras: dict[str, Any] = {}
    if request.tools:
        need("tools", "tools")
        extras["tools"] = request.tool_specs
    choice = request.tool_choice
    if choice is not None and (request.tools or choice not in ("auto", "none")):  # auto/none without tools: a no-op
        need("tools", "tool_choice")
        extras["tool_choice"] = choice
    if request.response_format is not None and request.response_format.get("type") != "text":  # {}: refused
        need("structured", "response_format")
        extras["response_format"] = request.response_format
    variables = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", request.reasoning_effort)  # gpt-oss's template reads it
    if variables:
        need("tools", "chat_template_kwargs")
        if "enable_thinking" in variables:
            extras["enable_thinking"] = variables.pop("enable_thinking")
        if variables:
            extras["template_vars"] = variables
    return extras


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class Run:
    """One request's generation, seen from the event loop: the queue its job reports to and its cancel event."""

    def __init__(self, request: Request, *, stream: bool):
        self.request, self.stream = request, stream
        self.cancel = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def emit(self, item: tuple[str, Any]) -> None:
        """Called on the worker thread; a non-streamed request keeps no pieces."""
        if item[0] == "piece" and not self.stream:
            return
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the event loop is closed: the server is stopping
            self.cancel.set()

    def _put(self, item: tuple[str, Any]) -> None:
        if item[0] in ("end", "error"):
            self.release()  # before the answer goes out: the client's next request finds the slot free
        self.queue.put_nowait(item)

    async def watch(self) -> None:
        """Set cancel when the client disconnects (the request body is read, so receive() waits for that)."""
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.cancel.set()
                return

    async def start(self, engine: Engine, job) -> tuple[str, Any]:
        """Queue the job and wait for its first report (start, error or a cancelled end), watching the client."""
        self.release = engine.submit(partial(job, emit=self.emit), cancel=self.cancel)
        self.watcher = asyncio.create_task(self.watch())
        try:
            return await self.queue.get()
        except BaseException:
            self.cancel.set()
            raise

    async def finish(self) -> tuple[str, Any]:
        """Wait for the end (non-streamed): the result or an error."""
        try:
            kind, value = await self.queue.get()
            while kind not in ("end", "error"):
                kind, value = await self.queue.get()
            return kind, value
        except BaseException:
            self.cancel.set()
            raise
        finally:
            self.watcher.cancel()


def record(request: Request, result, cached: int | None) -> dict:
    """Usage for the response and the request's log line."""
    usage = protocol.usage(result, cached)
    request.state.usage, request.state.finish = usage, result.finish_reason
    return usage


async def generate(request: Request, engine: Engine, job, *, stream: bool, prompt_param: str, chunks) -> Response:
    """Run a job; the answer, streamed by `chunks` (an async generator of SSE events) or built from its result."""
    run = Run(request, stream=stream)
    kind, value = await run.start(engine, job)
    if kind == "error":
        run.watcher.cancel()
        raise from_runtime(value, prompt_param=prompt_param)
    if kind == "end" and value is None:  # cancelled while it waited: the client is gone
        run.watcher.cancel()
        return Response(status_code=CLIENT_CLOSED)
    if not stream:
        kind, value = await run.finish()
        if kind == "error":
            raise from_runtime(value, prompt_param=prompt_param)
        if value is None or run.cancel.is_set():
            return Response(status_code=CLIENT_CLOSED)
        return value
    run.watcher.cancel()  # from here StreamingResponse listens for the disconnect, and closing chunks cancels

    async def events():
        try:
            async for event in chunks(run):
                yield event
        finally:
            if getattr(request.state, "finish", None) is None:
                request.state.finish = "cancelled"  # the client went away (or the server stops) mid-stream
            run.cancel.set()  # a no-op after the end; after a disconnect it stops the generation

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def stream_events(run: Run, request: Request, *, first, piece, last, usage_chunk):
    """SSE events of a streamed generation: first(), piece(text) per piece (None: no event), last(result)'s
    chunks at the end, then the usage chunk when asked for, then [DONE]; a failure mid-stream is an error
    object, then the end."""
    if first is not None:
        yield sse(first())
    while True:
        kind, value = await run.queue.get()
        if kind == "piece":
            chunk = piece(value)
            if chunk is not None:  # a piece that only held text back adds nothing
                yield sse(chunk)
        elif kind == "error":
            request.state.finish = "error"
            yield sse(from_runtime(value, prompt_param=None).body())
            return
        elif kind == "end":
            if value is None:
                return
            result, cached = value
            usage = record(request, result, cached)
            for chunk in last(result):
                yield sse(chunk)
            if usage_chunk is not None:
                yield sse(usage_chunk(usage))
            yield sse("[DONE]")
            return


def create_app(engine: Engine, *, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving `engine`'s model; api_key: the Bearer token /v1 requires (None: none)."""
    app = FastAPI(title="edgelm", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(
            APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", code=code)
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        return error_response(from_runtime(error, prompt_param=None))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name, "running": engine.running, "waiting": engine.waiting}

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "edgelm"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in engine.model_names()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        engine.adapter_for(name)
        return model_card(name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, protocol.ChatCompletionRequest)
        if not engine.has_chat_template:
            message = f"{engine.name} has no chat template: use /v1/completions, or serve it with --chat-template FILE"
            raise APIError(400, message, param="messages", code="no_chat_template")
        adapter = engine.adapter_for(body.model)
        options = body.sampling() | api_extras(body, engine.features)
        messages = [message.plain(index) for index, message in enumerate(body.messages)]
        job = partial(engine.chat_job, messages, adapter=adapter, max_tokens=body.reply_tokens, options=options)
        request_id, name = protocol.new_id("chatcmpl"), body.model

        def chunks(run: Run):
            calls = 0  # tool calls streamed so far: each has its index

            def piece(text: str) -> dict | None:
                nonlocal calls
                delta = protocol.chat_delta(text, calls)
                calls += len(delta.get("tool_calls", ()))
                return protocol.chat_chunk(request_id, name, delta) if delta else None

            def last(result) -> list[dict]:
                """The tool calls the pieces did not carry (the runtime may parse them only at the end), then
                the finish reason."""
                chunks = []
                missing = (getattr(result, "tool_calls", None) or [])[calls:]
                if missing:
                    delta = {
                        "tool_calls": [
                            {"index": calls + i, **protocol.openai_tool_call(c)} for i, c in enumerate(missing)
                        ]
                    }
                    chunks.append(protocol.chat_chunk(request_id, name, delta))
                return [*chunks, protocol.chat_chunk(request_id, name, {}, protocol.finish_reason(result))]

            return stream_events(
                run,
                request,
                first=lambda: protocol.chat_chunk(request_id, name, {"role": "assistant", "content": ""}),
                piece=piece,
                last=last,
                usage_chunk=(lambda usage: protocol.chat_chunk(request_id, name, None, usage_=usage))
                if body.include_usage
                else None,
            )

        outcome = await generate(request, engine, job, stream=body.streamed, prompt_param="messages", chunks=chunks)
        if isinstance(outcome, Response):
            return outcome
        result, cached = outcome
        record(request, result, cached)
        return protocol.chat_completion(request_id, name, result, cached)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, protocol.CompletionRequest)
        adapter = engine.adapter_for(body.model)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        job = partial(
            engine.completion_job, body.single_prompt(), adapter=adapter, max_tokens=max_tokens, options=body.sampling()
        )
        request_id, name = protocol.new_id("cmpl"), body.model

        def chunks(run: Run):
            return stream_events(
                run,
                request,
                first=None,
                piece=lambda text: protocol.text_completion(request_id, name, str(text), None),
                last=lambda result: [protocol.text_completion(request_id, name, "", protocol.finish_reason(result))],
                usage_chunk=(
                    lambda usage: {
                        **protocol.text_completion(request_id, name, "", None),
                        "choices": [],
                        "usage": usage,
                    }
                )
                if body.include_usage
                else None,
            )

        outcome = await generate(request, engine, job, stream=body.streamed, prompt_param="prompt", chunks=chunks)
        if isinstance(outcome, Response):
            return outcome
        result, cached = outcome
        usage = record(request, result, cached)
        return protocol.text_completion(request_id, name, result.text, protocol.finish_reason(result), usage_=usage)

    return RequestLog(app, engine, api_key=api_key)


async def parse(request: Request, shape: type[protocol.Request]) -> protocol.Request:
    """The request body as `shape`, whatever its Content-Type says (curl -d sends a form type), checked for
    fields this server cannot honour; APIError 400 naming the first problem (OpenAI answers 400, never 422)."""
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB", code="body_too_large")
    try:
        data = untrusted.loads(body)  # strict JSON, its nesting and numbers bounded (runtime/untrusted.py)
    except untrusted.Unbounded as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        body = shape.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    body.refuse_unsupported()
    return body


class RequestLog:
    """The outer ASGI layer: the API key on /v1 (401 otherwise) and one log line per request when it ends:
    client, method, path, status, tokens (prompt, of them cached, completion), finish reason, seconds.
    `engine` is the Engine it serves (edgelm/serve/server.py stops it at shutdown)."""

    def __init__(self, app: FastAPI, engine: Engine, *, api_key: str | None):
        self.app, self.engine, self.api_key = app, engine, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]
        state = scope.setdefault("state", {})

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and scope["path"].startswith("/v1") and not self._authorized(scope):
                error = APIError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key")
                await error_response(error)(scope, receive, sending)
            else:
                await self.app(scope, receive, sending)
        finally:
            log.info(log_line(scope, status[0], state, time.perf_counter() - started))

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        expected = f"Bearer {self.api_key}".encode()
        return hmac.compare_digest(given, expected)


def log_line(scope, status: int, state: dict, seconds: float) -> str:
    client = scope.get("client")
    where = f"{client[0]}:{client[1]} " if client else ""
    line = f"{where}{scope['method']} {scope['path']} {status}"
    usage = state.get("usage")
    if usage:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        line += f" prompt={usage['prompt_tokens']}" + (f" cached={cached}" if cached is not None else "")
        line += f" completion={usage['completion_tokens']}"
    if state.get("finish"):
        line += f" finish={state['finish']}"
    return f"{line} {seconds:.3f}s"
