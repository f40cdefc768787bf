"""The latency `edgelm serve` adds to a request: the official openai client over loopback HTTP against calling
the Python API directly, for the same greedy generation.

    python benchmarks/serve_overhead.py PACKAGE [--requests 20] [--max-tokens 8] [--threads N] [--json out.json]

Per request kind, --requests short requests, the direct call and the HTTP one interleaved (drift hits both
alike); each pair must produce the same token count. Chat (when the package has a chat template): Model.chat
against POST /v1/chat/completions with the prompt cache off (both prefill the whole prompt), streamed and not,
then with the prompt cache on (the server feeds only the ids it does not hold). Completions: Model.generate
against POST /v1/completions, with the openai client and with plain httpx; and GET /health, the HTTP round trip
alone. Prints a markdown table of medians and the median of the per-pair differences.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import httpx
import openai

from edgelm.runtime import load
from edgelm.serve import Engine, Settings, create_app, serve_in_thread

SYSTEM = (
    "You are a helpful assistant for a small bookshop. You answer questions about opening hours, orders, "
    "deliveries and returns. Keep every answer short and friendly, and say so when you do not know something. "
    "The shop opens from nine to six on weekdays and from ten to four on Saturdays; it is closed on Sundays."
)
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
PROMPT = "ROMEO:"


def timed(call) -> tuple[float, int]:
    started = time.perf_counter()
    tokens = call()
    return time.perf_counter() - started, tokens


def measure(direct, served, requests: int, *, same: bool = True) -> dict:
    """Medians (ms) of interleaved direct and served calls, each returning its completion-token count; same: the
    counts must agree (not with the prompt cache on an int4 package, whose one-token step after a reused prefix
    can pick another greedy token than a whole prefill: docs/serve.md)."""
    direct(), served()  # warm-up: sessions allocate on first use, the client opens its connection
    pairs = []
    for _ in range(requests):
        (direct_s, direct_tokens), (served_s, served_tokens) = timed(direct), timed(served)
        assert not same or direct_tokens == served_tokens, f"token counts differ: {direct_tokens} vs {served_tokens}"
        pairs.append((direct_s, served_s))
    direct_ms = statistics.median(d for d, _ in pairs) * 1000
    served_ms = statistics.median(s for _, s in pairs) * 1000
    added = statistics.median((s - d) for d, s in pairs) * 1000
    tokens = f"{direct_tokens}" if direct_tokens == served_tokens else f"{direct_tokens} / {served_tokens}"
    return {"direct_ms": direct_ms, "served_ms": served_ms, "added_ms": added, "tokens": tokens}


def chat_rows(model, args) -> dict:
    rows = {}
    for cache, label in ((0, "off"), (4, "on")):
        engine = Engine(model, name="bench", settings=Settings(parallel=1, prompt_cache=cache))
        with serve_in_thread(create_app(engine)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

            def direct():
                return len(model.chat(MESSAGES, args.max_tokens, temperature=0).token_ids)

            def served(client=client):
                reply = client.chat.completions.create(
                    model="bench", messages=MESSAGES, max_tokens=args.max_tokens, temperature=0
                )
                return reply.usage.completion_tokens

            def served_stream(client=client):
                stream = client.chat.completions.create(
                    model="bench",
                    messages=MESSAGES,
                    max_tokens=args.max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                return [chunk for chunk in stream][-1].usage.completion_tokens

            rows[f"chat, prompt cache {label}"] = measure(direct, served, args.requests, same=cache == 0)
            if cache == 0:
                rows["chat streamed, prompt cache off"] = measure(direct, served_stream, args.requests)
        engine.close()
    return rows


def completion_rows(model, args) -> dict:
    engine = Engine(model, name="bench", settings=Settings(parallel=1))
    with serve_in_thread(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def direct():
            return len(model.generate(PROMPT, args.max_tokens, temperature=0).token_ids)

        def served():
            reply = client.completions.create(model="bench", prompt=PROMPT, max_tokens=args.max_tokens, temperature=0)
            return reply.usage.completion_tokens

        http = httpx.Client()
        body = {"model": "bench", "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}

        def served_raw():  # the same request without the openai client's own work
            return http.post(f"{url}/v1/completions", json=body).json()["usage"]["completion_tokens"]

        rows = {"completions": measure(direct, served, args.requests)}
        rows["completions, httpx instead of openai"] = measure(direct, served_raw, args.requests)
        health = [timed(lambda: http.get(f"{url}/health") and 0)[0] for _ in range(args.requests)]
        rows["GET /health (the HTTP round trip alone)"] = {
            "direct_ms": 0.0,
            "served_ms": statistics.median(health) * 1000,
            "added_ms": statistics.median(health) * 1000,
            "tokens": "0",
        }
    engine.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = load(args.package, provider="cpu", threads=args.threads)
    rows = chat_rows(model, args) if model.spec.chat_template_path else {}
    rows |= completion_rows(model, args)
    print(f"{model.spec.folder.name}, {os.cpu_count()} CPUs, median of {args.requests}, up to {args.max_tokens} tokens")
    print()
    print("| request | tokens | direct API (ms) | through the server (ms) | added (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        cells = f"{row['tokens']} | {row['direct_ms']:.1f} | {row['served_ms']:.1f} | {row['added_ms']:+.1f}"
        print(f"| {name} | {cells} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"package": str(args.package), "requests": args.requests, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
