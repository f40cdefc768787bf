"""What benchmarks/peers/peers.py and its peer modules share: the row labels, the machine's facts (CPU, versions,
memory bandwidth, contention), file sizes, and the clock of one generation."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"
PEERS_SCRIPT = Path(__file__).resolve().with_name("peers.py")  # the entry point every child process runs
# row labels: the runtime, and for onnxruntime-genai whose package it runs
OPTIMUM = "Optimum ORTModelForCausalLM"
GENAI_ON_OPTIMUM = "onnxruntime-genai on Optimum export"
GENAI_ON_EDGELM = "onnxruntime-genai on edgelm package"
GENAI_BUILDER = "onnxruntime-genai on its model builder's export"
LLAMACPP = "llama.cpp"
LLAMACPP_SHIPPED = "llama.cpp on the GGUF as shipped"
# what users would pick instead (genai on edgelm's own package runs edgelm's graph, so it is reported
# beside them but is not a peer)
PEERS = ("transformers", OPTIMUM, GENAI_ON_OPTIMUM, GENAI_BUILDER, LLAMACPP, LLAMACPP_SHIPPED)


def read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def version_of(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- files and timing -----------------------------------------------------------------------------


def onnx_file(package: Path) -> Path:
    files = sorted(package.glob("*.onnx"))
    assert len(files) == 1, f"expected one .onnx file in {package}, found {[f.name for f in files]}"
    return files[0]


def folder_bytes(folder: Path, only: tuple[str, ...] = ()) -> int:
    if folder.is_file():  # a GGUF file
        return folder.stat().st_size
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and (not only or f.suffix in only))


def timed_child(command: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:5])} failed: {done.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - started


def run_record(started: float, first: float, ended: float, tokens: list[int]) -> dict:
    """One generation's clock: started = the call, first = the first token sampled, ended = the return."""
    rate = (len(tokens) - 1) / (ended - first) if len(tokens) > 1 else 0.0
    return {"ttft_s": first - started, "decode_tokens_per_s": rate, "token_ids": tokens}


# ---- the machine ---------------------------------------------------------------------------------


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in read_lines("/proc/cpuinfo") if line.startswith("model name")), ""
    )
    mem_kb = next((int(line.split()[1]) for line in read_lines("/proc/meminfo") if line.startswith("MemTotal")), 0)
    names = ("torch", "transformers", "onnxruntime", "onnxruntime-genai", "numpy", "edgelm")
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu or platform.processor(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
        "versions": {name: version_of(name) for name in names},
    }


def memory_bandwidth(threads: int, megabytes: int, repeats: int = 10) -> dict:
    """Two numpy kernels over a float32 array, each thread on its own slice (numpy releases the GIL):
    "copy" counts bytes read + written (STREAM's convention), "read" is a max-reduction that only
    reads. Best of `repeats` each, as STREAM reports; the bound uses the higher of the two, so that
    it stays an upper bound for a decode step, which mostly reads."""
    n = megabytes * 2**20 // 4
    src, dst = np.ones(n, dtype=np.float32), np.ones(n, dtype=np.float32)  # ones, not zeros: pages touched
    slices = [slice(i * n // threads, (i + 1) * n // threads) for i in range(threads)]

    def best_seconds(kernel) -> float:
        best = float("inf")
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(repeats):
                started = time.perf_counter()
                list(pool.map(kernel, slices))
                best = min(best, time.perf_counter() - started)
        return best

    copy = 2 * src.nbytes / best_seconds(lambda s: np.copyto(dst[s], src[s])) / 1e9
    read = src.nbytes / best_seconds(lambda s: src[s].max()) / 1e9
    return {
        "method": f"numpy over a {megabytes} MiB float32 array, {threads} threads, best of {repeats}: copy "
        "(read + written bytes) and max-reduction (read bytes); the higher one",
        "copy_gb_per_s": copy,
        "read_gb_per_s": read,
        "gb_per_s": max(copy, read),
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory. Not getrusage's ru_maxrss: Linux carries that across
    fork + exec, so a child would report its parent's peak when it is higher; VmHWM is this image's."""
    for line in read_lines("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux: bytes on macOS, kB elsewhere
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def busy_cpu_seconds() -> float:
    """Seconds of CPU time the whole machine has spent busy since boot (/proc/stat; 0 elsewhere)."""
    fields = next((line.split()[1:] for line in read_lines("/proc/stat") if line.startswith("cpu ")), None)
    if fields is None:
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
