"""The `edgelm` command: export, quantize, eval, generate, chat, info, bench, adapter, serve, list, rm.

Each command's options and handler live together in a module of this package (export.py, quantize.py for
quantize and eval, generate.py, chat.py, info.py for info and bench); the option groups several commands share
are defined once in options.py. generate, chat, info and bench need only the runtime (onnxruntime, numpy,
tokenizers); export, quantize and eval import their rooms lazily, so a runtime-only install runs `edgelm generate`
without torch.

Exit status (README, "Errors"): 0 success; 1 any error, bad options included, as one line on stderr;
130 interrupted (Ctrl-C); 141 standard output closed by its reader (`| head`); 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
import threading
import warnings

from edgelm.writers.version import __version__

from . import adapter, cache, chat, export, generate, info, quantize, serve
from .options import HELP_WIDTH, Parser
from .text import printable
from .words import in_flags

__all__ = ["build_parser", "main"]

EXAMPLES = """examples:
  edgelm chat SmolLM2-135M-Instruct.Q4_K_M.gguf      (exported into the cache once: edgelm list, edgelm rm)
  edgelm export models/shakespeare out/fp32
  edgelm quantize out/fp32 out/int8 --mode dynamic --eval-text data/shakespeare-heldout.txt
  edgelm generate out/int8 "ROMEO:" --max-new-tokens 80 --temperature 0.8 --top-k 40 --seed 1
  edgelm chat out/smol-int4 --system "You are brief." --temperature 0.7 --stats
  edgelm eval out/int8 --text data/shakespeare-heldout.txt --reference out/fp32
  edgelm bench out/int8 --prompt-tokens 32 --new-tokens 128

exit status: 0 success, 1 error (one line on stderr), 130 Ctrl-C, 141 stdout closed, 143 SIGTERM
"""
# Each adds its command's parser, whose defaults carry `run`, the command's handler; in the order --help lists.
ADD_PARSERS = (
    export.add_parser,
    quantize.add_parser,
    quantize.add_eval_parser,
    generate.add_parser,
    chat.add_parser,
    info.add_parser,
    info.add_bench_parser,
    adapter.add_parser,
    serve.add_parser,
    cache.add_parser,
)
EXTRA_FOR = {"export": "export", "quantize": "export", "eval": "export", "adapter": "export", "serve": "serve"}
WRITES_STDOUT = {"generate", "info", "bench", "eval", "list"}  # commands whose product is their standard output


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="edgelm",
        description=textwrap.fill(
            "Language models from a Hugging Face folder or a GGUF file to a small, fast ONNX package, and a runtime "
            "for it (`edgelm export --help` lists the model families).",
            HELP_WIDTH,
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"edgelm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in ADD_PARSERS:
        add_parser(sub)
    parser.commands = sub.choices  # each command's parser, for the hints of Parser.parse_args
    return parser


def _say(command: str, kind: str, message: str) -> None:
    """One line on stderr: `edgelm CMD: error: ...` or `edgelm CMD: warning: ...`."""
    message = printable(" ".join(in_flags(str(message)).split()))
    try:
        print(f"edgelm {command}: {kind}: {message}", file=sys.stderr)
    except (OSError, ValueError, AttributeError):  # stderr closed too: the exit status says it
        pass


def _error(command: str, message: str) -> None:
    _say(command, "error", message)


def _show_warnings_as_one_line(command: str) -> None:
    """The library's warnings (speculative decoding off for a package, say) as one line each: `edgelm CMD:
    warning: ...`, without Python's file and source line."""
    warnings.showwarning = lambda message, *_, **__: _say(command, "warning", message)


def _silence_stdout() -> None:
    """After the reader closed stdout: point fd 1 at /dev/null, so the interpreter's final flush does
    not print a BrokenPipeError of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


_SIGINTS: list[int] = []  # Ctrl-Cs seen: an import interrupted by one can surface as an ImportError


def _on_sigint(number, frame) -> None:
    _SIGINTS.append(number)
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    """Run a parsed command line's command; its exit status."""
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        if args.command in WRITES_STDOUT:
            _error(args.command, "standard output is closed; redirect it to a file or /dev/null instead")
            return 1
        sys.stdout = open(os.devnull, "w")  # export/quantize only print progress there
    return args.run(args)


def _import_error(command: str, e: ImportError) -> int:
    if _SIGINTS:  # numpy, for one, turns a Ctrl-C during its import into an ImportError
        _error(command, "interrupted")
        return 130
    if isinstance(e, ModuleNotFoundError):
        extra = EXTRA_FOR.get(command)
        hint = f"; install it with: pip install 'edgelm[{extra}]'" if extra else ""
        _error(command, f"missing Python package {e.name!r}{hint}")
    else:
        _error(command, f"cannot import {e.name or 'a module'}: {str(e).splitlines()[0] if str(e) else e!r}")
    return 1


def main(argv: list[str] | None = None) -> int:
    command = "edgelm"
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        _show_warnings_as_one_line(command)
        return _run(args)
    except KeyboardInterrupt:
        _error(command, "interrupted")
        return 130
    except BrokenPipeError:  # `edgelm generate ... | head -c1`: the reader has what it wanted
        _silence_stdout()
        return 141
    except MemoryError as e:
        _error(command, f"out of memory: {e}" if str(e) else "out of memory")
    except ImportError as e:
        return _import_error(command, e)
    except (ValueError, OSError, RuntimeError) as e:  # EdgelmError subclasses ValueError/FileNotFoundError
        _error(command, str(e) or type(e).__name__)
    except SystemExit as e:  # SIGTERM while a package was being written (writers/package_writer.py), or argparse
        if isinstance(e.code, int) and e.code > 128:
            _error(command, "terminated; the partial package was removed")
        raise
    return 1
