"""Ctrl-C on `edgelm serve` with open streams (docs/serve.md, "Shutdown"): the command runs as a subprocess on a
tiny random chat package with a long context (greedy streams of thousands of tokens outlast the grace period),
two streams and one waiting request are open when SIGINT arrives. The server exits with 130 within the grace
period plus a few decode steps, each stream ends with a server_shutting_down error event and a complete body
(no cut chunked read), the waiting request is answered 503, and stderr holds no traceback. Every wait is bounded.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from chat_package import make_chat_folder
from helpers import quiet

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a subprocess is POSIX's"),
    pytest.mark.slow,  # a server in a subprocess, stopped with open streams
]
GRACE_S = 1.0
EXIT_S = GRACE_S + 4.0  # the grace, then one decode step per generation and the interpreter's exit
WAIT_S = 60  # the longest any step waits


@pytest.fixture(scope="module")
def long_package(tmp_path_factory):
    from edgelm.export.onnx_export import export_package

    root = tmp_path_factory.mktemp("shutdown")
    folder = make_chat_folder(root / "checkpoint", context=16384)
    export_package(folder, root / "long-chat", progress=quiet)
    return root / "long-chat"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def read_stream(url: str, body: dict, opened: threading.Semaphore, outcome: dict) -> None:
    """Read one stream to its end; outcome: its data events, or the transport error that cut it."""
    events = []
    try:
        with httpx.stream("POST", url, json=body, timeout=WAIT_S) as response:
            outcome["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:
                        opened.release()
    except httpx.HTTPError as error:
        outcome["error"] = repr(error)
    finally:
        outcome["events"] = events
        if not events:
            opened.release()


def test_ctrl_c_ends_open_streams_cleanly(long_package):
    port = free_port()
    command = [sys.executable, "-m", "edgelm", "serve", str(long_package), "--port", str(port), "--threads", "1"]
    command += ["--parallel", "2", "--grace", str(GRACE_S)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if server.poll() is not None or time.monotonic() > deadline:
                    stderr = server.stderr.read() if server.poll() is not None else ""
                    raise AssertionError(f"the server did not start: {stderr}") from None
                time.sleep(0.1)
        body = {"model": "long-chat", "prompt": "ROMEO:", "max_tokens": 16000, "temperature": 0, "stream": True}
        opened, outcomes = threading.Semaphore(0), [{}, {}]
        readers = [
            threading.Thread(target=read_stream, args=(f"{base}/v1/completions", body, opened, outcome))
            for outcome in outcomes
        ]
        for reader in readers:
            reader.start()
        for _ in readers:
            assert opened.acquire(timeout=WAIT_S), "a stream did not start"
        waiting = {}  # both slots are taken: this one waits in the queue

        def post() -> None:
            try:
                response = httpx.post(f"{base}/v1/completions", json={**body, "stream": False}, timeout=WAIT_S)
                waiting["status"], waiting["body"] = response.status_code, response.json()
            except httpx.HTTPError as error:
                waiting["error"] = repr(error)

        poster = threading.Thread(target=post)
        poster.start()
        time.sleep(0.3)  # the waiting request is accepted before the signal
        signalled = time.monotonic()
        server.send_signal(signal.SIGINT)
        status = server.wait(WAIT_S)
        exit_s = time.monotonic() - signalled
        for thread in (*readers, poster):
            thread.join(WAIT_S)
        stderr = server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(WAIT_S)
    assert status == 130, stderr  # Ctrl-C's documented status
    assert GRACE_S <= exit_s < EXIT_S, f"exited {exit_s:.1f} s after SIGINT"
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    for outcome in outcomes:
        assert outcome["status"] == 200 and "error" not in outcome, outcome.get("error")  # a complete body
        last = json.loads(outcome["events"][-1])
        assert last["error"]["code"] == "server_shutting_down", last  # the stream was still open at the grace
        assert len(outcome["events"]) > 2  # pieces came before it
    assert waiting.get("status") == 503, waiting
    assert waiting["body"]["error"]["code"] == "server_shutting_down"
