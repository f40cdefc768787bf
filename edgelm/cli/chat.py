"""`edgelm chat`: an interactive chat in the terminal, streamed, with a package that has a chat template."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .adapter import add_adapter_option, load_adapter
from .apps import add_chat_inputs, add_structured, chat_inputs, show_tool_calls, structured_options
from .cache import add_model_argument, open_model
from .options import add_command, add_runtime, add_sampling, add_speculative, describe_sampling, sampling_options
from .words import in_flags

CHAT_COMMANDS = "/reset, /undo, /stats, /exit; Ctrl-C stops a reply"


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "chat",
        help="chat in the terminal with an instruct model (a package, GGUF file or model folder)",
        description="An interactive chat, streamed, with a model that has a chat template; a GGUF file or Hugging "
        "Face model folder is exported into the cache on first use (edgelm list). Commands: /reset (new "
        "conversation), /undo (remove the last "
        "exchange), /stats (tokens/s after each reply, on or off), /exit. Ctrl-C stops a reply; at the prompt "
        "it exits, as does Ctrl-D. When the context fills, the oldest exchanges are dropped.",
        example='edgelm chat out/smol-int4 --system "You are brief." --temperature 0.7 --stats',
    )
    add_model_argument(p)
    p.add_argument("--system", default=None, help="the system message (default: the template's own, if any)")
    add_sampling(
        p,
        max_new_tokens=256,
        truncate=False,
        defaults="the sampling of the model's generation_config.json when it was exported from a folder whose "
        "file sets do_sample: true, else temperature 0.7, top-p 0.9, min-p 0.05, repetition-penalty 1.1 (a flag "
        "given replaces its one value; --greedy for exact runs)",
    )
    add_speculative(p)
    p.add_argument("--stats", action="store_true", help="print tokens/s and the tokens prefilled after each reply")
    add_chat_inputs(p)
    add_structured(p)
    add_runtime(p)
    add_adapter_option(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from edgelm.runtime import ChatTemplateError, ContextLengthError
    from edgelm.runtime.chat_defaults import model_chat_sampling

    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    model = open_model(args)
    if model.tokenizer is not None and model.spec.chat_template_path is None:
        raise ChatTemplateError(
            f"the package {model.spec.folder.name} has no chat template, so it cannot chat (a base model?); "
            f'`edgelm generate {args.package} "PROMPT"` continues a text instead'
        )
    adapter = load_adapter(model, args.adapter, verify=not args.no_verify)
    conv = model.conversation(system=args.system, adapter=adapter, **chat_inputs(args))
    conv.prompt_ids("Hello")  # a template that fails on an ordinary message fails here, not on every turn
    defaults, origin = model_chat_sampling(model)
    options = sampling_options(args, defaults) | structured_options(args)
    model.options(args.max_new_tokens, **options)  # bad options end here, not per message
    if args.max_new_tokens >= model.context_length:  # else every turn would fail the same way
        raise ContextLengthError(
            f"--max-new-tokens ({args.max_new_tokens}) must be below the context length {model.context_length}"
        )
    show_stats = args.stats
    origin = "" if args.greedy else f" ({origin}; --greedy for exact runs)"
    print(
        f"[{model.spec.folder.name}, context {model.context_length} tokens; sampling: {describe_sampling(options)}"
        f"{origin}. {CHAT_COMMANDS}]",
        file=sys.stderr,
    )
    while True:
        try:
            text = input("> ").strip()
        except EOFError:  # Ctrl-D, or the end of piped input
            print()
            return 0
        if not text:
            continue
        command = text.split()[0]
        if command in ("/exit", "/quit"):
            return 0
        if command.startswith("/") and len(command) > 1 and command[1:].isalpha():
            show_stats = _command(conv, command, show_stats)
        else:
            result = _reply(conv, text, args.max_new_tokens, options)
            if result is not None and show_stats:
                _print_stats(result.timings, conv.last_turn)


def _command(conv, command: str, show_stats: bool) -> bool:
    """Carry out a chat command; returns whether stats are shown from now on."""
    from edgelm.runtime import EdgelmError

    if command == "/reset":
        conv.reset()
        print("[new conversation]", file=sys.stderr)
    elif command == "/undo":
        try:
            conv.undo()
            print("[removed the last exchange]", file=sys.stderr)
        except EdgelmError as e:
            print(f"[{e}]", file=sys.stderr)
    elif command == "/stats":
        show_stats = not show_stats
        print(f"[stats {'on' if show_stats else 'off'}]", file=sys.stderr)
    else:
        print(f"[unknown command {command}: {CHAT_COMMANDS}]", file=sys.stderr)
    return show_stats


def _reply(conv, text: str, max_new_tokens: int, options: dict):
    """Stream the model's reply to stdout; returns its result, or None when it failed (and the chat goes on)."""
    from edgelm.runtime import EdgelmError

    cancel = threading.Event()
    # Ctrl-C while a reply streams sets cancel: the reply ends within one decode step, the chat goes on
    previous = signal.signal(signal.SIGINT, lambda *_, event=cancel: event.set())
    try:
        stream = conv.stream(text, max_new_tokens, cancel=cancel, **options)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except EdgelmError as e:  # a message too long, say: the conversation goes on
        print(f"edgelm chat: error: {' '.join(in_flags(str(e)).split())}", file=sys.stderr)
        return None
    finally:
        signal.signal(signal.SIGINT, previous)
    print()
    show_tool_calls(stream.result, sys.stderr)
    if stream.result.finish_reason == "cancelled":
        print("[stopped]", file=sys.stderr)
    return stream.result


def _print_stats(t, turn) -> None:
    """The reply's timings and how its prompt was prefilled (runtime/chat.py TurnStats)."""
    print(
        f"[{t.new_tokens} tokens, {t.decode_tokens_per_s:.1f} tokens/s, first token "
        f"{t.time_to_first_token_s * 1000:.0f} ms, prefilled {turn.prefilled_tokens} of "
        f"{turn.prompt_tokens} prompt tokens ({turn.path})"
        + (f", dropped {turn.dropped_messages} old messages" if turn.dropped_messages else "")
        + (f", {t.accepted_tokens} of {t.proposed_tokens} guessed tokens accepted" if t.proposed_tokens else "")
        + "]",
        file=sys.stderr,
    )
