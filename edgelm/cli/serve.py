"""`edgelm serve`: an OpenAI-compatible HTTP server for a package (edgelm/serve/, install edgelm[serve])."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path

from .cache import add_model_argument, open_model
from .options import add_command, add_runtime, int_in, positive, text_file

API_KEY_VARIABLE = "EDGELM_API_KEY"
GRACE_S = 5.0  # after Ctrl-C, what open requests get to finish (edgelm/serve/server.py)


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "serve",
        help="an OpenAI-compatible HTTP server for a package (needs edgelm[serve])",
        description="Serve PACKAGE over HTTP as OpenAI's API does: POST /v1/chat/completions (streamed as "
        "server-sent events with stream=true), POST /v1/completions, GET /v1/models (the package and each "
        "--adapter, selectable per request by its name in `model`) and GET /health. Point an OpenAI client at "
        "http://HOST:PORT/v1. --parallel requests generate at once, up to --queue more wait, and any beyond are "
        "answered 503; a request whose client disconnects stops generating. Chat requests reuse the KV cache of "
        "an earlier conversation sharing their prompt's beginning (--prompt-cache). One line per request is "
        "logged on stderr. Tools, tool_choice and response_format (JSON schema output) are answered as OpenAI "
        "answers them, a build without them refusing them with a 400. Ctrl-C stops the server: open requests get "
        "--grace seconds, then end with a 503 server_shutting_down error (a stream's last event).",
        example="edgelm serve out/smol-int4 --port 8000 --adapter pirate=pirate.onnx_adapter",
    )
    add_model_argument(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    g.add_argument("--port", type=int_in(1, 65535), default=8000, help="port (default %(default)s)")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on /v1 (default: ${API_KEY_VARIABLE} if set, else no key)",
    )
    g.add_argument(
        "--model-name", default=None, help="the name clients pass as `model` (default: the package folder's name)"
    )
    g.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="[NAME=]FILE",
        help="a LoRA .onnx_adapter served as model NAME (default: the file's stem); repeatable",
    )
    g.add_argument(
        "--parallel", type=int_in(1, 64), default=2, help="requests generating at once (default %(default)s)"
    )
    g.add_argument(
        "--queue",
        type=int_in(0, 4096),
        default=16,
        help="requests waiting for a slot; beyond: 503 (default %(default)s)",
    )
    g.add_argument(
        "--prompt-cache",
        type=int_in(0, 256),
        default=4,
        metavar="N",
        help="idle conversations whose KV caches are kept for reuse (default %(default)s; 0: none)",
    )
    g.add_argument(
        "--max-tokens",
        type=int_in(1),
        default=None,
        help="a chat reply's length when a request sets none (default: the rest of the context)",
    )
    g.add_argument(
        "--chat-template",
        type=text_file,
        default=None,
        metavar="FILE",
        help="a Jinja chat template used instead of the package's (e.g. one that knows tools)",
    )
    g.add_argument(
        "--grace",
        type=positive,
        default=GRACE_S,
        metavar="SECONDS",
        help="after Ctrl-C, what open requests get to finish before they are cancelled (default %(default)s)",
    )
    add_runtime(p)
    p.set_defaults(run=run)


def adapter_spec(text: str) -> tuple[str | None, str]:
    name, sep, path = text.partition("=")
    return (name, path) if sep and name and not os.path.exists(text) else (None, text)


def run(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: F401  (edgelm[serve]: missing, it is named before anything loads)

    from edgelm.serve import Engine, Settings, create_app
    from edgelm.serve.server import Server

    logging.basicConfig(level=logging.INFO, format="edgelm serve: %(message)s", stream=sys.stderr)
    log = logging.getLogger("edgelm.serve")
    model = open_model(args)  # a GGUF file or model folder: exported into the cache once (edgelm/cache.py)
    for spec in args.adapter:
        name, path = adapter_spec(spec)
        model.load_adapter(path, name=name)
    template = None if args.chat_template is None else Path(args.chat_template).read_text(encoding="utf-8")
    settings = Settings(
        parallel=args.parallel,
        queue=args.queue,
        prompt_cache=args.prompt_cache,
        max_tokens=args.max_tokens,
        chat_template=template,
    )
    engine = Engine(model, name=args.model_name or model.spec.folder.name, settings=settings)
    app = create_app(engine, api_key=args.api_key or None)
    listening = _listen(args.host, args.port)  # a taken port is a one-line error before anything is printed
    if args.api_key is None and not _loopback(args.host):
        log.warning(f"warning: listening on {args.host} without --api-key: anyone who can reach it can use the model")
    if not engine.has_chat_template:
        log.warning(
            "warning: the package has no chat template: /v1/chat/completions answers 400 (--chat-template FILE)"
        )
    served = ", ".join(engine.model_names())
    log.info(f"serving {served} on http://{args.host}:{args.port}/v1 ({args.parallel} parallel, {args.queue} queued)")
    # Ctrl-C: open requests get --grace seconds to end, then their generations are cancelled and each ends with a
    # server_shutting_down error (a stream's last event); the exit status is then 130 (SIGTERM: 143)
    try:
        Server(app, grace_s=args.grace).run(sockets=[listening])
    finally:
        engine.close()
        listening.close()
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port; OSError naming the address when it cannot be (taken, not this machine's)."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listening = socket.socket(family, kind, protocol)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listening


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
