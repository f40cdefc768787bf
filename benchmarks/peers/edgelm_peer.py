"""edgelm in benchmarks/peers/peers.py: export (the fused graph) and quantize through the CLI a user runs, then the
runtime's `generate(ignore_eos=True)`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from peer_common import CALIBRATION, timed_child

EDGELM_MODES = {
    "fp32": None,
    "int8-dynamic": "dynamic",
    "int8-static": "static",
    "int8-weight-only": "int8-weight-only",  # the int8 edgelm recommends for Llama-family models
    "int4": "int4",
}
PRECISIONS = tuple(EDGELM_MODES)


def build_edgelm_packages(checkpoint: Path, out: Path, *, rebuild: bool) -> dict[str, Path]:
    """edgelm export, then quantize in each mode, each in a child process (the CLI a user runs)."""
    packages = {}
    for precision, mode in EDGELM_MODES.items():
        package = out / f"edgelm-{precision}"
        packages[precision] = package
        if (package / "edgelm.json").is_file() and not rebuild:
            print(f"  {package.name}: reusing (--rebuild to redo)", flush=True)
            continue
        edgelm = [sys.executable, "-m", "edgelm"]
        if mode is None:
            command = [*edgelm, "export", str(checkpoint), str(package), "--overwrite"]
        else:
            command = [*edgelm, "quantize", str(packages["fp32"]), str(package), "--mode", mode, "--no-eval"]
            command += ["--overwrite", "--calibration-text", str(CALIBRATION), "--calibration-samples", "8"]
        print(f"  {package.name}: {timed_child(command):.1f} s", flush=True)
    return packages


def child_edgelm(path: str, prompt: list[int], args) -> dict:
    from edgelm.runtime import load

    started = time.perf_counter()
    model = load(path, provider="cpu", threads=args.threads)  # verifies every file's sha256
    load_s = time.perf_counter() - started

    def run(new_tokens: int) -> dict:
        result = model.generate(prompt, new_tokens, ignore_eos=True)
        t = result.timings
        return {
            "ttft_s": t.time_to_first_token_s,
            "decode_tokens_per_s": t.decode_tokens_per_s,
            "token_ids": result.token_ids,
        }

    run(4)
    return {"load_s": load_s, "runs": [run(args.new_tokens) for _ in range(args.repeats)]}
