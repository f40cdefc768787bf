"""`edgelm serve`: an OpenAI-compatible HTTP server over the runtime's Python API (install `edgelm[serve]`).

    from edgelm.runtime import load
    from edgelm.serve import Engine, Settings, create_app
    app = create_app(Engine(load("out/smol-int4"), name="smol", settings=Settings(parallel=2)))
    # uvicorn.run(app, host="127.0.0.1", port=8000), or in a thread of this process:
    with serve_in_thread(app) as url:  # http://127.0.0.1:PORT, OpenAI's base_url is url + "/v1"
        ...

engine.py holds the model, worker slots, cancellation and the prompt cache (the policies are in its docstring
and docs/serve.md); app.py the routes and the per-request log; protocol.py OpenAI's request and response
shapes; errors.py OpenAI's error objects; thread.py a server in a background thread. Nothing here generates:
every token comes from Model / Conversation.
"""

from .app import create_app
from .engine import Engine, Settings
from .thread import serve_in_thread

__all__ = ["Engine", "Settings", "create_app", "serve_in_thread"]
