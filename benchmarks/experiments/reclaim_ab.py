"""Peak memory with and without reclaiming a session's read pages while it builds (runtime/session.py
`reclaiming_read_pages`; docs/results.md, "Read pages reclaimed while a session builds").

    python benchmarks/experiments/reclaim_ab.py export FILE.gguf [FILE.gguf ...] --dir /work/big-scratch/ab
    python benchmarks/experiments/reclaim_ab.py load PACKAGE [PACKAGE ...]

`export` runs `edgelm export FILE OUT` twice per file, reclaiming on and off, each in a child under
`/usr/bin/time -v`, then checks both wrote the same bytes and deletes them; off is the code as it was (no reclaiming,
and no pages dropped after the proof's build either). `load` runs benchmarks/kquant_step.py's `memory` (load, 16
tokens) with reclaiming on and off (off: the pages left are still dropped after the build, as the runtime did). Each
line: the peak RSS (time's kbytes x 1024, decimal GB) and the wall time.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
# the code before reclaiming: MADV_NORMAL (a hint that changes nothing) in place of MADV_PAGEOUT; the runtime dropped
# the pages left after its build (MADV_DONTNEED) already, export's proof did not
OFF_LOAD = "import edgelm.runtime.session as s; s._MADV_PAGEOUT = 0; "
OFF_EXPORT = OFF_LOAD + "s._drop_read_weight_pages = lambda folder: None; "


def timed(code: str) -> tuple[float, str, str]:
    """Runs `python -c code` under /usr/bin/time -v: (peak GB, wall time, the child's last line)."""
    done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"failed: {done.stderr.strip().splitlines()[-1:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) * 1024 / 1e9
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", done.stderr).group(1)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "logit difference" in line or "RSS" in line]
    return peak, wall, (lines[-1].strip() if lines else "")


def export(files: list[Path], folder: Path) -> None:
    for file in files:
        outs = {}
        for mode in ("on", "off"):
            out = folder / f"{file.stem}-{mode}"
            argv = ["edgelm", "export", str(file), str(out), "--overwrite"]
            code = (OFF_EXPORT if mode == "off" else "") + f"import sys; sys.argv = {argv!r}; "
            code += "from edgelm.cli import main; sys.exit(main())"
            peak, wall, line = timed(code)
            size = sum(f.stat().st_size for f in out.iterdir()) / 1e9
            print(f"{file.name} reclaiming {mode}: peak {peak:.2f} GB, wall {wall}, package {size:.3f} GB, {line}")
            outs[mode] = out
        same = filecmp.cmp(outs["on"] / "model.onnx.data", outs["off"] / "model.onnx.data", shallow=False)
        print(f"{file.name}: {'the same bytes' if same else 'DIFFERENT BYTES'}", flush=True)
        for out in outs.values():
            shutil.rmtree(out)


def load(packages: list[Path]) -> None:
    for package in packages:
        for mode in ("on", "off"):
            argv = ["kquant_step", "memory", str(package)]
            code = (OFF_LOAD if mode == "off" else "") + f"import sys, runpy; sys.argv = {argv!r}; "
            code += f"runpy.run_path({str(BENCHMARKS / 'kquant_step.py')!r}, run_name='__main__')"
            peak, wall, line = timed(code)
            print(f"{package.name} reclaiming {mode}: peak {peak:.2f} GB, wall {wall}; {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("export", "load"))
    parser.add_argument("paths", nargs="+", type=Path, help="GGUF files (export) or packages (load)")
    parser.add_argument("--dir", type=Path, default=Path("reclaim-ab"), help="where export writes its packages")
    args = parser.parse_args()
    if args.what == "export":
        args.dir.mkdir(parents=True, exist_ok=True)
        export(args.paths, args.dir)
    else:
        load(args.paths)


if __name__ == "__main__":
    main()
