"""The `edgelm` command: export, quantize, eval, generate, chat, info, bench.

generate, chat, info and bench need only the runtime (onnxruntime, numpy, tokenizers); export, quantize
and eval import their rooms lazily, so a runtime-only install runs `edgelm generate` without torch.

Exit status (README, "Errors"): 0 success; 1 any error, bad options included, as one line on stderr;
130 interrupted (Ctrl-C); 141 standard output closed by its reader (`| head`); 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import unicodedata

from edgelm import __version__

EXAMPLES = """examples:
  edgelm export models/shakespeare out/fp32
  edgelm quantize out/fp32 out/int8 --mode dynamic --eval-text data/shakespeare-heldout.txt
  edgelm generate out/int8 "ROMEO:" --max-new-tokens 80 --temperature 0.8 --top-k 40 --seed 1
  edgelm chat out/smol-int4 --system "You are brief." --temperature 0.7 --stats
  edgelm eval out/int8 --text data/shakespeare-heldout.txt --reference out/fp32
  edgelm bench out/int8 --prompt-tokens 32 --new-tokens 128

exit status: 0 success, 1 error (one line on stderr), 130 Ctrl-C, 141 stdout closed, 143 SIGTERM
"""
QUANTIZE_MODES = ("dynamic", "static", "int4", "int8-weight-only", "fp16")  # quantize/quantize.py MODES
CALIBRATION_METHODS = ("percentile", "entropy", "minmax")
OPSETS = (14, 21)  # opsets export is tested with (the fused graph's com.microsoft ops need >= 14)
MAX_THREADS = 1024


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr and exit status 1, like every other error."""

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_in(low: int, high: int | None = None, *, power_of_two: bool = False):
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


def _finite_at_least(low: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low}, got {text}")
        return value

    return parse


_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _printable(text: object) -> str:
    """Text taken from a file (a model or template name, manifest strings, an error quoting them) made safe for
    a terminal: control characters (escape sequences recolour, retitle or rewrite the screen) and bidirectional
    overrides become visible \\x.. escapes. Generated text is the model's output and is printed as it is."""
    return "".join(
        (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        if unicodedata.category(c) == "Cc" or c in _BIDI_CONTROLS
        else c
        for c in str(text)
    )


def _json(value: object, **options) -> str:
    """Valid JSON whatever a file held: NaN and infinities (json.dumps would write the invalid NaN) become null."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False, **options)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _text_file(text: str) -> str:
    """A regular file (a pipe or device would block or never end), checked before any work."""
    from edgelm.runtime.files import kind_of

    kind = kind_of(text)
    if kind is None:
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    if kind != "a regular file":
        raise argparse.ArgumentTypeError(f"{text} is {kind}, not a regular file")
    return text


def _add_sampling(p: argparse.ArgumentParser, *, truncate: bool = True) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples from softmax(logits/T)"
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set with mass >= p (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STR",
        help="stop when this string is generated (not printed); repeatable",
    )
    if truncate:
        p.add_argument(
            "--truncate-prompt",
            action="store_true",
            help="drop the oldest prompt tokens instead of failing when the context would overflow",
        )


def _add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="load without checking the files against edgelm.json's sha256; needed for a folder with no "
        "edgelm.json (an onnxruntime-genai or Optimum folder), which otherwise does not load",
    )


def _add_runtime(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--provider", choices=["cpu", "cuda", "auto"], default="auto", help="execution provider (default auto)"
    )
    p.add_argument(
        "--threads",
        type=_int_in(1, MAX_THREADS),
        default=None,
        help=f"intra-op threads, 1 to {MAX_THREADS} (default: ONNX Runtime's choice)",
    )
    _add_verify(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="edgelm",
        description="Language models (GPT-2 and Llama-family) from a Hugging Face folder or a GGUF file to a small, "
        "fast ONNX package, and a runtime for it.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"edgelm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "export",
        help="checkpoint folder or GGUF file -> ONNX model package (needs edgelm[export])",
        description="Export a model to a new package folder: an ONNX graph with KV-cache I/O, its weights, "
        "genai_config.json, tokenizer.json and tokenizer_config.json, the chat template and edgelm.json (the "
        "sha256 of every package file and of every source file read). Sources: a Hugging Face folder "
        "(config.json with model_type gpt2, llama, mistral or qwen2; model.safetensors, sharded safetensors with "
        "their index, or pytorch_model.bin; tokenizer.json; generation_config.json; chat template), or a GGUF "
        "file of architecture llama, qwen2 or gpt2, whose tokenizer.json is built from its metadata. A "
        "quantized GGUF keeps its own blocks (MatMulNBits) by default; --dequantize gives an fp32 package. "
        "Export then runs ONNX Runtime against PyTorch (prompt + decode steps) and fails above the tolerance or "
        "on any NaN/inf. The package is written beside out_dir and moved into place at the end; out_dir must "
        "not exist, or be an edgelm package (or empty folder) and --overwrite given.",
    )
    p.add_argument(
        "checkpoint",
        help="a Hugging Face model folder (gpt2, llama, mistral, qwen2) or a .gguf file (llama, qwen2, gpt2)",
    )
    p.add_argument("out_dir", help="package folder to write (must not be, contain or lie inside the checkpoint)")
    p.add_argument(
        "--opset", type=_int_in(*OPSETS), default=17, help=f"ONNX opset, {OPSETS[0]} to {OPSETS[1]} (default 17)"
    )
    p.add_argument(
        "--attention",
        choices=("fused", "standard"),
        default="fused",
        help="fused (default): ONNX Runtime's GroupQueryAttention with a KV buffer updated in place, the fast "
        "graph; standard: standard ONNX ops only, for other ONNX runtimes",
    )
    p.add_argument(
        "--last-token-logits",
        action="store_true",
        help="standard graph only: emit logits for the last position only (faster prompts; eval then needs "
        "full logits). The fused graph picks per call",
    )
    p.add_argument("--untied", action="store_true", help="store the LM head separately from the token embedding")
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="GGUF files: dequantize every weight to fp32 (a package about 4x the file). By default a GGUF "
        "file's quantized weights (Q4_0 .. Q8_0, Q2_K .. Q6_K) stay in their own blocks as MatMulNBits, exactly",
    )
    p.add_argument(
        "--keep-gguf-quantization",
        action="store_true",
        help="accepted for old scripts: keeping a GGUF file's blocks is now the default (fails for a folder)",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=(0, 4),
        default=4,
        help="kept GGUF blocks: MatMulNBits' accuracy_level, 4 (default) int8 activations, 0 float",
    )
    p.add_argument(
        "--tolerance",
        type=_finite_at_least(0.0),
        default=None,
        help="max |logit difference| allowed (default 1e-4; 1.0 for kept GGUF blocks at accuracy level 4, whose "
        "activations are int8)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace out_dir if it is an edgelm package (nothing else is ever deleted)",
    )

    p = sub.add_parser(
        "quantize",
        help="package -> quantized package (dynamic, static, int4, int8-weight-only, fp16)",
        description="Quantize a package into a new package folder and, given --eval-text, store its accuracy "
        "report against the input package. The output rules are export's.",
    )
    p.add_argument("package", help="the fp32 package to quantize")
    p.add_argument("out_dir", help="package folder to write")
    p.add_argument(
        "--mode",
        required=True,
        choices=QUANTIZE_MODES,
        help="dynamic: int8, activations scaled per call (fast; a row's output can depend on the rest of its batch); "
        "static: int8 calibrated QDQ (needs --calibration-text); int4: 4-bit blocks; int8-weight-only: 8-bit "
        "blocks, batch-invariant; fp16: for GPUs",
    )
    p.add_argument(
        "--calibration-text",
        type=_text_file,
        default=None,
        metavar="FILE",
        help="UTF-8 text to calibrate static mode on; required with --mode static (no default: it should be "
        "text like your model's input; the repo's data/shakespeare-calibration.txt suits the bundled model)",
    )
    p.add_argument(
        "--calibration-method",
        choices=CALIBRATION_METHODS,
        default="percentile",
        help="static mode's range estimate (default percentile)",
    )
    p.add_argument(
        "--calibration-samples",
        type=_int_in(1, 4096),
        default=32,
        help="calibration windows, 1 to 4096 (static; default 32)",
    )
    p.add_argument(
        "--per-channel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="per-channel int8 weights (default: on for static, on for dynamic)",
    )
    p.add_argument(
        "--block-size",
        type=_int_in(16, 256, power_of_two=True),
        default=32,
        help="int4 and int8-weight-only block size, a power of two from 16 to 256 (default 32)",
    )
    p.add_argument(
        "--int4-lm-head",
        choices=("int8", "int4"),
        default="int8",
        help="int4 mode: precision of the LM head and the tied embedding (default int8; on the bundled model "
        "93.3%% top-1 agreement at 0.192 of fp32's size, against 89.2%% at 0.175 with int4)",
    )
    p.add_argument(
        "--eval-text",
        type=_text_file,
        default=None,
        metavar="FILE",
        help="held-out UTF-8 text for the accuracy report stored in the package; without it no report is made "
        "(no default; the repo's data/shakespeare-heldout.txt suits the bundled model)",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the accuracy report even with --eval-text")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace out_dir if it is an edgelm package (nothing else is ever deleted)",
    )

    p = sub.add_parser(
        "eval",
        help="perplexity, bits per byte, agreement and KL against a reference package",
        description="Score a package on a text file; with --reference, also top-1 agreement and KL against it.",
    )
    p.add_argument("package")
    p.add_argument("--text", required=True, type=_text_file, help="UTF-8 text file to evaluate on")
    p.add_argument("--reference", default=None, help="reference package (e.g. the fp32 export)")
    p.add_argument("--max-tokens", type=_int_in(2), default=None, help="evaluate on the first N tokens only (N >= 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_runtime(p)

    p = sub.add_parser(
        "generate",
        help="generate text from a package, streaming to stdout",
        description="Generate from a prompt, streaming the text to stdout and a timing line to stderr.",
    )
    p.add_argument("package")
    p.add_argument("prompt", help="the prompt text ('' starts from the BOS token)")
    _add_sampling(p)
    _add_runtime(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, ids, finish reason, timings)")

    p = sub.add_parser(
        "chat",
        help="chat in the terminal with a package that has a chat template",
        description="An interactive chat, streamed. Commands: /reset (new conversation), /undo (remove the last "
        "exchange), /stats (tokens/s after each reply, on or off), /exit. Ctrl-C stops a reply; at the prompt "
        "it exits, as does Ctrl-D. When the context fills, the oldest exchanges are dropped.",
    )
    p.add_argument("package")
    p.add_argument("--system", default=None, help="the system message (default: the template's own, if any)")
    _add_sampling(p, truncate=False)
    p.set_defaults(max_new_tokens=256)
    p.add_argument("--stats", action="store_true", help="print tokens/s and the tokens prefilled after each reply")
    _add_runtime(p)

    p = sub.add_parser(
        "info",
        help="what a package holds",
        description="Describe a package: architecture, precision, recipe, accuracy report, and whether its "
        "files were verified against their sha256.",
    )
    p.add_argument("package")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_verify(p)

    p = sub.add_parser(
        "bench",
        help="time to first token, decode tokens/s, load time, peak memory",
        description="Time generation on random prompts: median of --repeats runs after one warm-up.",
    )
    p.add_argument("package")
    p.add_argument("--prompt-tokens", type=_int_in(1), default=32, help="prompt length (default 32)")
    p.add_argument("--new-tokens", type=_int_in(2), default=128, help="tokens to generate, >= 2 (default 128)")
    p.add_argument("--batch", type=_int_in(1, 4096), default=1, help="prompts per batch, 1 to 4096 (default 1)")
    p.add_argument("--repeats", type=_int_in(1, 1000), default=3, help="timed runs, 1 to 1000 (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_runtime(p)
    return parser


def _generate(args) -> int:
    from edgelm.runtime import load

    model = load(args.package, provider=args.provider, threads=args.threads, verify=not args.no_verify)
    options = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        truncate_prompt=args.truncate_prompt,
    )
    if args.json:
        result = model.generate(args.prompt, args.max_new_tokens, **options)
        print(_json(result.to_dict(), ensure_ascii=False))
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
        f"{t.decode_tokens_per_s:.1f} tokens/s, {_printable(model.info()['precision'])} on {model.device}]",
        file=sys.stderr,
    )
    return 0


CHAT_COMMANDS = "/reset, /undo, /stats, /exit; Ctrl-C stops a reply"


def _chat(args) -> int:
    import signal
    import threading

    from edgelm.runtime import ContextLengthError, EdgelmError, load

    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    model = load(args.package, provider=args.provider, threads=args.threads, verify=not args.no_verify)
    conv = model.conversation(system=args.system)
    options = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )
    model.check_options(args.max_new_tokens, *options.values(), None)  # bad options end here, not per message
    if args.max_new_tokens >= model.context_length:  # else every turn would fail the same way
        raise ContextLengthError(
            f"--max-new-tokens ({args.max_new_tokens}) must be below the context length {model.context_length}"
        )
    show_stats = args.stats
    print(f"[{model.spec.folder.name}, context {model.context_length} tokens. {CHAT_COMMANDS}]", file=sys.stderr)
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
        elif command.startswith("/") and len(command) > 1 and command[1:].isalpha():
            print(f"[unknown command {command}: {CHAT_COMMANDS}]", file=sys.stderr)
        else:
            cancel = threading.Event()
            # Ctrl-C while a reply streams sets cancel: the reply ends within one decode step, the chat goes on
            previous = signal.signal(signal.SIGINT, lambda *_, event=cancel: event.set())
            try:
                stream = conv.stream(text, args.max_new_tokens, cancel=cancel, **options)
                for piece in stream:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except EdgelmError as e:  # a message too long, say: the conversation goes on
                print(f"edgelm chat: error: {' '.join(str(e).split())}", file=sys.stderr)
                continue
            finally:
                signal.signal(signal.SIGINT, previous)
            print()
            result, turn = stream.result, conv.last_turn
            if result.finish_reason == "cancelled":
                print("[stopped]", file=sys.stderr)
            if show_stats:
                t = result.timings
                print(
                    f"[{t.new_tokens} tokens, {t.decode_tokens_per_s:.1f} tokens/s, first token "
                    f"{t.time_to_first_token_s * 1000:.0f} ms, prefilled {turn.prefilled_tokens} of "
                    f"{turn.prompt_tokens} prompt tokens ({turn.path})"
                    + (f", dropped {turn.dropped_messages} old messages" if turn.dropped_messages else "")
                    + "]",
                    file=sys.stderr,
                )


def _info(args) -> int:
    from edgelm.runtime import load

    info = load(args.package, provider="cpu", verify=not args.no_verify).info()
    if args.json:
        print(_json(info, indent=2))
        return 0
    for key, value in info.items():
        if value is not None:
            print(f"{key:16s} {_printable(_json(value) if isinstance(value, (dict, list)) else value)}")
    return 0


def _bench(args) -> int:
    from edgelm.runtime.bench import bench

    if args.no_verify:
        raise ValueError("bench measures load time with verification; run it on a verified package")
    report = bench(
        args.package,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        batch=args.batch,
        provider=args.provider,
        threads=args.threads,
        repeats=args.repeats,
    )
    if args.json:
        print(_json(report, indent=2))
    else:
        print(
            f"{_printable(report['package'])}: {_printable(report['precision'])} on {report['provider']}, "
            f"batch {report['batch']}, {report['prompt_tokens']} prompt + {report['new_tokens']} new tokens, "
            f"median of {report['repeats']}"
        )
        print(
            f"  load {report['load_s']:.2f} s | first token {report['time_to_first_token_s'] * 1000:.1f} ms | "
            f"decode {report['decode_tokens_per_s']:.1f} tokens/s | runtime overhead "
            f"{report['runtime_overhead_pct']:.1f}% | peak RSS {report['peak_rss_mb']:.0f} MB | "
            f"size {report['size_mb']:.1f} MB"
        )
    return 0


def _export(args) -> int:
    from edgelm.export.onnx_export import export_package

    export_package(
        args.checkpoint,
        args.out_dir,
        opset=args.opset,
        attention=args.attention,
        last_token_logits=args.last_token_logits,
        untie=args.untied,
        dequantize=args.dequantize,
        keep_gguf_quantization=args.keep_gguf_quantization,
        accuracy_level=args.accuracy_level,
        tolerance=args.tolerance,
        overwrite=args.overwrite,
    )
    return 0


def _quantize(args) -> int:
    if args.mode == "static" and args.calibration_text is None:
        raise ValueError("--mode static needs --calibration-text FILE (text like the model's input)")
    from edgelm.quantize.quantize import quantize_package

    evaluate = not args.no_eval and args.eval_text is not None
    if not evaluate and not args.no_eval:
        print("no --eval-text given: the package gets no accuracy report")
    quantize_package(
        args.package,
        args.out_dir,
        mode=args.mode,
        calibration_text=args.calibration_text,
        calibration_method=args.calibration_method,
        calibration_samples=args.calibration_samples,
        per_channel=args.per_channel,
        block_size=args.block_size,
        int4_lm_head=args.int4_lm_head,
        eval_text=args.eval_text,
        evaluate=evaluate,
        overwrite=args.overwrite,
    )
    return 0


def _eval(args) -> int:
    from edgelm.quantize.evaluate import evaluate_package, format_report

    report = evaluate_package(
        args.package,
        args.text,
        reference=args.reference,
        max_tokens=args.max_tokens,
        provider=args.provider,
        threads=args.threads,
        verify=not args.no_verify,
    )
    lines = format_report(report).splitlines()
    print(_json(report, indent=2) if args.json else "\n".join(_printable(line) for line in lines))
    return 0


COMMANDS = {
    "export": _export,
    "quantize": _quantize,
    "eval": _eval,
    "generate": _generate,
    "chat": _chat,
    "info": _info,
    "bench": _bench,
}
EXTRA_FOR = {"export": "export", "quantize": "export", "eval": "export"}
WRITES_STDOUT = {"generate", "info", "bench", "eval"}  # commands whose product is their standard output


def _error(command: str, message: str) -> None:
    message = _printable(" ".join(str(message).split()))
    try:
        print(f"edgelm {command}: error: {message}", file=sys.stderr)
    except (OSError, ValueError, AttributeError):  # stderr closed too: the exit status says it
        pass


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


def main(argv: list[str] | None = None) -> int:
    command = "edgelm"
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        if sys.stdout is None:  # started with stdout closed (`>&-`)
            if command in WRITES_STDOUT:
                _error(command, "standard output is closed; redirect it to a file or /dev/null instead")
                return 1
            sys.stdout = open(os.devnull, "w")  # export/quantize only print progress there
        return COMMANDS[command](args)
    except KeyboardInterrupt:
        _error(command, "interrupted")
        return 130
    except BrokenPipeError:  # `edgelm generate ... | head -c1`: the reader has what it wanted
        _silence_stdout()
        return 141
    except MemoryError as e:
        _error(command, f"out of memory: {e}" if str(e) else "out of memory")
    except ImportError as e:
        if _SIGINTS:  # numpy, for one, turns a Ctrl-C during its import into an ImportError
            _error(command, "interrupted")
            return 130
        if isinstance(e, ModuleNotFoundError):
            extra = EXTRA_FOR.get(command)
            hint = f"; install it with: pip install 'edgelm[{extra}]'" if extra else ""
            _error(command, f"missing Python package {e.name!r}{hint}")
        else:
            _error(command, f"cannot import {e.name or 'a module'}: {str(e).splitlines()[0] if str(e) else e!r}")
    except (ValueError, OSError, RuntimeError) as e:  # EdgelmError subclasses ValueError/FileNotFoundError
        _error(command, str(e) or type(e).__name__)
    except SystemExit as e:  # SIGTERM while a package was being written (runtime/outputs.py), or argparse
        if isinstance(e.code, int) and e.code > 128:
            _error(command, "terminated; the partial package was removed")
        raise
    return 1


if __name__ == "__main__":
    sys.exit(main())
