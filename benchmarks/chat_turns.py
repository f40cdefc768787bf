"""Time to first token of each turn of a conversation: the kept KV cache against re-prefilling the whole history.

    python benchmarks/chat_turns.py PACKAGE [--turns 10] [--user-tokens 30] [--reply-tokens 30] [--repeats 3]
                                    [--threads N] [--plot docs/chat-turns.png] [--json out.json]

A greedy conversation of --turns turns, each a user message of about --user-tokens tokens and a reply of
at most --reply-tokens (about 60 tokens a turn with the template's own), held by `model.conversation()`,
which feeds only a turn's new tokens. Against it, every turn's prompt (the same ids: the whole history
rendered by the chat template) is prefilled from an empty cache, as a model without a kept cache must.
Both first tokens must agree, and the kept path's ids must equal the rendering's. Prints a markdown
table (median of --repeats) and, with matplotlib installed, writes the plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from edgelm.runtime import load
from edgelm.runtime.template import chat_prompt_ids

WORDS = (
    "tell me more about the river the mountain the old city its people their songs and what they cook "
    "in winter when the roads are closed and the markets are quiet"
).split()


def user_message(model, turn: int, tokens: int) -> str:
    """A question of about `tokens` tokens, different each turn."""
    words, text = [], ""
    while len(model.encode(text)) < tokens:
        words.append(WORDS[(turn * 7 + len(words)) % len(WORDS)])
        text = f"Question {turn + 1}: " + " ".join(words) + "?"
    return text


def kept_cache_run(model, messages: list[str], reply_tokens: int) -> list[dict]:
    conv = model.conversation(system="You are a helpful assistant.")
    rows = []
    for text in messages:
        before = [*conv.messages, {"role": "user", "content": text}]
        started = time.perf_counter()
        reply = conv.send(text, reply_tokens)
        elapsed = time.perf_counter() - started
        expected = chat_prompt_ids(conv.template, model.tokenizer, before)
        assert conv.last_turn.dropped_messages == 0, "the conversation outgrew the context: lower --turns"
        assert reply.prompt_token_ids == expected, "the kept cache was fed other ids than the full rendering"
        rows.append(
            {
                "messages": before,
                "prompt_ids": reply.prompt_token_ids,
                "first_token": reply.token_ids[0] if reply.token_ids else None,
                "kept_ttft_s": reply.timings.time_to_first_token_s,
                "prefilled": conv.last_turn.prefilled_tokens,
                "path": conv.last_turn.path,
                "reply_tokens": len(reply.token_ids),
                "turn_s": elapsed,
            }
        )
    return rows


def reprefill_ttft(model, template, messages: list[dict], ids: list[int]) -> tuple[float, int | None]:
    """Render and tokenize the history (as the kept path does too), then prefill it all from an empty cache."""
    started = time.perf_counter()
    rendered = chat_prompt_ids(template, model.tokenizer, messages)
    encoded = time.perf_counter() - started
    assert rendered == ids
    result = model.generate(rendered, 1)
    return encoded + result.timings.time_to_first_token_s, (result.token_ids[0] if result.token_ids else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--user-tokens", type=int, default=30)
    parser.add_argument("--reply-tokens", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--plot", default="docs/chat-turns.png", help="where to write the plot ('' for none)")
    parser.add_argument("--json", default=None, help="also write the measurements here")
    return parser


def measure_turns(model, messages: list[dict], args) -> list[dict]:
    """Per turn: the median first-token time with the kept cache and with a re-prefill of the whole history."""
    kept_cache_run(model, messages[:2], args.reply_tokens)  # warm-up: sessions allocate on first use
    template = model.conversation().template
    runs = [kept_cache_run(model, messages, args.reply_tokens) for _ in range(args.repeats)]
    base = runs[0]
    for run in runs[1:]:
        assert [r["prompt_ids"] for r in run] == [r["prompt_ids"] for r in base], "greedy runs differ"
    table = []
    for turn, row in enumerate(base):
        full = [reprefill_ttft(model, template, row["messages"], row["prompt_ids"]) for _ in range(args.repeats)]
        assert all(token == row["first_token"] for _, token in full), f"turn {turn + 1}: first tokens differ"
        kept = statistics.median(run[turn]["kept_ttft_s"] for run in runs)
        again = statistics.median(seconds for seconds, _ in full)
        table.append(
            {
                "turn": turn + 1,
                "prompt_tokens": len(row["prompt_ids"]),
                "prefilled_kept": row["prefilled"],
                "path": row["path"],
                "kept_ttft_ms": kept * 1000,
                "reprefill_ttft_ms": again * 1000,
                "speedup": again / kept if kept > 0 else float("inf"),
            }
        )
    return table


def print_table(table: list[dict], info: dict, device: str, repeats: int) -> None:
    print(f"{info['package']}: {info['precision']}, {info['kv_cache']} cache, on {device}, median of {repeats}")
    print()
    print(
        "| turn | prompt tokens | prefilled (kept cache) | first token, kept cache (ms) "
        "| first token, re-prefill (ms) | speedup |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['prefilled_kept']} ({r['path']}) | {r['kept_ttft_ms']:.1f} "
            f"| {r['reprefill_ttft_ms']:.1f} | {r['speedup']:.1f}x |"
        )


def main() -> int:
    args = build_parser().parse_args()
    model = load(args.package, provider=args.provider, threads=args.threads)
    messages = [user_message(model, turn, args.user_tokens) for turn in range(args.turns)]
    table = measure_turns(model, messages, args)
    info = model.info()
    print_table(table, info, model.device, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({"package": info["package"], "turns": table}, indent=2))
    if args.plot:
        plot(table, Path(args.plot), title=f"{Path(info['package']).name} ({info['precision']}, {model.device})")
    return 0


def plot(table: list[dict], path: Path, *, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    turns = [r["turn"] for r in table]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(turns, [r["reprefill_ttft_ms"] for r in table], "o-", label="re-prefill the whole history")
    ax.plot(turns, [r["kept_ttft_ms"] for r in table], "s-", label="kept KV cache (new tokens only)")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms)")
    ax.set_xticks(turns)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Time to first token per turn: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
