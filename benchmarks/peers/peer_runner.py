"""The runner of benchmarks/peers/peers.py: which systems this machine has, one child process per system,
precision and prompt (`child_main` inside it, `bench_in_child` around it), and the loop over prompts that
fills the rows, with each precision's memory-bandwidth bound."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llamacpp_peer
import numpy as np
import optimum_peer
from edgelm_peer import child_edgelm
from genai_peer import child_genai
from peer_common import (
    GENAI_BUILDER,
    GENAI_ON_EDGELM,
    GENAI_ON_OPTIMUM,
    LLAMACPP,
    LLAMACPP_SHIPPED,
    OPTIMUM,
    PEERS_SCRIPT,
    busy_cpu_seconds,
    folder_bytes,
    peak_rss_mb,
)
from transformers_peer import child_transformers

CHILD_TIMEOUT_S = 1800
CHILDREN = {
    "transformers": child_transformers,
    "optimum": optimum_peer.child_optimum,
    "onnxruntime-genai": child_genai,
    "edgelm": child_edgelm,
    "llamacpp": llamacpp_peer.child_llamacpp,
}


# ---- inside the child ---------------------------------------------------------------------------


def child_main(args) -> int:
    prompt = json.loads(Path(args.prompt_file).read_text())
    report = CHILDREN[args.child](args.path, prompt, args)
    runs = report.pop("runs")
    assert all(r["token_ids"] == runs[0]["token_ids"] for r in runs), "greedy output changed between repetitions"
    report.update(
        ttft_s=statistics.median(r["ttft_s"] for r in runs),
        decode_tokens_per_s=statistics.median(r["decode_tokens_per_s"] for r in runs),
        all_decode_tokens_per_s=[r["decode_tokens_per_s"] for r in runs],
        token_ids=runs[0]["token_ids"],
        peak_rss_mb=peak_rss_mb(),
    )
    print(json.dumps(report))
    return 0


# ---- around the child ---------------------------------------------------------------------------


def bench_in_child(child: str, path: Path, prompt_file: Path, args, *, python: str = sys.executable) -> dict:
    """Runs one system in a child of `python`; also reports the share of the machine's CPU that other
    processes used meanwhile (busy time of the machine minus the child's own), so contention is visible."""
    command = [python, str(PEERS_SCRIPT), "--child", child, "--path", str(path), "--prompt-file", str(prompt_file)]
    command += ["--threads", str(args.threads), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, started = busy_cpu_seconds(), time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    wall, busy = time.perf_counter() - started, busy_cpu_seconds() - busy_before
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": last}
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["other_cpu_pct"] = max(0.0, 100 * (busy - own) / (wall * (os.cpu_count() or 1)))
    return report


def missing_systems(optimum: dict) -> dict[str, str]:
    """System -> why it is not measured here."""
    missing = {}
    if "error" in optimum:
        missing[OPTIMUM] = optimum["error"]
        missing[GENAI_ON_OPTIMUM] = "needs the Optimum export: " + optimum["error"]
    if importlib.util.find_spec("onnxruntime_genai") is None:
        reason = "onnxruntime-genai is not installed (pip install onnxruntime-genai)"
        missing[GENAI_ON_EDGELM] = reason
        missing.setdefault(GENAI_ON_OPTIMUM, reason)
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        missing["transformers"] = "transformers and torch are needed, for the checkpoint and the reference output"
    return missing


# ---- the rows -----------------------------------------------------------------------------------


def system_rows(checkpoint: Path, built, *, missing: dict, args) -> list[tuple]:
    """(row label, child, precision, path, interpreter) for every system measured here."""
    here, optimum_python, llamacpp_python = sys.executable, str(args.optimum_python), str(args.llamacpp_python)
    systems = [("transformers", "transformers", "fp32", checkpoint, here)]
    optimum = built.optimum
    if optimum:
        # ORTModelForCausalLM on Optimum's own recipes; the int4 is not one, it runs under genai only
        systems += [(OPTIMUM, "optimum", p, optimum[p]["path"], optimum_python) for p in ("fp32", "int8-dynamic")]
        if GENAI_ON_OPTIMUM not in missing:
            precisions = optimum_peer.OPTIMUM_PRECISIONS
            systems += [(GENAI_ON_OPTIMUM, "onnxruntime-genai", p, optimum[p]["path"], here) for p in precisions]
    systems += [(GENAI_BUILDER, "onnxruntime-genai", p, b["path"], here) for p, b in built.builder.items()]
    systems += [(LLAMACPP, "llamacpp", p, g["path"], llamacpp_python) for p, g in built.ggufs.items()]
    if built.ggufs and args.shipped_gguf:
        systems.append((LLAMACPP_SHIPPED, "llamacpp", "int4", args.shipped_gguf, llamacpp_python))
    if GENAI_ON_EDGELM not in missing:
        systems += [(GENAI_ON_EDGELM, "onnxruntime-genai", p, built.edgelm[p], here) for p in built.edgelm]
    systems += [("edgelm", "edgelm", p, built.edgelm[p], here) for p in built.edgelm]
    return systems


def prompt_ids(prompt_tokens: int, dims) -> list[int]:
    """Random prompt ids, seeded by the length, with no EOS among them."""
    rng = np.random.default_rng(prompt_tokens)
    prompt = rng.integers(0, dims.vocab_size, prompt_tokens)
    return [int(t) if t != dims.eos_token_id else (int(t) + 1) % dims.vocab_size for t in prompt]


def bandwidth_bounds(packages: dict[str, Path], dims, *, mean_context: float, gb_per_s: float) -> dict:
    """Bytes one decode step reads at each precision: every weight (the model file of edgelm's package; the
    position table is read one row at a time, 0.6% of GPT-2's) + the KV cache at the mean length."""
    kv_per_token = 2 * dims.n_layer * dims.kv_width * 4
    bounds = {}
    for precision, package in packages.items():
        per_token = folder_bytes(package, only=(".onnx", ".data")) + kv_per_token * mean_context
        bounds[precision] = {"bytes_per_token": per_token, "tokens_per_s": gb_per_s * 1e9 / per_token}
    return bounds


def measure_row(system: tuple, prompt_tokens: int, *, prompt_file: Path, dims, args) -> dict:
    name, child, precision, path, python = system
    print(f"[{prompt_tokens}-token prompt] {name} {precision} ...", flush=True)
    row = {"system": name, "precision": precision, "prompt_tokens": prompt_tokens}
    row["eos_token_id"] = dims.eos_token_id
    row["load_average_before"] = os.getloadavg()[0]  # other work on the machine shows here
    row["size_bytes"] = folder_bytes(path)
    row.update(bench_in_child(child, path, prompt_file, args, python=python))
    if "error" in row:
        print(f"  FAILED: {row['error']}", flush=True)
    else:
        print(
            f"  {row['decode_tokens_per_s']:.1f} tokens/s, first token {1000 * row['ttft_s']:.0f} ms, "
            f"load {row['load_s']:.2f} s, peak RSS {row['peak_rss_mb']:.0f} MB; other processes used "
            f"{row['other_cpu_pct']:.0f}% of the CPU meanwhile",
            flush=True,
        )
    return row


def measure(prompt_lengths: list[int], systems: list[tuple], *, packages: dict, dims, gb_per_s: float, out: Path, args):
    """Every system at every prompt length; returns (rows by prompt length, bounds by prompt length)."""
    results, bounds_by_prompt = {}, {}
    for prompt_tokens in prompt_lengths:
        prompt_file = out / f"prompt-{prompt_tokens}.json"
        prompt_file.write_text(json.dumps(prompt_ids(prompt_tokens, dims)))
        mean_context = prompt_tokens + args.new_tokens / 2
        bounds_by_prompt[prompt_tokens] = bandwidth_bounds(packages, dims, mean_context=mean_context, gb_per_s=gb_per_s)
        results[prompt_tokens] = [
            measure_row(s, prompt_tokens, prompt_file=prompt_file, dims=dims, args=args) for s in systems
        ]
    return results, bounds_by_prompt
