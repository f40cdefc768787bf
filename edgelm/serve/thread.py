"""A server in a background thread of this process: for tests, benchmarks and apps that embed the model and
still want to offer the HTTP API (`edgelm serve` runs uvicorn in the main thread instead)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serve_in_thread(
    app, *, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0, grace_s: float = 5.0
) -> Iterator[str]:
    """Run `app` (create_app's) with uvicorn in a daemon thread; yields its base URL (port 0: a free port) and
    stops it on exit as Ctrl-C stops `edgelm serve` (open requests get grace_s: edgelm/serve/server.py).
    RuntimeError when it has not started within timeout_s."""
    from .server import Server  # uvicorn: edgelm[serve]

    server = Server(app, grace_s=grace_s, host=host, port=port)
    thread = threading.Thread(target=server.run, name="edgelm-serve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on {host}:{port} did not start (is the port taken?)")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
