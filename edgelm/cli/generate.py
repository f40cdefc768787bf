"""`edgelm generate`: text from a prompt, streamed to stdout, with a timing line on stderr."""

from __future__ import annotations

import argparse
import sys

from .adapter import add_adapter_option, load_adapter
from .apps import add_structured, structured_options
from .cache import add_model_argument, open_model
from .options import add_command, add_json, add_runtime, add_sampling, add_speculative, sampling_options
from .text import printable, to_json


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "generate",
        help="generate text from a package, GGUF file or model folder, streaming to stdout",
        description="Generate from a prompt, streaming the text to stdout and a timing line to stderr. Greedy "
        "(exact, reproducible) unless a sampling flag is given. A GGUF file or Hugging Face model folder is "
        "exported into the cache on first use (edgelm list).",
        example='edgelm generate out/int8 "ROMEO:" --max-new-tokens 80 --temperature 0.8 --top-k 40 --seed 1',
    )
    add_model_argument(p)
    p.add_argument("prompt", help="the prompt text ('' starts from the BOS token)")
    p.add_argument(
        "--no-bos",
        action="store_true",
        help="tokenize the prompt without the BOS (or other special tokens) the tokenizer adds to text "
        "(add_special_tokens=False; see docs/tokenization.md)",
    )
    add_sampling(p)
    add_speculative(p)
    add_structured(p)
    add_runtime(p)
    add_adapter_option(p)
    add_json(p, " (text, ids, finish reason, timings)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    model = open_model(args)
    adapter = load_adapter(model, args.adapter, verify=not args.no_verify)
    options = sampling_options(args) | structured_options(args) | {"adapter": adapter}
    options["add_special_tokens"] = not args.no_bos
    if args.json:
        result = model.generate(args.prompt, args.max_new_tokens, **options)
        print(to_json(result.to_dict(), ensure_ascii=False))
        return 0
    stream = model.stream(args.prompt, args.max_new_tokens, **options)
    for piece in stream:  # Ctrl-C propagates to main(): the loop stops between two pieces
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    r = stream.result
    t = r.timings
    print(
        f"[{t.new_tokens} tokens, finish: {r.finish_reason}, first token {t.time_to_first_token_s * 1000:.0f} ms, "
        f"{t.decode_tokens_per_s:.1f} tokens/s, {printable(model.info()['precision'])} on {model.device}"
        + (f", {t.accepted_tokens} of {t.proposed_tokens} guessed tokens accepted" if args.speculative else "")
        + "]",
        file=sys.stderr,
    )
    return 0
