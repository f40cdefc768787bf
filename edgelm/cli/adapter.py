"""`edgelm adapter convert`: a PEFT LoRA adapter folder -> an .onnx_adapter file for a package with LoRA slots
(export/lora.py convert_adapter); and `--adapter FILE`, the option generate and chat share."""

from __future__ import annotations

import argparse

from .options import add_command


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "adapter",
        help="convert a PEFT LoRA adapter for a package with LoRA slots (needs edgelm[export])",
        description="convert ADAPTER_DIR PACKAGE OUT.onnx_adapter: write the adapter's A and B for the package's "
        "LoRA slots (export it with --lora-slots) in ONNX Runtime's adapter format, ranks zero-padded to the "
        "slots', scale folded in, and OUT.onnx_adapter.json beside it (its sha256 and the base's weights hash: "
        "the runtime refuses it on another base). Use it with `edgelm generate PACKAGE ... --adapter OUT`.",
        example="edgelm adapter convert my-lora/ out/smol-slots my-lora.onnx_adapter",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    convert = actions.add_parser("convert", help="PEFT adapter folder -> .onnx_adapter for a package")
    convert.add_argument("adapter_dir", help="a PEFT LoRA folder: adapter_config.json + adapter_model.safetensors")
    convert.add_argument("package", help="the package with LoRA slots the adapter is for")
    convert.add_argument("out", help="the .onnx_adapter file to write (and OUT.json beside it)")
    convert.add_argument("--scale", type=float, default=1.0, help="multiply the adapter by this (default 1)")
    convert.add_argument("--overwrite", action="store_true", help="replace OUT and OUT.json if they exist")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from edgelm.export.lora import convert_adapter

    out = convert_adapter(args.adapter_dir, args.package, args.out, scale=args.scale, overwrite=args.overwrite)
    print(f"wrote {out} and {out.name}.json")
    return 0


def add_adapter_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", default=None, metavar="FILE", help="a LoRA .onnx_adapter for this package's slots")


def load_adapter(model, path: str | None, *, verify: bool = True) -> str | None:
    """The adapter's name once loaded into the model, or None (the base) without --adapter; verify: False with
    --no-verify (an adapter without its record)."""
    return None if path is None else model.load_adapter(path, verify=verify)
