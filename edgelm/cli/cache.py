"""What generate, chat, info and bench run: a package, or a GGUF file or Hugging Face model folder exported once into
the cache (edgelm/cache.py); and `edgelm list` / `edgelm rm`, which manage that cache."""

from __future__ import annotations

import argparse
import sys
import time

from .options import add_command, add_json
from .text import printable, to_json

MODEL_HELP = (
    "a package folder, a GGUF file or a Hugging Face model folder (exported into the cache on first use, then "
    "loaded from it: see `edgelm list`)"
)


def add_model_argument(p: argparse.ArgumentParser) -> None:
    """The model positional and --no-cache, for every command that runs a model."""
    p.add_argument("package", metavar="MODEL", help=MODEL_HELP)
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="a GGUF file or model folder is exported into a temporary folder, removed at exit, instead of the "
        "cache ($EDGELM_CACHE/packages, default ~/.cache/edgelm/packages)",
    )


def resolve_model(args: argparse.Namespace, source: str | None = None):
    """The package to load for args.package (or `source`): edgelm/cache.py's Resolved, export progress on stderr."""
    from edgelm.cache import resolve

    return resolve(args.package if source is None else source, cache=not args.no_cache)


def resolve_draft(args: argparse.Namespace) -> None:
    """A --speculative draft that is a GGUF file or model folder is resolved like the model (and kept on args, so a
    temporary one lives as long as the command)."""
    from edgelm.runtime import PackageNotFoundError

    if getattr(args, "speculative", None) not in (None, "lookup"):
        try:
            args.draft = resolve_model(args, args.speculative)
        except PackageNotFoundError:
            raise PackageNotFoundError(
                f"--speculative {args.speculative}: neither 'lookup' nor an existing package folder, GGUF file or "
                "model folder"
            ) from None
        args.speculative = str(args.draft.path)


def open_model(args: argparse.Namespace, *, provider: str | None = None):
    """The runtime Model of args.package, resolved through the cache; a draft named by --speculative too."""
    from edgelm.cache import load

    resolve_draft(args)
    return load(
        args.package,
        provider=provider or args.provider,
        threads=getattr(args, "threads", None),
        verify=not args.no_verify,
        cache=not args.no_cache,
    )


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "list",
        help="the packages in the cache (GGUF files and model folders run directly)",
        description="List the cache's packages: what `edgelm chat model.gguf` and the like exported on first use. "
        "The cache is $EDGELM_CACHE/packages (default ~/.cache/edgelm/packages).",
        example="edgelm list",
    )
    add_json(p)
    p.set_defaults(run=run_list)
    p = add_command(
        sub,
        "rm",
        help="remove packages from the cache",
        description="Remove cached packages, by the name `edgelm list` shows or by the GGUF file or model folder "
        "they were exported from; --all empties the cache.",
        example="edgelm rm SmolLM2-135M-Instruct.Q4_1-0123456789abcdef",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="a cached package's name, or a GGUF file or model folder")
    p.add_argument("--all", action="store_true", help="remove every cached package")
    p.set_defaults(run=run_rm)


def run_list(args: argparse.Namespace) -> int:
    from edgelm.cache import cache_dir, entries

    found = entries()
    if args.json:
        rows = [
            {"name": e.name, "path": str(e.path), "bytes": e.bytes, "precision": e.precision, "source": e.source}
            for e in found
        ]
        print(to_json({"cache": str(cache_dir()), "packages": rows}, indent=2))
        return 0
    print(f"{printable(cache_dir())}: {len(found)} package{'s' if len(found) != 1 else ''}", file=sys.stderr)
    for e in found:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created))
        print(
            f"{printable(e.name)}  {e.bytes / 1e6:.1f} MB  {printable(e.precision)}  from {printable(e.source)}  "
            f"{created}"
        )
    return 0


def run_rm(args: argparse.Namespace) -> int:
    from edgelm.cache import entries, remove, remove_folder

    if args.all == bool(args.names):
        raise ValueError("name the cached packages to remove (see `edgelm list`), or give --all")
    removed = [e.path for e in entries()] if args.all else [path for name in args.names for path in remove(name)]
    for path in removed:
        if args.all:
            remove_folder(path)
        print(f"removed {printable(path)}", file=sys.stderr)
    return 0
