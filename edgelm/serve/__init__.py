"""`edgelm serve`: an OpenAI-compatible HTTP server over the runtime's Python API (install `edgelm[serve]`).

    from edgelm.runtime import load
    from edgelm.serve import Engine, Settings, create_app
    app = create_app(Engine(load("out/smol-int4"), name="smol", settings=Settings(parallel=2)))
    # uvicorn.run(app, host="127.0.0.1", port=8000)

engine.py holds the model, worker slots, cancellation and the prompt cache (the policies are in its docstring
and docs/serve.md); app.py the routes and the per-request log; protocol.py OpenAI's request and response shapes;
errors.py OpenAI's error objects. Nothing here generates: every token comes from Model / Conversation.
"""

from .app import create_app
from .engine import Engine, Settings

__all__ = ["Engine", "Settings", "create_app"]
