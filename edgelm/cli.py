"""The `edgelm` command: export, quantize, eval, generate, info, bench.

generate, info and bench need only the runtime (onnxruntime, numpy, tokenizers); export, quantize
and eval import their rooms lazily, so a runtime-only install runs `edgelm generate` without torch.
Bad input prints one line on stderr and exits 1; argparse usage errors exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from edgelm import __version__

EXAMPLES = """examples:
  edgelm export models/shakespeare out/fp32
  edgelm quantize out/fp32 out/int8 --mode dynamic
  edgelm generate out/int8 "ROMEO:" --max-new-tokens 80 --temperature 0.8 --top-k 40 --seed 1
  edgelm eval out/int8 --text data/heldout.txt --reference out/fp32
  edgelm bench out/int8 --prompt-tokens 32 --new-tokens 128
"""


def _add_sampling(p: argparse.ArgumentParser) -> None:
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
    p.add_argument(
        "--truncate-prompt",
        action="store_true",
        help="drop the oldest prompt tokens instead of failing when the context would overflow",
    )


def _add_runtime(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--provider", choices=["cpu", "cuda", "auto"], default="auto", help="execution provider (default auto)"
    )
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's choice)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the package files")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgelm",
        description="GPT-style models from a PyTorch checkpoint to a small, fast ONNX package, and a runtime for it.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"edgelm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "export",
        help="checkpoint folder -> ONNX model package (needs edgelm[export])",
        description="Export a GPT-2-layout checkpoint folder (config.json + model.safetensors or "
        "pytorch_model.bin, + tokenizer files) to a model package with KV-cache I/O, then check "
        "ONNX Runtime against PyTorch.",
    )
    p.add_argument("checkpoint", help="checkpoint folder (Hugging Face GPT-2 layout)")
    p.add_argument("out_dir", help="package folder to write")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
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
        "--keep-gguf-quantization",
        action="store_true",
        help="GGUF files: keep Q4_0 / Q4_1 / Q8_0 linear weights in their own blocks (MatMulNBits) instead of "
        "dequantizing them to fp32: an int4 package with no second rounding",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=(0, 4),
        default=4,
        help="with --keep-gguf-quantization: MatMulNBits' accuracy_level, 4 (default) int8 activations, 0 float",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max |logit difference| allowed (default 1e-4; 1.0 for kept GGUF blocks at accuracy level 4, whose "
        "activations are int8)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")

    p = sub.add_parser(
        "quantize",
        help="package -> quantized package (dynamic, static, int4, fp16)",
        description="Quantize a package into a new one and store its accuracy report.",
    )
    p.add_argument("package")
    p.add_argument("out_dir")
    p.add_argument("--mode", required=True, help="dynamic | static | int4 | fp16")
    p.add_argument("--calibration-text", default=None, help="text file for static calibration (default: bundled)")
    p.add_argument(
        "--calibration-method", default="percentile", help="percentile (default) | entropy | minmax (static)"
    )
    p.add_argument("--calibration-samples", type=int, default=32, help="calibration windows (static)")
    p.add_argument(
        "--per-channel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="per-channel int8 weights (default: on for static, on for dynamic)",
    )
    p.add_argument("--block-size", type=int, default=32, help="int4 block size (default 32)")
    p.add_argument(
        "--int4-lm-head",
        choices=("int8", "int4"),
        default="int8",
        help="int4 mode: precision of the LM head and the tied embedding (default int8; on the bundled model "
        "93.3%% top-1 agreement at 0.192 of fp32's size, against 89.2%% at 0.175 with int4)",
    )
    p.add_argument("--eval-text", default=None, help="held-out text for the accuracy report (default: bundled)")
    p.add_argument("--no-eval", action="store_true", help="skip the accuracy report")
    p.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")

    p = sub.add_parser("eval", help="perplexity, bits per byte, agreement and KL against a reference package")
    p.add_argument("package")
    p.add_argument("--text", required=True, help="UTF-8 text file to evaluate on")
    p.add_argument("--reference", default=None, help="reference package (e.g. the fp32 export)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate on the first N tokens only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_runtime(p)

    p = sub.add_parser("generate", help="generate text from a package, streaming to stdout")
    p.add_argument("package")
    p.add_argument("prompt", help="the prompt text ('' starts from the BOS token)")
    _add_sampling(p)
    _add_runtime(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, ids, finish reason, timings)")

    p = sub.add_parser("info", help="what a package holds")
    p.add_argument("package")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the package files")

    p = sub.add_parser("bench", help="time to first token, decode tokens/s, load time, peak memory")
    p.add_argument("package")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
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
        print(json.dumps(result.to_dict(), ensure_ascii=False))
        return 0
    stream = model.stream(args.prompt, args.max_new_tokens, **options)
    for piece in stream:  # Ctrl-C propagates to main(): the loop stops between two pieces
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    r = stream.result
    t = r.timings
    print(
        f"[{t.new_tokens} tokens, finish: {r.finish_reason}, first token {t.time_to_first_token_s * 1000:.0f} ms, "
        f"{t.decode_tokens_per_s:.1f} tokens/s, {model.info()['precision']} on {model.device}]",
        file=sys.stderr,
    )
    return 0


def _info(args) -> int:
    from edgelm.runtime import load

    info = load(args.package, provider="cpu", verify=not args.no_verify).info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if value is not None:
            print(f"{key:16s} {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return 0


def _bench(args) -> int:
    from edgelm.runtime.bench import bench

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
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['package']}: {report['precision']} on {report['provider']}, batch {report['batch']}, "
            f"{report['prompt_tokens']} prompt + {report['new_tokens']} new tokens, median of {report['repeats']}"
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
        keep_gguf_quantization=args.keep_gguf_quantization,
        accuracy_level=args.accuracy_level,
        tolerance=args.tolerance,
        overwrite=args.overwrite,
    )
    return 0


def _quantize(args) -> int:
    from edgelm.quantize.quantize import quantize_package

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
        evaluate=not args.no_eval,
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
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


COMMANDS = {
    "export": _export,
    "quantize": _quantize,
    "eval": _eval,
    "generate": _generate,
    "info": _info,
    "bench": _bench,
}
EXTRA_FOR = {"export": "export", "quantize": "export", "eval": "export"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ModuleNotFoundError as e:
        extra = EXTRA_FOR.get(args.command)
        hint = f"; install it with: pip install 'edgelm[{extra}]'" if extra else ""
        print(f"edgelm {args.command}: error: missing Python package {e.name!r}{hint}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"edgelm {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:  # EdgelmError subclasses ValueError/FileNotFoundError
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"edgelm {args.command}: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
