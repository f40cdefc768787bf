"""`edgelm info`: what a package holds, and `edgelm bench`: how fast it runs (runtime/bench.py)."""

from __future__ import annotations

import argparse

from . import describe
from .cache import add_model_argument, open_model, resolve_draft, resolve_model
from .options import add_command, add_json, add_runtime, add_speculative, add_verify, int_in
from .text import printable, to_json


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "info",
        help="what a package (or a GGUF file or model folder, through the cache) holds",
        description="Describe a package: architecture, precision and what its weights really are, the export "
        "check explained, a quantized package's own accuracy report, the chat sampling, and whether its files were "
        "verified against their sha256. --json prints the manifest's records as they are.",
        example="edgelm info out/int8 --json",
    )
    add_model_argument(p)
    add_json(p)
    add_verify(p)
    p.set_defaults(run=run)


# where describe.lines' words go among the facts: after this key, or instead of it
AFTER = {"source": "package", "weights": "precision", "sampling": "chat_template"}
INSTEAD = {"export_check": "parity", "accuracy": "evaluation"}


def run(args: argparse.Namespace) -> int:
    model = open_model(args, provider="cpu")
    info = model.info()
    if args.json:
        print(to_json(info, indent=2))
        return 0
    words = describe.lines(info, model.spec.manifest)
    shown = [(key, value) for key, value in info.items() if value is not None]
    for key, text in words:
        keys = [k for k, _ in shown]
        if key in INSTEAD and INSTEAD[key] in keys:
            shown[keys.index(INSTEAD[key])] = (key, text)
        else:
            at = keys.index(AFTER[key]) + 1 if AFTER.get(key) in keys else len(shown)
            shown.insert(at, (key, text))
    if info.get("parity") is not None and "export_check" not in dict(words):
        shown = [(k, v) for k, v in shown if k != "parity"] + [("parity", info["parity"])]
    for key, value in shown:
        print(f"{key:16s} {printable(to_json(value) if isinstance(value, (dict, list)) else value)}")
    return 0


def add_bench_parser(sub) -> None:
    p = add_command(
        sub,
        "bench",
        help="time to first token, decode tokens/s, load time, peak memory",
        description="Time generation on random prompts: median of --repeats runs after one warm-up.",
        example="edgelm bench out/int8 --prompt-tokens 32 --new-tokens 128",
    )
    add_model_argument(p)
    p.add_argument("--prompt-tokens", type=int_in(1), default=32, help="prompt length (default 32)")
    p.add_argument("--new-tokens", type=int_in(2), default=128, help="tokens to generate, >= 2 (default 128)")
    p.add_argument("--batch", type=int_in(1, 4096), default=1, help="prompts per batch, 1 to 4096 (default 1)")
    p.add_argument("--repeats", type=int_in(1, 1000), default=3, help="timed runs, 1 to 1000 (default 3)")
    add_speculative(p)
    add_json(p)
    add_runtime(p)
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from edgelm.runtime.bench import bench

    if args.no_verify:
        raise ValueError("bench measures load time with verification; run it on a verified package")
    resolved = resolve_model(args)  # a GGUF file or model folder is exported first, outside the timings
    resolve_draft(args)
    report = bench(
        str(resolved.path),
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        batch=args.batch,
        provider=args.provider,
        threads=args.threads,
        repeats=args.repeats,
        speculative=args.speculative,
    )
    if args.json:
        print(to_json(report, indent=2))
        return 0
    kernels = report.get("kernels")
    path = "" if kernels is None else f" ({kernels['path']} kernels{', ' + kernels['isa'] if kernels['isa'] else ''})"
    print(
        f"{printable(report['package'])}: {printable(report['precision'])} on {report['provider']}{path}, "
        f"batch {report['batch']}, {report['prompt_tokens']} prompt + {report['new_tokens']} new tokens, "
        f"median of {report['repeats']}"
    )
    print(
        f"  load {report['load_s']:.2f} s | first token {report['time_to_first_token_s'] * 1000:.1f} ms | "
        f"decode {report['decode_tokens_per_s']:.1f} tokens/s | runtime overhead "
        f"{report['runtime_overhead_pct']:.1f}% | peak RSS {report['peak_rss_mb']:.0f} MB | "
        f"size {report['size_mb']:.1f} MB"
        + (
            f" | accepted {report['accepted_tokens']} of {report['proposed_tokens']} guesses"
            if args.speculative
            else ""
        )
    )
    return 0
