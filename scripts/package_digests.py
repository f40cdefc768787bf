"""The sha256 of every file of every family case's packages: what a refactoring must leave unchanged.

    python scripts/package_digests.py OUT.json [--cases gpt2,qwen3] [--work DIR]
    python scripts/package_digests.py OUT.json --against BEFORE.json     # exit 1 naming each file that differs

Every case of tests/family_cases.py is exported from its folder (fused and, where its row builds it, standard
graph) and, where the case has one, from its GGUF file; the fused folder package is then quantized int4, dynamic
int8 and fp16, and the GGUF package exported again with its blocks packed (--packed-blocks). The random weights
come from fixed seeds, so the same code writes the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

QUANTIZED = ("int4", "dynamic", "fp16")


def _digests(package: Path) -> dict[str, str]:
    return {
        path.relative_to(package).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(package.rglob("*"))
        if path.is_file()
    }


def collect(cases: list[str], work: Path) -> dict[str, dict[str, str]]:
    from family_cases import CASES, Families
    from helpers import quiet

    from edgelm.export.onnx_export import export_package
    from edgelm.quantize.quantize import quantize_package

    families = Families(work)
    result: dict[str, dict[str, str]] = {}
    for name in cases:
        case = CASES[name]
        for graph in case.graphs:
            result[f"{name}/{graph}"] = _digests(families.package(name, graph))
            print(f"{name}/{graph}", flush=True)
        fused = families.package(name, "fused")
        for mode in QUANTIZED:
            out = work / f"{name}-{mode}"
            try:
                quantize_package(fused, out, mode=mode, evaluate=False, progress=quiet)
            except ValueError as refused:  # a mode a case's graph cannot take (fp16 of shared caches): its message
                result[f"{name}/fused-{mode}"] = {"refused": hashlib.sha256(str(refused).encode()).hexdigest()}
                continue
            result[f"{name}/fused-{mode}"] = _digests(out)
        if case.gguf:
            result[f"{name}/gguf"] = _digests(families.package(name, "gguf"))
            packed = work / f"{name}-gguf-packed"
            export_package(families.gguf(name), packed, packed_blocks=True, progress=quiet)
            result[f"{name}/gguf-packed"] = _digests(packed)
        print(name, "done", flush=True)
    return result


def differences(before: dict, after: dict) -> list[str]:
    lines = []
    for package in sorted(set(before) | set(after)):
        old, new = before.get(package, {}), after.get(package, {})
        for file in sorted(set(old) | set(new)):
            if old.get(file) != new.get(file):
                lines.append(f"{package}/{file}: {old.get(file, 'absent')[:12]} -> {new.get(file, 'absent')[:12]}")
    return lines


def main() -> int:
    from family_cases import CASES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON file of digests to write")
    parser.add_argument("--cases", help="comma-separated case names (default: every case)")
    parser.add_argument("--work", type=Path, help="where the packages are written (default: a temporary folder)")
    parser.add_argument("--against", type=Path, help="a JSON file of digests to compare with; exit 1 if any differ")
    args = parser.parse_args()
    cases = args.cases.split(",") if args.cases else list(CASES)
    with tempfile.TemporaryDirectory() as temporary:
        result = collect(cases, args.work or Path(temporary))
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.against:
        before = json.loads(args.against.read_text())
        before = {k: v for k, v in before.items() if k.split("/")[0] in cases}
        lines = differences(before, result)
        for line in lines:
            print(line)
        print(f"{len(result)} packages: {'the same bytes' if not lines else f'{len(lines)} files differ'}")
        return 1 if lines else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
