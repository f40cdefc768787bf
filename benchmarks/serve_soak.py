"""A long-running `edgelm serve`: its memory over many mixed requests, then Ctrl-C with open streams.

    python benchmarks/serve_soak.py [--package PKG --adapter NAME=FILE] [--requests 10000] [--out result.json]

Soak: starts `edgelm serve` as a subprocess on 127.0.0.1 (by default on the bundled Shakespeare model exported
with rank-4 LoRA slots, a random adapter "pirate" and a short tool-use chat template, all made in a temporary
folder), then a few client threads (httpx) send --requests requests drawn from a fixed mix: chat, streamed
chat, streams the client closes after their first event, adapter requests, JSON-schema answers and forced tool
calls (each with a schema or tool of its own, so a cache keyed by them would grow), completions streamed or
not, and bad requests (OpenAI errors expected). The server's RSS (/proc/PID/status VmRSS) is read every
--sample-every requests; the result reports it after --warmup requests and at the end, the least-squares slope
in MB per 1,000 requests after the warm-up, and counts by request kind and status.

Shutdown: a second server on a tiny random Llama with a 16k context (greedy streams of thousands of tokens
outlast the grace period), --streams streams and one waiting request open, then SIGINT: the time to exit, the
exit status, how each client saw its stream end, and whether the log holds a traceback.

Loopback only; every loop is bounded in count and every wait in time. The numbers are memory, not speed: on a
shared machine the request rate says little.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO / "models" / "shakespeare"
MB = 2**20
WAIT_S = 60  # the longest one request or start waits
# A ChatML-like template short enough for a 128-token context; writing <tool_call> makes the runtime read
# tool calls in the hermes convention (docs/apps.md), so a forced tool_choice is a grammar over the tool's schema.
TEMPLATE = (
    "{%- if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}; call as <tool_call>"
    '{"name": N, "arguments": A}</tool_call>\n{% endif %}'
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant:{% endif %}"
)
WORDS = "moon sun king crown sword rose night day love war friend foe heart hand blood tears".split()
MIX = {  # request kind: weight
    "chat": 12,
    "chat_stream": 12,
    "cancel": 10,
    "adapter_chat": 8,
    "adapter_completion": 6,
    "schema": 10,
    "tool": 10,
    "completion": 12,
    "completion_stream": 10,
    "bad": 10,
}
BAD = [  # (body, what makes it bad): each must be answered with an OpenAI error object
    (b"{not json", "invalid_json"),
    ({"model": "{model}", "messages": []}, "no messages"),
    ({"model": "nobody", "prompt": "x"}, "unknown model"),
    ({"model": "{model}", "prompt": "x", "n": 2}, "n > 1"),
    ({"model": "{model}", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "{model}", "prompt": "moon " * 400}, "context length"),
    ({"model": "{model}", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, "tool spec"),
    (
        {
            "model": "{model}",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema"},
        },
        "schema missing",
    ),  # fmt: skip
    ({"model": "{model}", "prompt": "x", "max_tokens": "5"}, "lax type"),
]


# ---- packages --------------------------------------------------------------------------------------------------


def make_soak_package(root: Path) -> tuple[Path, list[str]]:
    """The bundled model with rank-4 LoRA slots on attention, and a random adapter; (package, --adapter specs)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from edgelm.export.lora import SlotSpec, convert_adapter
    from edgelm.export.onnx_export import export_package

    targets = ["c_attn", "attn.c_proj"]
    package = root / "shakespeare-slots"
    export_package(SHAKESPEARE, package, lora_slots=SlotSpec(targets, 4), progress=lambda *_: None)
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel.from_pretrained(SHAKESPEARE).eval()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, fan_in_fan_out=True)
    get_peft_model(hf, config).save_pretrained(root / "pirate")
    adapter = convert_adapter(root / "pirate", package, root / "pirate.onnx_adapter")
    return package, [f"pirate={adapter}"]


def make_long_package(root: Path) -> Path:
    """A tiny random Llama (2 layers, 64 wide) with a 16,384-token context and the bundled tokenizer."""
    import shutil

    import torch
    import transformers

    from edgelm.export.onnx_export import export_package

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=128, max_position_embeddings=16384, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True, initializer_range=0.1,
    )  # fmt: skip
    folder = root / "long-checkpoint"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHAKESPEARE / name, folder / name)
    package = root / "long"
    export_package(folder, package, progress=lambda *_: None)
    return package


# ---- the server ------------------------------------------------------------------------------------------------


class Served:
    """`edgelm serve PACKAGE` as a subprocess on a free loopback port, its stderr in a log file."""

    def __init__(self, package: Path, log: Path, *args: str):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url, self.log, self.name = f"http://127.0.0.1:{self.port}", log, package.name
        command = [sys.executable, "-m", "edgelm", "serve", str(package), "--host", "127.0.0.1"]
        self.stderr = open(log, "w")
        self.process = subprocess.Popen([*command, "--port", str(self.port), *args], stderr=self.stderr)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"edgelm serve did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc/PID/status")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(WAIT_S)
        self.stderr.close()


# ---- the mix ---------------------------------------------------------------------------------------------------


def request_for(kind: str, number: int, rng: random.Random, model: str, adapter: str | None) -> tuple[str, object]:
    """(route, body) of request `number` of `kind`; schemas and tools differ from request to request."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
    messages = [{"role": "user", "content": f"{words}?"}]
    if rng.random() < 0.3:  # a shared system message: the prompt cache reuses its prefix
        messages.insert(0, {"role": "system", "content": "Be brief."})
    sampling = {"temperature": rng.choice([0, 0.8]), "seed": number, "max_tokens": rng.randint(1, 12)}
    if kind in ("chat", "chat_stream", "adapter_chat"):
        body = {"model": adapter if kind == "adapter_chat" else model, "messages": messages, **sampling}
        return "/v1/chat/completions", body | {"stream": kind == "chat_stream" or rng.random() < 0.3}
    if kind == "cancel":
        route = rng.choice(["/v1/chat/completions", "/v1/completions"])
        prompt = {"messages": messages} if route.endswith("chat/completions") else {"prompt": words}
        return route, {"model": model, **prompt, "max_tokens": 90, "temperature": 0.8, "seed": number, "stream": True}
    if kind == "schema":
        values = [f"{rng.choice(WORDS)}{number % 1000}", rng.choice(WORDS)]
        schema = {
            "type": "object",
            "properties": {"answer": {"enum": values}},
            "required": ["answer"],
            "additionalProperties": False,
        }
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{number}", "schema": schema}}
        body = {"model": model, "messages": messages, **sampling, "max_tokens": 40, "response_format": response_format}
        return "/v1/chat/completions", body | {"stream": rng.random() < 0.3}
    if kind == "tool":
        name = f"tool_{number % 997}"
        parameters = {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        }
        tool = {"type": "function", "function": {"name": name, "parameters": parameters}}
        choice = {"type": "function", "function": {"name": name}} if rng.random() < 0.7 else "auto"
        # a call is 54 tokens, the prompt up to 70 without a system message: within the 128-token context
        body = {"model": model, "messages": messages[-1:], **sampling, "max_tokens": 56, "tools": [tool]}
        return "/v1/chat/completions", body | {"tool_choice": choice, "stream": rng.random() < 0.3}
    if kind in ("completion", "completion_stream", "adapter_completion"):
        body = {"model": adapter if kind == "adapter_completion" else model, "prompt": words, **sampling}
        return "/v1/completions", body | {"stream": kind == "completion_stream"}
    assert kind == "bad", kind
    body, _ = BAD[number % len(BAD)]
    if isinstance(body, dict):
        body = json.loads(json.dumps(body).replace("{model}", model))
    return rng.choice(["/v1/chat/completions", "/v1/completions"]), body


def send(client: httpx.Client, url: str, route: str, body, kind: str) -> str:
    """One request; its outcome: the status, then the finish reason, or for a stream how it ended ("done",
    "error_event", "closed" by this client, "cut")."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if not (isinstance(body, dict) and body.get("stream")):
        response = client.post(url + route, content=content, headers=headers)
        if response.status_code != 200:
            assert "error" in response.json(), response.text
            return str(response.status_code)
        return f"200 {response.json()['choices'][0]['finish_reason']}"
    with client.stream("POST", url + route, content=content, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            return str(response.status_code)
        last = None
        for line in response.iter_lines():
            if line.startswith("data: "):
                last = line
                if kind == "cancel":
                    return "200 closed"  # leaving the with block closes the connection mid-stream
        if last == "data: [DONE]":
            return "200 done"
        return "200 error_event" if last and '"error"' in last else "200 cut"


def soak(server: Served, args: argparse.Namespace, adapter: str | None) -> dict:
    kinds = [kind for kind in MIX if adapter or not kind.startswith("adapter")]
    weights = [MIX[kind] for kind in kinds]
    plan_rng = random.Random(args.seed)
    plan = plan_rng.choices(kinds, weights, k=args.requests)
    lock, position, done = threading.Lock(), [0], [0]
    counts: Counter[str] = Counter()
    samples: list[tuple[int, float]] = []  # (requests done, RSS MB)
    failures: list[str] = []
    deadline = time.monotonic() + args.time_limit

    def next_sample(number: int) -> None:
        if number == args.warmup or (number > args.warmup and number % args.sample_every == 0):
            samples.append((number, server.rss_mb()))

    def client_loop(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        with httpx.Client(timeout=WAIT_S) as client:
            while time.monotonic() < deadline:
                with lock:
                    number = position[0]
                    if number >= len(plan):
                        return
                    position[0] += 1
                kind = plan[number]
                route, body = request_for(kind, number, rng, server.name, adapter)
                try:
                    outcome = send(client, server.url, route, body, kind)
                except (httpx.HTTPError, AssertionError, ValueError) as error:
                    outcome = f"client error {type(error).__name__}"
                    with lock:
                        failures.append(f"{kind} {route}: {error!r}"[:300])
                with lock:
                    counts[f"{kind} {outcome}"] += 1
                    done[0] += 1
                    next_sample(done[0])

    started = time.monotonic()
    rss_before = server.rss_mb()
    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.time_limit + WAIT_S)
    elapsed = time.monotonic() - started
    if samples[-1][0] != done[0]:
        samples.append((done[0], server.rss_mb()))
    after_warmup = [(n, rss) for n, rss in samples if n >= args.warmup]
    health = httpx.get(f"{server.url}/health", timeout=WAIT_S).json()
    log = server.log.read_text()
    by_kind: Counter[str] = Counter()
    by_status: Counter[str] = Counter()
    for key, count in counts.items():
        kind, outcome = key.split(" ", 1)
        by_kind[kind] += count
        by_status[outcome.split()[0]] += count
    return {
        "requests": done[0],
        "seconds": round(elapsed, 1),
        "rss_mb_before_warmup": round(rss_before, 1),
        "rss_mb_start": round(after_warmup[0][1], 1),
        "rss_mb_end": round(after_warmup[-1][1], 1),
        "rss_mb_max": round(max(rss for _, rss in after_warmup), 1),
        "slope_mb_per_1000": round(slope(after_warmup) * 1000, 3),
        "slope_mb_per_1000_second_half": round(slope(after_warmup[len(after_warmup) // 2 :]) * 1000, 3),
        "samples": [[n, round(rss, 1)] for n, rss in samples],
        "by_kind": dict(sorted(by_kind.items())),
        "by_status": dict(sorted(by_status.items())),
        "by_kind_and_outcome": dict(sorted(counts.items())),
        "client_failures": failures[:20],
        "health_after": health,
        "log_lines": log.count("\n"),
        "log_tracebacks": log.count("Traceback"),
    }


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of RSS (MB) over requests."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


# ---- Ctrl-C ----------------------------------------------------------------------------------------------------


def shutdown(server: Served, *, streams: int, grace_s: float) -> dict:
    """Open `streams` long streams (their slots all taken) and one waiting request, SIGINT, and see how each ends."""
    body = {"model": server.name, "prompt": "ROMEO:", "max_tokens": 16000, "temperature": 0, "stream": True}
    opened = threading.Semaphore(0)
    outcomes: list[dict] = [{} for _ in range(streams)]

    def read(outcome: dict) -> None:
        events = 0
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events += 1
                        outcome["last"] = line[:200]
                        if events == 1:
                            opened.release()
            last = outcome.get("last", "")
            outcome["ended"] = "done" if last == "data: [DONE]" else "error_event" if '"error"' in last else "cut"
        except httpx.HTTPError as error:
            outcome["ended"] = f"transport error: {error!r}"[:200]
        finally:
            outcome["events"] = events
            if events == 0:
                opened.release()

    waiting: dict = {}

    def post() -> None:
        try:
            response = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=WAIT_S)
            waiting["status"], waiting["code"] = response.status_code, response.json().get("error", {}).get("code")
        except httpx.HTTPError as error:
            waiting["error"] = repr(error)

    readers = [threading.Thread(target=read, args=(outcome,), daemon=True) for outcome in outcomes]
    for reader in readers:
        reader.start()
    for _ in readers:
        opened.acquire(timeout=WAIT_S)
    poster = threading.Thread(target=post, daemon=True)
    poster.start()
    time.sleep(0.3)  # the waiting request is accepted first
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGINT)
    try:
        status = server.process.wait(grace_s + WAIT_S)
    except subprocess.TimeoutExpired:
        status = None
    exit_s = time.monotonic() - signalled
    for thread in (*readers, poster):
        thread.join(WAIT_S)
    server.stderr.flush()
    log = server.log.read_text()
    return {
        "grace_s": grace_s,
        "exit_s": round(exit_s, 2),
        "exit_status": status,
        "streams": [{"ended": o.get("ended"), "events": o.get("events")} for o in outcomes],
        "waiting_request": waiting,
        "log_tracebacks": log.count("Traceback"),
        "log_error_lines": [line for line in log.splitlines() if "ERROR" in line][:10],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, help="a package to soak (default: the bundled model with LoRA slots)")
    parser.add_argument("--adapter", action="append", default=None, help="NAME=FILE for --package (repeatable)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--time-limit", type=float, default=3600, help="seconds the soak may send requests")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per slot")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streams", type=int, default=4, help="streams open at SIGINT")
    parser.add_argument("--grace", type=float, default=5.0, help="the server's --grace for the SIGINT part")
    parser.add_argument("--skip-soak", action="store_true")
    parser.add_argument("--skip-shutdown", action="store_true")
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    args = parser.parse_args()
    assert 0 < args.warmup < args.requests and args.sample_every > 0 and args.clients > 0
    result: dict = {"cpu": cpu_name(), "command": " ".join(["python", *sys.argv])}
    runtime = ["--threads", str(args.threads), "--parallel", str(args.parallel)]
    with tempfile.TemporaryDirectory(prefix="edgelm-soak-") as tmp:
        root = Path(tmp)
        if not args.skip_soak:
            if args.package is None:
                package, adapters = make_soak_package(root)
            else:
                package, adapters = args.package, args.adapter or []
            (root / "template.jinja").write_text(TEMPLATE)
            extra = [f"--adapter={spec}" for spec in adapters] + ["--chat-template", str(root / "template.jinja")]
            adapter = adapters[0].partition("=")[0] if adapters else None
            server = Served(package, root / "soak.log", *runtime, *extra)
            try:
                result["soak"] = {
                    "package": str(package),
                    "adapters": adapter is not None,
                    **soak(server, args, adapter),
                }
            finally:
                server.close()
            print(json.dumps({k: v for k, v in result["soak"].items() if k != "by_kind_and_outcome"}, indent=1))
        if not args.skip_shutdown:
            long_package = make_long_package(root)
            every_stream = ["--threads", str(args.threads), "--parallel", str(args.streams), "--grace", str(args.grace)]
            server = Served(long_package, root / "shutdown.log", *every_stream)  # each stream in a slot of its own
            try:
                result["shutdown"] = shutdown(server, streams=args.streams, grace_s=args.grace)
            finally:
                server.close()
            print(json.dumps(result["shutdown"], indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
