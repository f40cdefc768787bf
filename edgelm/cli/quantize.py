"""`edgelm quantize`: a package -> a quantized package (quantize/quantize.py), and `edgelm eval`: its accuracy
against a reference package (quantize/evaluate.py)."""

from __future__ import annotations

import argparse

from edgelm.quantize.modes import CALIBRATION_METHODS, LM_HEADS, MODES, mode_summaries

from .options import add_command, add_json, add_overwrite, add_runtime, int_in, text_file
from .text import printable, to_json


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "quantize",
        help=f"package -> quantized package ({', '.join(MODES)})",
        description="Quantize a package into a new package folder and, given --eval-text, store its accuracy "
        "report against the input package. The output rules are export's.",
        example="edgelm quantize out/fp32 out/int8 --mode dynamic --eval-text data/shakespeare-heldout.txt",
    )
    p.add_argument("package", help="the fp32 package to quantize")
    p.add_argument("out_dir", help="package folder to write")
    p.add_argument(
        "--mode",
        required=True,
        choices=tuple(MODES),
        help=mode_summaries(),
    )
    _add_calibration(p)
    p.add_argument(
        "--per-channel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="per-channel int8 weights (default: on for static, on for dynamic)",
    )
    p.add_argument(
        "--block-size",
        type=int_in(16, 256, power_of_two=True),
        default=32,
        help="int4 and int8-weight-only block size, a power of two from 16 to 256 (default 32)",
    )
    p.add_argument(
        "--int4-lm-head",
        choices=LM_HEADS,
        default="int8",
        help="int4 mode: precision of the LM head and the tied embedding (default int8: more accurate, a little "
        'larger; docs/results.md, "int4: what each lever gave", has the measurements)',
    )
    _add_eval_text(p)
    add_overwrite(p)
    p.set_defaults(run=run)


def _add_calibration(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calibration-text",
        type=text_file,
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
        type=int_in(1, 4096),
        default=32,
        help="calibration windows, 1 to 4096 (static; default 32)",
    )


def _add_eval_text(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--eval-text",
        type=text_file,
        default=None,
        metavar="FILE",
        help="held-out UTF-8 text for the accuracy report stored in the package; without it no report is made "
        "(no default; the repo's data/shakespeare-heldout.txt suits the bundled model)",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the accuracy report even with --eval-text")


def run(args: argparse.Namespace) -> int:
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


def add_eval_parser(sub) -> None:
    p = add_command(
        sub,
        "eval",
        help="perplexity, bits per byte, agreement and KL against a reference package",
        description="Score a package on a text file; with --reference, also top-1 agreement and KL against it.",
        example="edgelm eval out/int8 --text data/shakespeare-heldout.txt --reference out/fp32",
    )
    p.add_argument("package")
    p.add_argument("--text", required=True, type=text_file, help="UTF-8 text file to evaluate on")
    p.add_argument("--reference", default=None, help="reference package (e.g. the fp32 export)")
    p.add_argument("--max-tokens", type=int_in(2), default=None, help="evaluate on the first N tokens only (N >= 2)")
    p.add_argument(
        "--window",
        type=int_in(2),
        default=None,
        help="tokens each sliding window scores with (default: the context length, at most 2048); memory and time "
        "grow with it",
    )
    add_json(p)
    add_runtime(p)
    p.set_defaults(run=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from edgelm.quantize.evaluate import evaluate_package, format_report

    report = evaluate_package(
        args.package,
        args.text,
        reference=args.reference,
        max_tokens=args.max_tokens,
        window=args.window,
        provider=args.provider,
        threads=args.threads,
        verify=not args.no_verify,
    )
    lines = format_report(report).splitlines()
    print(to_json(report, indent=2) if args.json else "\n".join(printable(line) for line in lines))
    return 0
