"""The table of export's proof against deliberate mistakes (tests/mistakes.py): for each model, the correct graph's
figures and, for each mistake that applies, whether the proof refused it and its figure, so the margin between
the worst correct case and the best wrong one is read off one table (docs/export.md, "The proof").

Models: the tiny family cases of tests/export/test_proof.py (float path and the realistic int8 files) and the two real
files (scripts/fetch_real_models.py), whose kept blocks take the int8-activation path.

    python benchmarks/proof_mistakes.py --out benchmarks/results/proof_mistakes.json            # everything
    python benchmarks/proof_mistakes.py --only real                                            # the real files
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "export"), str(REPO / "scripts")]

from fetch_real_models import fetch  # noqa: E402
from mistakes import MISTAKES, NotApplicable, injected  # noqa: E402

from edgelm.export.onnx_export import export_package  # noqa: E402

FIGURE = re.compile(r"max \|logit difference\|(?: is)? ([0-9.e+-]+) > ([0-9.e+-]+)")


def _record(manifest: dict | None, error: Exception | None) -> dict:
    if error is not None:
        match = FIGURE.search(str(error))
        figure, allowed = (float(match[1]), float(match[2])) if match else (None, None)
        return {"refused": True, "figure": figure, "allowed": allowed, "error": str(error)[:200]}
    parity = manifest["parity"]
    row = {"refused": False, "figure": parity["max_abs_logit_diff"], "allowed": parity["tolerance"]}
    if "int8" in parity:
        row["int8"] = {k: parity["int8"][k] for k in ("max_abs_logit_diff", "mean_kl", "max_kl", "top1_agreement")}
    return row


def _run(source: Path, mistake: str | None, work: Path) -> dict | None:
    out = work / f"pkg-{mistake}"
    try:
        if mistake is None:
            return _record(export_package(source, out, progress=lambda _: None, overwrite=True), None)
        with injected(mistake):
            return _record(export_package(source, out, progress=lambda _: None, overwrite=True), None)
    except NotApplicable:
        return None
    except RuntimeError as error:
        return _record(None, error)


def _sources(only: str, work: Path) -> dict[str, Path]:
    sources = {}
    if only in ("all", "tiny"):
        from family_cases import Families
        from gguf import GGMLQuantizationType as Q
        from test_gguf import write_gguf
        from test_gguf_export import KEEP_KINDS

        families = Families(work / "families")
        for case in ("llama-llama3-tied", "qwen3", "gemma3_text", "gemma4_text-shared"):
            sources[f"tiny {case} (float)"] = families.model(case)[1]
        for name, kinds in {"Q8_0": (Q.Q8_0,), "mixed": KEEP_KINDS}.items():
            (work / name).mkdir()
            sources[f"tiny llama, real statistics, {name} (int8)"] = write_gguf(
                work / name, "llama", kinds=kinds, real_stats=True
            )
    if only in ("all", "real"):
        sources["SmolLM2-135M-Instruct Q4_1 (int8)"] = fetch("smollm2")
        sources["Gemma 3 270M Q4_K_M (int8)"] = fetch("gemma3")
    return sources


def markdown(table: dict) -> str:
    """The table for docs: a row per mistake, a column per model; each cell the figure and R (refused) or P."""
    models = list(table)
    mistakes = ["correct"] + [m for m in MISTAKES if any(m in rows for rows in table.values())]
    lines = ["| mistake | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
    for mistake in mistakes:
        cells = []
        for model in models:
            row = table[model].get(mistake)
            if row is None:
                cells.append("n/a")
            else:
                figure = "?" if row["figure"] is None else f"{row['figure']:.2g}"
                cells.append(f"{figure} {'refused' if row['refused'] else 'passed'}")
        lines.append(f"| {mistake} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("all", "tiny", "real"), default="all")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    parser.add_argument("--markdown", type=Path, default=None, help="print the table of this JSON file and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    table = {}
    with tempfile.TemporaryDirectory(prefix="edgelm-proof-") as tmp:
        for label, source in _sources(args.only, Path(tmp)).items():
            rows = {"correct": _run(source, None, Path(tmp))}
            for mistake in MISTAKES:
                row = _run(source, mistake, Path(tmp))
                if row is not None:
                    rows[mistake] = row
            table[label] = rows
            for mistake, row in rows.items():
                verdict = "refused" if row["refused"] else "passed"
                figure, allowed = ("?" if row[k] is None else f"{row[k]:.2e}" for k in ("figure", "allowed"))
                print(f"{label:45s} {mistake:22s} {verdict:8s} {figure:>9} (allowed {allowed})")
            sys.stdout.flush()
    if args.out:
        args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
