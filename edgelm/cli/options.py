"""What every command's options are made of: the parser class, argument types, and the option groups that
several commands share (sampling, provider/threads/verification, output), each defined once here."""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Callable

from .words import invalid_choice, unrecognized

HELP_WIDTH = 78  # argparse wraps option help to the terminal; descriptions are wrapped to this


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr and exit status 1, like every other error; a
    mistyped flag or command gets a close match ("--max-tokens": did you mean --max-new-tokens?); a description
    may be a function, called when the help is printed (export's reads the family table, which needs torch:
    building the parser for every command must not import it)."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # the command's parser knows its flags; argparse would report them without
            command = getattr(self, "commands", {}).get(getattr(parsed, "command", None), self)
            options = [flag for action in command._actions for flag in action.option_strings]
            command.error(unrecognized(extras, options))
        return parsed

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {invalid_choice(message)} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        if callable(self.description):
            self.description = textwrap.fill(self.description(), HELP_WIDTH)
        return super().format_help()


def add_command(
    sub, name: str, *, help: str, description: str | Callable[[], str], example: str
) -> argparse.ArgumentParser:
    """A command's parser: its description (wrapped, as the raw formatter keeps the example's lines; a function's
    when the help is printed), then an example of its use under the options."""
    return sub.add_parser(
        name,
        help=help,
        description=description if callable(description) else textwrap.fill(description, HELP_WIDTH),
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def int_in(low: int, high: int | None = None, *, power_of_two: bool = False):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high) or (power_of_two and value & (value - 1)):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            kind = "a power of two " if power_of_two else "an integer "
            raise argparse.ArgumentTypeError(f"must be {kind}{bound}, got {text}")
        return value

    return parse


def thread_count(text: str) -> int:
    """--threads: 1 to the CPUs this process may use (the runtime's bound, imported only when the flag is given)."""
    from edgelm.runtime.session import max_threads

    return int_in(1, max_threads())(text)


def finite_at_least(low: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low}, got {text}")
        return value

    return parse


def text_file(text: str) -> str:
    """A regular file (a pipe or device would block or never end), checked before any work."""
    from edgelm.runtime.files import kind_of

    kind = kind_of(text)
    if kind is None:
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    if kind != "a regular file":
        raise argparse.ArgumentTypeError(f"{text} is {kind}, not a regular file")
    return text


def fraction(*, low_open: bool, high_open: bool):
    """A number in the interval from 0 to 1, each end open or closed: (0, 1] for top-p, [0, 1) for min-p."""
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text!r}") from None
        below = value <= 0 if low_open else value < 0
        above = value >= 1 if high_open else value > 1
        if not math.isfinite(value) or below or above:
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text}")
        return value

    return parse


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p")  # what --greedy replaces


def add_sampling(
    p: argparse.ArgumentParser, *, max_new_tokens: int = 64, truncate: bool = True, defaults: str = "greedy"
) -> None:
    """generate's and chat's sampling options (chat has no --truncate-prompt: it drops old exchanges). Every
    sampling flag defaults to None, so sampling_options can tell a flag given from the command's defaults
    (`defaults`: how help states them)."""
    g = p.add_argument_group("sampling", f"default: {defaults}")
    g.add_argument(
        "--max-new-tokens",
        type=int_in(0),
        default=max_new_tokens,
        help="tokens to generate at most (default %(default)s)",
    )
    g.add_argument("--greedy", action="store_true", help="always the most likely token: exact, reproducible runs")
    g.add_argument(
        "--temperature", type=finite_at_least(0.0), default=None, help="0 = greedy; >0 samples from softmax(logits/T)"
    )
    g.add_argument("--top-k", type=int_in(0), default=None, help="sample among the k most likely tokens (0 = off)")
    g.add_argument(
        "--top-p",
        type=fraction(low_open=True, high_open=False),
        default=None,
        help="nucleus sampling: smallest set with mass >= p (1 = off)",
    )
    g.add_argument(
        "--min-p",
        type=fraction(low_open=False, high_open=True),
        default=None,
        help="drop tokens below min-p x the top probability (0 = off)",
    )
    g.add_argument("--repetition-penalty", type=positive, default=None, help="> 1 discourages repeats (1 = off)")
    g.add_argument("--seed", type=int_in(0), default=None, help="random seed for reproducible sampling")
    g.add_argument(
        "--stop",
        type=nonempty,
        action="append",
        default=None,
        metavar="STR",
        help="stop when this string is generated (not printed); repeatable",
    )
    if truncate:
        g.add_argument(
            "--truncate-prompt",
            action="store_true",
            help="drop the oldest prompt tokens instead of failing when the context would overflow",
        )


def add_speculative(p: argparse.ArgumentParser) -> None:
    """generate's, chat's and bench's speculative decoding (runtime/speculative.py)."""
    p.add_argument(
        "--speculative",
        default=None,
        metavar="lookup|PACKAGE",
        help="speculative decoding, same output: 'lookup' guesses from the prompt and output so far; a package "
        "folder with the same tokenizer guesses with that (smaller) model. Batch 1 only",
    )


def sampling_options(args: argparse.Namespace, defaults: dict | None = None) -> dict:
    """The sampling options of add_sampling (and add_speculative) as keyword arguments of Model.generate/stream and
    Conversation.stream (without max_new_tokens, which those take by position): each flag given, else its value in
    `defaults` (chat's: runtime/chat_defaults.py), else the runtime's own (greedy). --greedy takes no sampling
    flag and sets temperature 0; a --repetition-penalty still applies."""
    given = {name for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}
    if getattr(args, "greedy", False):
        if given:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in sorted(given))
            raise ValueError(f"--greedy always takes the most likely token; drop {flags} or --greedy")
        defaults = {"temperature": 0.0}
    options = dict(defaults or {})
    names = (*SAMPLING_FLAGS, "repetition_penalty", "seed", "stop", "truncate_prompt", "speculative")
    options |= {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    return options


def describe_sampling(options: dict) -> str:
    """The sampling options in flag words: "temperature 0.7, top-p 0.9, ..." or "greedy"."""
    if options.get("temperature", 0.0) == 0.0 or options.get("top_k") == 1:
        words = ["greedy"]
    else:
        words = [f"{name.replace('_', '-')} {options[name]:g}" for name in SAMPLING_FLAGS if name in options]
    if options.get("repetition_penalty", 1.0) != 1.0:
        words.append(f"repetition-penalty {options['repetition_penalty']:g}")
    return ", ".join(words)


def add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="load without checking the files against edgelm.json's sha256; needed for a folder with no "
        "edgelm.json (an onnxruntime-genai or Optimum folder), which otherwise does not load",
    )


def add_runtime(p: argparse.ArgumentParser) -> None:
    """Where a package runs: eval, generate, chat and bench."""
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--provider", choices=["cpu", "cuda", "auto"], default="auto", help="execution provider (default auto)"
    )
    g.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="intra-op threads, 1 to the number of CPUs (default: ONNX Runtime's choice)",
    )
    add_verify(g)


def add_overwrite(p: argparse.ArgumentParser) -> None:
    """export's and quantize's output rule."""
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace out_dir if it is an edgelm package (nothing else is ever deleted)",
    )


def add_json(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--json", action="store_true", help=f"print one JSON object{what}")
