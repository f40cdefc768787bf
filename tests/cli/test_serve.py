"""`edgelm serve` (edgelm/serve/): the official openai client against a server started in-process on 127.0.0.1 over
a tiny random chat package with LoRA slots (tests/chat_package.py) and one adapter.

Answers equal the Python API's (greedy) for chat, streams and completions, base and adapter; a follow-up request
reuses the kept KV cache and still answers as a fresh call; concurrent clients each get their own answer; a full
queue answers 503; a client that disconnects mid-stream stops its generation; each malformed request gets one
OpenAI error object and the server keeps serving; the API key guards /v1. Every wait is bounded."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from chat_package import make_chat_folder
from helpers import lora_targets, quiet, save_peft_adapter

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from edgelm.runtime import load  # noqa: E402
from edgelm.serve import Engine, Settings, create_app, serve_in_thread  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NAME = "tiny-chat"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the moon?"}]
QWEN = Path(__file__).parents[1] / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"  # a tool-use template
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": CITY}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
WAIT_S = 30  # the longest any test waits for the server


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A chat package with rank-4 LoRA slots on the attention projections, and an adapter "pirate" loaded."""
    import transformers

    from edgelm.export.lora import SlotSpec, convert_adapter
    from edgelm.export.onnx_export import export_package

    root = tmp_path_factory.mktemp("serve")
    folder = make_chat_folder(root / "checkpoint", context=1024)  # room for tool specs
    package = root / NAME
    export_package(folder, package, lora_slots=SlotSpec(lora_targets("llama", mlp=False), 4), progress=quiet)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    save_peft_adapter(hf, root / "pirate", r=4, targets=lora_targets("llama", mlp=False), seed=3)
    model = load(package, provider="cpu", threads=1)
    model.load_adapter(convert_adapter(root / "pirate", package, root / "pirate.onnx_adapter"), name="pirate")
    return model


@contextmanager
def serving(model, *, api_key: str | None = None, grace_s: float = 5.0, **settings):
    """A server on a free loopback port in a thread; yields (base URL, engine)."""
    engine = Engine(model, name=NAME, settings=Settings(**settings))
    try:
        with serve_in_thread(create_app(engine, api_key=api_key), timeout_s=WAIT_S, grace_s=grace_s) as url:
            yield url, engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def server(model):
    with serving(model) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def reference(model, messages=MESSAGES, tokens=12, **options):
    return model.chat(messages, tokens, temperature=0, **options)


def test_chat_equals_the_python_api(model, client):
    expected = reference(model)
    reply = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids) + (expected.finish_reason == "eos")
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == NAME
    again = client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=12, temperature=0)
    assert again.choices[0].message.content == expected.text  # max_completion_tokens, as OpenAI's newer name


def test_stream_is_the_same_reply_in_chunks(model, client):
    expected = reference(model)
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == expected.text and len(chunks) > 3
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids) + (
        expected.finish_reason == "eos"
    )


def test_stop_and_seed(model, client):
    expected = reference(model, tokens=24)
    stop = expected.text.strip()[3:6]
    assert stop
    reply = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop])
    assert reply.choices[0].message.content == reference(model, tokens=24, stop=[stop]).text
    assert reply.choices[0].finish_reason == "stop" and stop not in reply.choices[0].message.content
    sampled = [
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=seed)
        for seed in (7, 7, 8)
    ]
    texts = [reply.choices[0].message.content for reply in sampled]
    assert texts[0] == texts[1] == model.chat(MESSAGES, 16, temperature=1.0, seed=7).text
    assert texts[2] != texts[0]


def test_completions_text_tokens_and_stream(model, client):
    expected = model.generate("ROMEO:", 10, temperature=0)
    reply = client.completions.create(model=NAME, prompt="ROMEO:", max_tokens=10, temperature=0)
    assert reply.choices[0].text == expected.text and reply.usage.completion_tokens == len(expected.token_ids) + (
        expected.finish_reason == "eos"
    )
    by_ids = client.completions.create(model=NAME, prompt=expected.prompt_token_ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == expected.text
    streamed = client.completions.create(model=NAME, prompt="ROMEO:", max_tokens=10, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text
    default = client.completions.create(model=NAME, prompt="ROMEO:", temperature=0)
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_models_and_adapters_by_name(model, client):
    assert [m.id for m in client.models.list().data] == [NAME, "pirate"]
    assert client.models.retrieve("pirate").id == "pirate"
    base, pirate = reference(model), reference(model, adapter="pirate")
    assert base.text != pirate.text
    reply = client.chat.completions.create(model="pirate", messages=MESSAGES, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == pirate.text
    completion = client.completions.create(model="pirate", prompt="ROMEO:", max_tokens=8, temperature=0)
    assert completion.choices[0].text == model.generate("ROMEO:", 8, temperature=0, adapter="pirate").text
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="nobody", messages=MESSAGES)
    assert error.value.body["code"] == "model_not_found"


def test_a_follow_up_reuses_the_kept_prompt(model, client):
    first = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the sun?"},
    ]
    reply = client.chat.completions.create(model=NAME, messages=follow_up, max_tokens=8, temperature=0)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 2 <= cached < reply.usage.prompt_tokens  # all but the end-of-turn ids
    assert reply.choices[0].message.content == reference(model, follow_up, 8).text  # as a fresh call


def test_concurrent_clients_each_get_their_answer(model, server, client):
    questions = [f"Question {i}: why?" for i in range(6)]
    chats = [[{"role": "user", "content": q}] for q in questions]
    expected = [reference(model, chat, 8).text for chat in chats]

    def ask(chat):
        return client.chat.completions.create(model=NAME, messages=chat, max_tokens=8, temperature=0)

    with ThreadPoolExecutor(len(chats)) as pool:
        replies = list(pool.map(ask, chats, timeout=WAIT_S))
    assert [reply.choices[0].message.content for reply in replies] == expected
    health = httpx.get(f"{server[0]}/health", timeout=WAIT_S).json()
    assert health == {"status": "ok", "model": NAME, "running": 0, "waiting": 0}


@contextmanager
def gated(engine):
    """Jobs wait for the yielded event before they start (a slot stays taken until it is set)."""
    gate, job = threading.Event(), engine.chat_job

    def waiting_job(*args, **kwargs):
        assert gate.wait(WAIT_S)
        return job(*args, **kwargs)

    engine.chat_job = waiting_job
    try:
        yield gate
    finally:
        gate.set()
        engine.chat_job = job


def test_a_full_queue_answers_503_and_the_rest_are_served(model):
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with serving(model, parallel=1, queue=1) as (url, engine), gated(engine) as gate:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=WAIT_S) for _ in range(2)]
            deadline = time.monotonic() + WAIT_S
            while engine.accepted < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=WAIT_S)
            gate.set()
            statuses = [future.result(WAIT_S).status_code for future in held]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_overloaded"
    assert refused.headers["retry-after"] == "1"
    assert statuses == [200, 200]


def test_one_slot_and_no_queue_serve_a_client_request_after_request(model):
    """A finished request's slot is free before its answer goes out: back-to-back requests never see a 503."""
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    with serving(model, parallel=1, queue=0) as (url, _), httpx.Client(timeout=WAIT_S) as http:
        statuses = [http.post(f"{url}/v1/chat/completions", json=body).status_code for _ in range(20)]
    assert statuses == [200] * 20


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _slowed(engine):
    """Make the engine's chat jobs emit a piece every 30 ms; returns the job it had."""
    job = engine.chat_job

    def slow_job(*args, emit, **kwargs):
        def slow_emit(item):
            if item[0] == "piece":
                time.sleep(0.03)
            emit(item)

        return job(*args, emit=slow_emit, **kwargs)

    engine.chat_job = slow_job
    return job


def test_a_client_leaving_stops_its_generation(model):
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 150, "temperature": 0, "stream": True}
    with serving(model, parallel=1) as (url, engine):
        job = _slowed(engine)  # 150 tokens take seconds, leaving time to leave
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=WAIT_S) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        wait_for(lambda: engine.finished["cancelled"] == 1, f"the stream was not cancelled: {engine.finished}")
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a non-streamed answer
            httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
        wait_for(lambda: engine.finished["cancelled"] == 2, f"the request was not cancelled: {engine.finished}")
        assert engine.finished == {"cancelled": 2}  # not "length": both ended before their 150 tokens
        engine.chat_job = job
        after = httpx.post(
            f"{url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=WAIT_S
        )
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def test_stopping_ends_an_open_stream_with_an_error_event(model):
    """The server stopping (Ctrl-C, or serve_in_thread's exit) gives an open stream grace_s, then ends it with a
    server_shutting_down event and a complete body, and a request waiting for the slot gets a 503."""
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 150, "temperature": 0, "stream": True}
    events, outcome, opened = [], {}, threading.Event()

    def read(url: str) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=WAIT_S) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        opened.set()
        except httpx.HTTPError as error:
            outcome["error"] = repr(error)

    def wait(url: str) -> None:
        outcome["waiting"] = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=WAIT_S)

    with serving(model, parallel=1, grace_s=0.3) as (url, engine):
        _slowed(engine)  # 150 tokens outlast the grace
        clients = [threading.Thread(target=read, args=(url,)), threading.Thread(target=wait, args=(url,))]
        clients[0].start()
        assert opened.wait(WAIT_S), "the stream did not start"
        clients[1].start()
        wait_for(lambda: engine.waiting == 1, "the second request did not wait")
    for client in clients:
        client.join(WAIT_S)
    assert "error" not in outcome, outcome["error"]  # the body ended as a body ends, not cut
    assert json.loads(events[-1])["error"]["code"] == "server_shutting_down" and len(events) > 2, events[-3:]
    waiting = outcome["waiting"]
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "server_shutting_down"
    assert engine.finished == {"error": 2}


MALFORMED = [  # (body, status, param or code expected in the error)
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    ({"messages": MESSAGES}, 400, "model"),
    ({"model": NAME, "messages": []}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": NAME, "messages": MESSAGES, "n": 2}, 400, "n"),
    ({"model": NAME, "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "messages": MESSAGES, "top_p": 5}, 400, "invalid_value"),
    ({"model": NAME, "messages": MESSAGES, "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": NAME, "messages": MESSAGES, "logprobs": True}, 400, "logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "moon " * 1500}]}, 400, "context_length_exceeded"),
    (
        {
            "model": NAME,
            "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
        },
        400,
        "messages[0].tool_calls[0].function.arguments",
    ),
    ({"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0]"),
    ({"model": "nobody", "messages": MESSAGES}, 404, "model_not_found"),
    ({"model": NAME, "messages": MESSAGES, "chat_template_kwargs": {"messages": 1}}, 400, "invalid_messages"),
    ({"model": NAME, "messages": MESSAGES, "response_format": {}}, 400, "invalid_value"),  # no type: not text
]


DEEP_ARGUMENTS = '{"a": ' + "[" * 5_000 + "]" * 5_000 + "}"
HOSTILE = [  # round 5: bodies that crashed (500, a reset connection) or were coerced instead of refused
    (b'{"model": "tiny-chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json"),
    (b'{"model": "tiny-chat", "x": ' + b"[" * 900 + b"]" * 900 + b', "messages": []}', 400, "invalid_json"),
    (
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "invalid_json",
    ),
    (
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        400,
        "invalid_json",
    ),
    (
        {
            "model": NAME,
            "messages": [
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": DEEP_ARGUMENTS}}]}
            ],
        },
        400,
        "messages[0].tool_calls[0].function.arguments",
    ),
    ({"model": NAME, "messages": [{"role": "assistant", "tool_calls": 5}]}, 400, "messages.0.tool_calls"),
    (
        {"model": NAME, "messages": [{"role": "assistant", "tool_calls": [{"function": 5}]}]},
        400,
        "messages.0.tool_calls.0.function",
    ),
    ({"model": NAME, "messages": MESSAGES, "max_tokens": True}, 400, "max_tokens"),
    ({"model": NAME, "messages": MESSAGES, "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": NAME, "messages": MESSAGES, "max_completion_tokens": 2.5}, 400, "max_completion_tokens"),
    ({"model": NAME, "messages": MESSAGES, "temperature": True}, 400, "temperature"),
    ({"model": NAME, "messages": MESSAGES, "temperature": "0.5"}, 400, "temperature"),
    ({"model": NAME, "messages": MESSAGES, "top_p": True}, 400, "top_p"),
    ({"model": NAME, "messages": MESSAGES, "top_k": True}, 400, "top_k"),
    ({"model": NAME, "messages": MESSAGES, "seed": True}, 400, "seed"),
    ({"model": NAME, "messages": MESSAGES, "stream": "yes"}, 400, "stream"),
    ({"model": NAME, "messages": MESSAGES, "stream": 1}, 400, "stream"),
    (
        {"model": NAME, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
    ),
    ({"model": 5, "messages": MESSAGES}, 400, "model"),
    ({"model": NAME, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ({"model": NAME, "messages": MESSAGES, "tools": [{}]}, 400, "tools.0.type"),
    ({"model": NAME, "messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    (
        {"model": NAME, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": 5}}]},
        400,
        "tools.0.function.name",
    ),
    (
        {"model": NAME, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": ""}}]},
        400,
        "tools.0.function.name",
    ),
    ({"model": NAME, "messages": MESSAGES, "tools": {"type": "function"}}, 400, "tools"),
    ({"model": NAME, "messages": MESSAGES, "tools": [TOOL], "tool_choice": "always"}, 400, "tool_choice"),
]


def test_hostile_bodies_and_lax_types_get_one_error_object(server, caplog):
    url = f"{server[0]}/v1/chat/completions"
    with caplog.at_level(logging.ERROR):
        for body, status, names in HOSTILE:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = httpx.post(url, content=content, timeout=WAIT_S)
            assert response.status_code == status, (body if isinstance(body, dict) else body[:80], response.text[:300])
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
            assert names == error["code"] or str(error["param"]).startswith(names), (names, error)
    assert not [record for record in caplog.records if record.exc_info], "a traceback was logged"
    completions = f"{server[0]}/v1/completions"
    for prompt in ([True], [[1, True]], True, [1.5]):
        response = httpx.post(completions, json={"model": NAME, "prompt": prompt, "max_tokens": 2}, timeout=WAIT_S)
        assert response.status_code == 400 and str(response.json()["error"]["param"]).startswith("prompt"), prompt
    response = httpx.post(completions, json={"model": NAME, "prompt": "a", "echo": "no"}, timeout=WAIT_S)
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


def test_openai_nullables_are_accepted(server):
    url = f"{server[0]}/v1/chat/completions"
    nulls = {"stream": None, "stream_options": None, "temperature": None, "top_p": None, "seed": None, "stop": None}
    nulls |= {"tools": None, "tool_choice": None, "response_format": None, "n": None, "logprobs": None, "user": None}
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 2, **nulls}
    response = httpx.post(url, json=body, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 2
    integral = httpx.post(url, json={**body, "temperature": 0, "top_p": 1}, timeout=WAIT_S)  # ints for floats
    assert integral.status_code == 200, integral.text
    completion = httpx.post(
        f"{server[0]}/v1/completions",
        json={"model": NAME, "prompt": "a", "max_tokens": 2, "stream": None, "echo": None},
        timeout=WAIT_S,
    )
    assert completion.status_code == 200, completion.text


@pytest.mark.parametrize(("body", "status", "names"), MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_a_malformed_request_gets_one_error_object(server, body, status, names):
    url = f"{server[0]}/v1/chat/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(url, content=content, timeout=WAIT_S)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert names in (error["param"], error["code"]), error
    assert "\n" not in error["message"]
    assert (
        httpx.post(url, json={"model": NAME, "messages": MESSAGES, "max_tokens": 2}, timeout=WAIT_S).status_code == 200
    )


def test_completions_refuse_what_they_cannot_do(server):
    url = f"{server[0]}/v1/completions"
    for body, param in [
        ({"model": NAME, "prompt": ["a", "b"]}, "prompt"),
        ({"model": NAME, "prompt": "a", "echo": True}, "echo"),
        ({"model": NAME, "prompt": [999999]}, "prompt"),
    ]:
        response = httpx.post(url, json=body, timeout=WAIT_S)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    huge = httpx.post(url, content=b" " * (33 * 2**20), timeout=WAIT_S)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"
    for path, method in [("/v1/nothing", "GET"), ("/v1/models", "DELETE")]:
        response = httpx.request(method, f"{server[0]}{path}", timeout=WAIT_S)
        assert response.status_code in (404, 405) and "error" in response.json()


def test_the_api_key_guards_v1(model):
    with serving(model, api_key="sesame") as (url, _):
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = httpx.get(f"{url}/v1/models", headers=headers, timeout=WAIT_S)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0, timeout=WAIT_S)
        assert client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_one_log_line_per_request(server, client, caplog):
    with caplog.at_level(logging.INFO, logger="edgelm.serve"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3, temperature=0)
        httpx.get(f"{server[0]}/health", timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while len(caplog.records) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    chat, health = (record.getMessage() for record in caplog.records)
    assert "POST /v1/chat/completions 200 prompt=" in chat and "completion=3 finish=length" in chat
    assert "GET /health 200" in health and chat.endswith("s") and "\n" not in chat


def test_serve_help_explains(capsys):
    from edgelm.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["serve", "--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "--api-key", "127.0.0.1",
                  "--parallel", "--queue", "503", "disconnects", "--prompt-cache", "--adapter"):  # fmt: skip
        assert words in text, words


# ---- tools and structured output: wired to the runtime's keywords (docs/apps.md) where it has them -----------


def test_a_runtime_without_tools_refuses_them(server):
    url, engine = server
    if engine.features:
        pytest.skip(f"this runtime has {', '.join(sorted(engine.features))}")
    for extra, param in [
        ({"tools": [TOOL]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ]:
        response = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, **extra})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, error
        assert "not supported by this server build" in error["message"]
    plain = {"tool_choice": "auto", "response_format": {"type": "text"}, "max_tokens": 2}  # no-ops: answered
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, **plain})
    assert response.status_code == 200


@pytest.fixture(scope="module")
def tool_server(model, server):
    if "tools" not in server[1].features or "structured" not in server[1].features:
        pytest.skip("this runtime has no tools or structured output (docs/apps.md)")
    pytest.importorskip("llguidance")
    with serving(model, chat_template=QWEN.read_text()) as (url, engine):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def test_a_forced_tool_call_streamed_and_its_round_trip(model, tool_server):
    client, template, messages = tool_server, QWEN.read_text(), [{"role": "user", "content": "Weather in Paris?"}]
    expected = model.chat(messages, 60, template=template, tools=[TOOL], tool_choice=FORCED, temperature=0)
    assert expected.tool_calls, expected.text
    reply = client.chat.completions.create(
        model=NAME, messages=messages, tools=[TOOL], tool_choice=FORCED, max_tokens=60, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == len(expected.tool_calls)
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, arguments) == (expected.tool_calls[0].name, expected.tool_calls[0].arguments)
    assert call.type == "function" and call.id and arguments["city"] in ("Paris", "London")

    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=messages, tools=[TOOL], tool_choice=FORCED, max_tokens=60, temperature=0, stream=True
        )
    )
    streamed = [delta for chunk in chunks if chunk.choices for delta in chunk.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in streamed][:1] == [
        (0, "get_weather", arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    result = {"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny"}'}
    follow_up = [*messages, choice.message.model_dump(exclude_none=True), result]
    again = client.chat.completions.create(model=NAME, messages=follow_up, tools=[TOOL], max_tokens=8, temperature=0)
    as_runtime = [*messages, {**follow_up[1], "tool_calls": [expected.tool_calls[0].to_message()]}, result]
    as_runtime[1]["tool_calls"][0]["id"] = call.id
    direct = model.chat(as_runtime, 8, template=template, tools=[TOOL], temperature=0)
    assert again.choices[0].message.content == direct.content
    assert again.usage.prompt_tokens == len(direct.prompt_token_ids)


def test_a_json_schema_answer_validates(model, tool_server):
    answer = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    answer["additionalProperties"] = False
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    reply = tool_server.chat.completions.create(
        model=NAME, messages=MESSAGES, response_format=response_format, max_tokens=60, temperature=0
    )
    content = reply.choices[0].message.content
    assert json.loads(content)["answer"] in ("yes", "no")
    template = QWEN.read_text()
    assert (
        content == model.chat(MESSAGES, 60, template=template, response_format=response_format, temperature=0).content
    )


def test_serve_without_the_extra_names_it(model, monkeypatch, capsys):
    from edgelm.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if edgelm[serve] were not installed
    assert main(["serve", str(model.spec.folder)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "missing Python package 'uvicorn'" in lines[0] and "edgelm[serve]" in lines[0], lines


def test_a_taken_port_is_a_one_line_error(model, capsys):
    import socket

    from edgelm.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(model.spec.folder), "--port", str(port), "--threads", "1"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], lines


def test_usage_counts_the_eos_token_that_ended_the_reply(model, client):
    yes = {"type": "json_schema", "json_schema": {"name": "yes", "schema": {"enum": ["yes"]}}}
    expected = reference(model, tokens=20, response_format=yes)
    assert expected.finish_reason == "eos"  # the grammar leaves only EOS once "yes" is written
    reply = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, response_format=yes)
    assert reply.choices[0].message.content == expected.text == '"yes"'
    assert reply.usage.completion_tokens == len(expected.token_ids) + 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
