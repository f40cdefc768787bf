"""edgelm against llama.cpp at real sizes (issue 34): the same GGUF file for both, round-robin.

    python benchmarks/real_sizes.py make  [--dir D] [--rows ROWS]   # the files each row needs, then edgelm's packages
    python benchmarks/real_sizes.py time  [--dir D] [--rows ROWS] [--results FILE] [--rounds 3]
                                          [--prompt-tokens 32,512] [--new-tokens 128] [--threads 2]
    python benchmarks/real_sizes.py report [--results FILE]        # the markdown table of what FILE holds

A row is SHAPE:KIND. SHAPE is one of benchmarks/shaped_checkpoints.py's shapes (random weights of a real model's
shape, a real tokenizer); KIND is a GGUF type made by llama.cpp's own tools (f32, f16, Q8_0 by its converter;
Q4_K_M, Q4_0 by `llama_model_quantize` from the f16 file), which edgelm exports with its blocks kept (the
default), or `int4` / `int8-weight-only`: edgelm's own quantization of the Hugging Face folder (`edgelm export
FOLDER OUT --quantize ...`), timed against llama.cpp on the GGUF type of the same bits (Q4_0, Q8_0); `int4-b128`
is the int4 recipe tuned for speed (blocks of 128, a 4-bit head: fewer bytes a token, less accuracy). Files in
--dir: <shape>-hf/ (the folder), <shape>-<type>.gguf, pkg-<shape>-<kind>/ (edgelm's package), each made once
and reused (a file another process is writing has a .part name until done).

`time` runs every row, prompt length and round in child processes of their own (benchmarks/peers/peer_runner.py's
bench_in_child: the edgelm child in this interpreter, the llama.cpp child in --llamacpp-python), llama.cpp
and edgelm one after the other, the order alternating from one round and row to the next. Each child loads
the model, warms up on 4 tokens, then generates --new-tokens tokens greedily past EOS from the same random
prompt ids (batch 1, --threads threads); it reports load time, time to first token (the prompt pass), decode
tokens/s and its own peak RSS (VmHWM). Every measurement is appended to --results as one JSON line and a
re-run skips what the file already holds, so an interrupted run resumes, and a quiet re-run of the same
packages only times (give it a new --results). `report` prints medians over rounds and the median of the
per-round ratios edgelm / llama.cpp (decode: higher is better; first token: lower is better), with the CPU
and the load average the rounds ran at.

Long context (`time --long-context`, with e.g. `--prompt-tokens 16384 --rows` LONG_ROWS): decode speed after
a long prompt, where a hybrid's fixed-size state should keep its speed and attention's growing cache should not.
edgelm's runtime feeds a prompt in one pass, whose attention scores (heads x prompt x prompt floats) do not fit
at 16k tokens, so its child here feeds the prompt 512 tokens at a time through the KV cache
(runtime/kvcache.py's extend, what a chat turn does) and then decodes greedily (argmax) step by step;
llama.cpp's child feeds it in batches of 512 (its default n_ubatch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import llamacpp_peer  # noqa: E402
import peer_runner  # noqa: E402
from peer_common import folder_bytes  # noqa: E402

DIR = Path("/work/big-scratch/shaped")
LLAMACPP_PYTHON = Path("/work/venv-llamacpp/bin/python")
SHAPED = Path(__file__).resolve().with_name("shaped_checkpoints.py")
CONVERTED = {"f32": "f32", "f16": "f16", "Q8_0": "q8_0"}  # GGUF type -> convert_hf_to_gguf.py --outtype
# GGUF type -> llama_model_quantize's type, from the f16 file
QUANTIZED = {"Q4_K_M": "q4_k_m", "Q5_K_M": "q5_k_m", "Q6_K": "q6_k", "Q4_0": "q4_0"}
FROM_FOLDER = {"int4": "Q4_0", "int8-weight-only": "Q8_0", "int4-b128": "Q4_0"}  # edgelm's own -> llama.cpp's file
EXPORT_FLAGS = {  # edgelm's own quantizations: `edgelm export FOLDER OUT` and these
    "int4": ["--quantize", "int4"],
    "int8-weight-only": ["--quantize", "int8-weight-only"],
    "int4-b128": ["--quantize", "int4", "--block-size", "128", "--int4-lm-head", "int4"],  # speed over accuracy
}
ROWS = (
    "qwen3-0.6b:f16,qwen3-0.6b:Q8_0,qwen3-0.6b:Q4_K_M,qwen3-0.6b:Q4_0,qwen3-0.6b:int4,"
    "qwen3-0.6b:int8-weight-only,"
    "llama-3.2-1b:f16,llama-3.2-1b:Q8_0,llama-3.2-1b:Q4_K_M,llama-3.2-1b:Q4_0,llama-3.2-1b:int4,"
    "llama-3.2-1b:int8-weight-only,"
    "qwen3-4b:Q4_K_M,qwen3-4b:Q4_0,qwen3-4b:int4"
)
LONG_ROWS = "qwen3-0.6b:int4,qwen3.5-0.8b:int4,lfm2-1.2b:int4"  # time --long-context --prompt-tokens 16384


@dataclass(frozen=True)
class Row:
    shape: str
    kind: str

    @classmethod
    def parse(cls, text: str) -> Row:
        shape, _, kind = text.partition(":")
        if kind not in (*CONVERTED, *QUANTIZED, *FROM_FOLDER):
            raise SystemExit(
                f"row {text!r}: the kind must be one of {', '.join((*CONVERTED, *QUANTIZED, *FROM_FOLDER))}"
            )
        return cls(shape, kind)

    def __str__(self) -> str:
        return f"{self.shape}:{self.kind}"

    def folder(self, root: Path) -> Path:
        return root / f"{self.shape}-hf"

    def gguf(self, root: Path, kind: str | None = None) -> Path:
        kind = kind or self.kind
        return root / f"{self.shape}-{FROM_FOLDER.get(kind, kind)}.gguf"

    def package(self, root: Path) -> Path:
        return root / f"pkg-{self.shape}-{self.kind}"

    def exported(self, root: Path) -> Path:
        """The export's wall time, peak RSS and size, written once the export succeeded: the package is done."""
        return root / f"pkg-{self.shape}-{self.kind}.export.json"

    def source(self, root: Path) -> Path:
        return self.folder(root) if self.kind in FROM_FOLDER else self.gguf(root)


def parse_rows(text: str) -> list[Row]:
    return [Row.parse(part.strip()) for part in text.split(",") if part.strip()]


# ---- make: the folders, the GGUF files, edgelm's packages -----------------------------------------


def run_logged(command: list[str], log: Path, *, env: dict | None = None) -> dict:
    """`command` under /usr/bin/time -v, its output in `log`; returns wall seconds and peak RSS (MB)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    timed = ["/usr/bin/time", "-v", *command] if Path("/usr/bin/time").is_file() else command
    started = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(timed, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    text = log.read_text(errors="replace")
    if done.returncode != 0:
        tail = [line for line in text.splitlines() if line.strip() and not line.startswith("\t")][-1:]
        raise SystemExit(f"{' '.join(command[:4])} ... failed (log {log}): {tail}")
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"wall_s": round(time.perf_counter() - started, 1), "peak_rss_mb": peak and int(peak.group(1)) // 1024}


def make_file(target: Path, command, log: Path, *, env: dict | None = None) -> None:
    """Makes `target` with command(target.part) unless it is there; the .part file is renamed when done."""
    part = target.with_name(target.name + ".part")
    if target.exists():
        return
    if part.exists() and time.time() - part.stat().st_mtime < 120:
        raise SystemExit(f"{part} is being written by another process: run again when it is done")
    print(f"making {target.name} ...", flush=True)
    figures = run_logged(command(part), log, env=env)
    part.rename(target)
    print(f"  {target.name}: {figures['wall_s']:.0f} s, peak RSS {figures['peak_rss_mb']} MB", flush=True)


def make_folder(row: Row, root: Path) -> None:
    folder = row.folder(root)
    if (folder / "config.json").is_file() and list(folder.glob("*.safetensors")):
        return
    shard = ["--shard-gb", "2"] if row.shape.endswith(("4b", "mini")) else []
    print(f"making {folder.name} ...", flush=True)
    run_logged([sys.executable, str(SHAPED), row.shape, str(folder), *shard], root / "logs" / f"{folder.name}.log")


def make_gguf(row: Row, root: Path, kind: str, llamacpp_python: Path) -> None:
    """The GGUF file of `kind`: llama.cpp's converter on the folder, or its quantizer on the f16 file."""
    target = row.gguf(root, kind)
    if target.exists():
        return
    log = root / "logs" / f"{target.stem}.log"
    kind = FROM_FOLDER.get(kind, kind)
    script = llamacpp_peer.__file__
    if kind in CONVERTED:
        make_folder(row, root)
        folder, outtype = str(row.folder(root)), CONVERTED[kind]
        env = {"LLAMA_CPP": str(llamacpp_peer.LLAMA_CPP)}
        make_file(
            target,
            lambda part: [sys.executable, script, "convert", folder, str(part), "--outtype", outtype],
            log,
            env=env,
        )
    else:
        make_gguf(row, root, "f16", llamacpp_python)
        source, qtype = str(row.gguf(root, "f16")), QUANTIZED[kind]
        make_file(
            target, lambda part: [str(llamacpp_python), script, "quantize", source, str(part), "--type", qtype], log
        )


def make_package(row: Row, root: Path) -> None:
    package = row.package(root)
    if row.exported(root).is_file():
        return
    command = [sys.executable, "-m", "edgelm.cli", "export", str(row.source(root)), str(package), "--overwrite"]
    if row.kind in FROM_FOLDER:
        command += EXPORT_FLAGS[row.kind]
    print(f"exporting {package.name} ...", flush=True)
    figures = run_logged(command, root / "logs" / f"export-{package.name}.log")
    figures["package_mb"] = round(sum(f.stat().st_size for f in package.iterdir()) / 1e6, 1)
    row.exported(root).write_text(json.dumps(figures))
    print(f"  {package.name}: {figures}", flush=True)


def make(rows: list[Row], root: Path, llamacpp_python: Path) -> int:
    """Each row's package and llama.cpp file; a row that fails is named at the end, the others go on."""
    failed = []
    for row in rows:
        try:
            if row.kind in FROM_FOLDER:
                make_folder(row, root)
            else:
                make_gguf(row, root, row.kind, llamacpp_python)
            make_package(row, root)
            make_gguf(row, root, row.kind, llamacpp_python)
        except SystemExit as e:
            print(f"{row}: {e}", flush=True)
            failed.append(str(row))
    if failed:
        print(f"not made: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


# ---- time: round-robin children ---------------------------------------------------------------------


def prompt_file(root: Path, tokens: int) -> Path:
    """Random ids (seeded by the length) below 32,000, which every vocabulary here has."""
    path = root / "real-sizes" / f"prompt-{tokens}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(np.random.default_rng(tokens).integers(100, 32000, tokens).tolist()))
    return path


def done_keys(results: Path) -> set[tuple]:
    if not results.is_file():
        return set()
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(r["row"], r["prompt_tokens"], r["round"], r["system"]) for r in lines if "error" not in r}


def measure(rows: list[Row], root: Path, args) -> None:
    done = done_keys(args.results)
    child_args = argparse.Namespace(threads=args.threads, new_tokens=args.new_tokens, repeats=1)
    for tokens in args.prompt_tokens:
        prompt = prompt_file(root, tokens)
        for round_ in range(args.rounds):
            for i, row in enumerate(rows):
                systems = [("edgelm", row.package(root), sys.executable)]
                systems.append(("llamacpp", row.gguf(root), str(args.llamacpp_python)))
                if (round_ + i) % 2:
                    systems.reverse()
                for system, path, python in systems:
                    key = (str(row), tokens, round_, system)
                    if key in done:
                        continue
                    load, started = os.getloadavg()[0], time.perf_counter()
                    if args.long_context and system == "edgelm":
                        report = bench_long(path, prompt, args)
                    else:
                        report = peer_runner.bench_in_child(system, path, prompt, child_args, python=python)
                    report.pop("token_ids", None)
                    report.update(row=str(row), prompt_tokens=tokens, round=round_, system=system, load_average=load)
                    report.update(child_wall_s=time.perf_counter() - started, size_mb=folder_bytes(path) / 1e6)
                    with args.results.open("a") as out:
                        out.write(json.dumps(report) + "\n")
                    if "error" in report:
                        print(f"{key}: FAILED {report['error']}", flush=True)
                    else:
                        print(
                            f"{row} {tokens} round {round_ + 1} {system}: {report['decode_tokens_per_s']:.1f} tok/s, "
                            f"first token {1000 * report['ttft_s']:.0f} ms, load {report['load_s']:.1f} s, "
                            f"RSS {report['peak_rss_mb']:.0f} MB (load average {load:.1f})",
                            flush=True,
                        )


LONG_CHUNK = 512


def child_long(package: str, prompt_path: str, threads: int, new_tokens: int) -> dict:
    """edgelm with a long prompt fed LONG_CHUNK tokens at a time, then greedy steps (in the child process)."""
    from peer_common import peak_rss_mb

    from edgelm.runtime import load
    from edgelm.runtime.kvcache import make_cache

    prompt = json.loads(Path(prompt_path).read_text())
    started = time.perf_counter()
    model = load(package, provider="cpu", threads=threads)
    load_s, started = time.perf_counter() - started, time.perf_counter()
    runner = model.runner(None)
    cache = make_cache(runner, [prompt[:LONG_CHUNK]], capacity=len(prompt) + new_tokens)
    logits = cache.prompt()[0]
    for at in range(LONG_CHUNK, len(prompt), LONG_CHUNK):
        logits = cache.extend(prompt[at : at + LONG_CHUNK])
    first = time.perf_counter()
    token = np.empty((1, 1), dtype=np.int64)
    for _ in range(new_tokens - 1):
        token[0, 0] = int(np.argmax(logits))
        logits = cache.next(token)[0]
    rate = (new_tokens - 1) / (time.perf_counter() - first)
    return {"load_s": load_s, "ttft_s": first - started, "decode_tokens_per_s": rate, "peak_rss_mb": peak_rss_mb()}


def bench_long(path: Path, prompt: Path, args) -> dict:
    command = [sys.executable, __file__, "long-child", str(path), str(prompt), str(args.threads), str(args.new_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- report -----------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    except OSError:
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    flags = fields.get("Flags", "")
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags.split()]
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs ({', '.join(simd)})"


def report(results: Path) -> str:
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    ok = [r for r in lines if "error" not in r]
    failed = sorted({(r["row"], r["prompt_tokens"], r["system"], r["error"]) for r in lines if "error" in r})
    loads = [r["load_average"] for r in ok]
    out = [f"CPU: {cpu_name()}; load average before each child {min(loads):.1f}-{max(loads):.1f} (median "
           f"{statistics.median(loads):.1f})" if loads else "no results", ""]  # fmt: skip
    out.append(
        "| row | prompt | edgelm decode tok/s | llama.cpp decode tok/s | decode edgelm / llama.cpp (min-max) "
        "| first token ms edgelm / llama.cpp (ratio) | load s edgelm / llama.cpp | peak RSS MB edgelm / llama.cpp "
        "| size MB package / GGUF | rounds |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    keys = list(dict.fromkeys((r["row"], r["prompt_tokens"]) for r in ok))
    for row, tokens in keys:
        rounds = {}
        for r in ok:
            if (r["row"], r["prompt_tokens"]) == (row, tokens):
                rounds.setdefault(r["round"], {})[r["system"]] = r
        pairs = [p for p in rounds.values() if len(p) == 2]
        if not pairs:
            continue

        def med(system: str, key: str, pairs=pairs) -> float:
            return statistics.median(p[system][key] for p in pairs)

        decode = [p["edgelm"]["decode_tokens_per_s"] / p["llamacpp"]["decode_tokens_per_s"] for p in pairs]
        first = [p["edgelm"]["ttft_s"] / p["llamacpp"]["ttft_s"] for p in pairs]
        out.append(
            f"| {row} | {tokens} | {med('edgelm', 'decode_tokens_per_s'):.1f} | "
            f"{med('llamacpp', 'decode_tokens_per_s'):.1f} | **{statistics.median(decode):.2f}x** "
            f"({min(decode):.2f}-{max(decode):.2f}) | {1000 * med('edgelm', 'ttft_s'):.0f} / "
            f"{1000 * med('llamacpp', 'ttft_s'):.0f} ({statistics.median(first):.2f}x) | "
            f"{med('edgelm', 'load_s'):.1f} / {med('llamacpp', 'load_s'):.1f} | "
            f"{med('edgelm', 'peak_rss_mb'):,.0f} / {med('llamacpp', 'peak_rss_mb'):,.0f} | "
            f"{med('edgelm', 'size_mb'):,.0f} / {med('llamacpp', 'size_mb'):,.0f} | {len(pairs)} |"
        )
    out += [f"\nFAILED {row} {tokens} {system}: {error}" for row, tokens, system, error in failed]
    out.append(f"\n{len(lines)} children, {sum(r.get('child_wall_s', 0) for r in lines) / 60:.0f} minutes")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if sys.argv[1:2] == ["long-child"]:
        package, prompt, threads, new_tokens = sys.argv[2:6]
        print(json.dumps(child_long(package, prompt, int(threads), int(new_tokens))))
        return 0
    parser.add_argument("step", choices=("make", "time", "report"))
    parser.add_argument("--dir", type=Path, default=DIR, help="where the folders, GGUF files and packages are")
    parser.add_argument("--rows", default=ROWS, help=f"comma-separated SHAPE:KIND (long context: {LONG_ROWS})")
    parser.add_argument("--results", type=Path, help="JSON lines, appended (default DIR/real-sizes/results.jsonl)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[32, 512])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-python", type=Path, default=LLAMACPP_PYTHON)
    parser.add_argument("--long-context", action="store_true", help="edgelm feeds the prompt in pieces (see above)")
    args = parser.parse_args()
    args.results = args.results or args.dir / "real-sizes" / "results.jsonl"
    rows = parse_rows(args.rows)
    if args.step == "make":
        return make(rows, args.dir, args.llamacpp_python)
    elif args.step == "time":
        args.results.parent.mkdir(parents=True, exist_ok=True)
        missing = [
            str(r)
            for r in rows
            if not (r.package(args.dir) / "edgelm.json").is_file() or not r.gguf(args.dir).is_file()
        ]
        if missing:
            raise SystemExit(f"not made yet: {', '.join(missing)} (run the make step first)")
        measure(rows, args.dir, args)
        print(report(args.results))
    else:
        print(report(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
