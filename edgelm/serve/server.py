"""uvicorn's Server with the shutdown docs/serve.md promises (Ctrl-C, SIGTERM, or serve_in_thread's exit).

uvicorn alone stops accepting, waits `timeout_graceful_shutdown` for open responses, then cancels their tasks:
a stream still open is cut mid-body (clients read an incomplete chunked response) and every cancelled task
logs a CancelledError traceback. Here the open requests get `grace_s` to finish; then Engine.stop() cancels
their generations, which end within one decode step with a 503 `server_shutting_down` error (a stream's last
event, then the end of its body), so uvicorn's own cancellation, ENDING_S later, is a backstop that finds
nothing to cancel.
"""

from __future__ import annotations

import asyncio

import uvicorn

ENDING_S = 10.0  # after the grace: for cancelled generations to end (one decode step; a prefill under way first)


class Server(uvicorn.Server):
    """A uvicorn Server for create_app's app (its `.engine` is stopped when the grace period ends)."""

    def __init__(self, app, *, grace_s: float, **config):
        config = {"log_level": "warning", "access_log": False, **config}
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace_s + ENDING_S, **config))
        self.engine, self.grace_s = app.engine, grace_s

    async def shutdown(self, sockets=None) -> None:
        stop = asyncio.get_running_loop().call_later(self.grace_s, self.engine.stop)
        try:
            await super().shutdown(sockets)
        finally:
            stop.cancel()
