"""edgelm against the tools a user would pick instead, on one GPT-2 checkpoint, in one run.

    python benchmarks/peers/peers.py [--model gpt2-124m|gpt2-tiny|smollm2-135m|llama-tiny] [--checkpoint FOLDER]
                               [--prompt-tokens 32,512] [--new-tokens 128] [--threads 2] [--repeats 3]
                               [--out out/peers] [--optimum-python PATH] [--llamacpp-python PATH]
                               [--shipped-gguf FILE]

The default checkpoint is Hugging Face's GPT-2 124M (`GPT2LMHeadModel(GPT2Config())`, random weights,
seed 0) written with `save_pretrained`: no download. Random weights say nothing about accuracy, only about
speed and size. `--model gpt2-tiny` (2 layers, width 64; also `--config tiny`) checks the script in
seconds. `--model smollm2-135m --checkpoint FOLDER` runs the Llama family on SmolLM2-135M's GGUF weights,
dequantized into a Hugging Face folder (benchmarks/peers/peer_models.py); `--model llama-tiny` checks the
Llama-family peers in seconds on a random 2-layer Llama.

Systems, batch 1, greedy, the same random prompt ids for all, every one made to produce exactly
--new-tokens tokens (EOS does not stop it):
- transformers: `GPT2LMHeadModel.generate` in PyTorch, fp32, `do_sample=False`, EOS disabled.
- Optimum ORTModelForCausalLM: `generate` as for transformers, on an Optimum export
  (`main_export(task="text-generation-with-past")`, tied weights deduplicated) in fp32, and on its
  dynamic int8 from `ORTQuantizer` with `AutoQuantizationConfig` for this CPU (avx2, avx512 or
  avx512_vnni, per-channel, Optimum's default operators); threads through its SessionOptions.
- onnxruntime-genai on the Optimum export: the same fp32 and int8 files with a genai_config.json
  (edgelm's, export/onnx_export.py) beside them, and int4: `MatMulNBitsQuantizer` on the fp32 export
  with block 32, symmetric, accuracy level 4, every linear layer and the LM head 4-bit (edgelm's default
  keeps its LM head at 8 bits, which reads more bytes: see docs/benchmarks.md). That quantizer only takes MatMuls
  with a constant weight and Optimum's GPT-2 graph has none (Conv1D exports as Gemm, the tied head
  multiplies by Transpose(wte)), so each Gemm becomes MatMul + Add and the head gets its own
  transposed copy of wte first; the embedding Gather keeps the fp32 wte.
- onnxruntime-genai on edgelm's own packages, unchanged (each carries genai_config.json).
  genai's threads go through `og.Config.overlay`; `min_length = max_length`, since genai cannot step
  past EOS: it masks EOS instead, which is the same greedy output unless EOS itself is the argmax.
- edgelm: export (the fused graph), then quantize (dynamic int8, static int8, int4 with its default
  8-bit LM head), runtime `generate(ignore_eos=True)`.
- llama.cpp through llama-cpp-python (benchmarks/peers/llamacpp_peer.py): GGUF files by llama.cpp's converter
  from the same folder (f32, q8_0) and `llama_model_quantize` (q4_0 from the f32 file), generated in a
  child of its own interpreter (--llamacpp-python, .venv-llamacpp made by benchmarks/peers/setup_llamacpp.sh);
  q8_0 sits with the dynamic int8 rows (ggml quantizes activations per block at run time). With
  --shipped-gguf, also the GGUF file as shipped (SmolLM2's Q4_1), an int4 row.
- Llama family only: onnxruntime-genai on its own model builder's export, fp32 and int4
  (benchmarks/peers/genai_builder_peer.py). Optimum's rows are GPT-2's only (the genai_config.json written for
  its export is GPT-2's).

Optimum runs in a second interpreter: optimum[onnxruntime] (optimum-onnx 0.1.0) needs
transformers<4.58, and this environment's transformers baseline is 5.x. benchmarks/peers/setup_optimum.sh
makes that venv (.venv-optimum: the same torch and onnxruntime, transformers 4.57); the Optimum
export, its quantizations and the ORTModelForCausalLM runs are children of it (--optimum-python).
onnxruntime-genai runs in this interpreter on every package, so its rows differ only by the package.
Without the second interpreter the Optimum rows are reported missing, with the command that makes it.

Each system and precision runs in a child process of its own, so its load time and peak RSS are its
own (RSS includes the interpreter and the system's imports: torch for transformers and Optimum).
Figures are medians over --repeats runs after one warm-up: time to first token (call to first
sampled token, prompt pass included), decode tokens/s (the tokens after the first, from the first
token to the end of the call), load time, peak RSS, size on disk; plus each row's ratio to edgelm
at the same precision, measured in the same run.

The physical limit: decoding one token reads every weight once, plus the KV cache. The machine's
memory bandwidth is measured with numpy (a copy, STREAM-style, and a read-only reduction, one slice
per thread, GIL released) and bandwidth / bytes per token (edgelm's package at that precision) is a
bound on decode tokens/s. It is a rough bound: caches hold part of a small model, and a tuned kernel
may read faster than numpy.

Contention: for each row the share of the CPU that other processes used meanwhile is recorded, and
rows above 5% are named in the report (on 2 cores, other work changes the figures several-fold).

Correctness: every fp32 system's generated ids are compared with transformers'; a mismatch is
reported with the position and transformers' top-1/top-2 logit gap there, and its speed is flagged.

Writes OUT/CONFIG/peers.json, OUT/CONFIG/peers.png and prints the markdown tables.

The pieces: one module per system (transformers_peer.py, optimum_peer.py, genai_peer.py, edgelm_peer.py,
llamacpp_peer.py, genai_builder_peer.py), the models (peer_models.py), the runner (peer_runner.py), the
report (peer_report.py) and what they share (peer_common.py). This file parses the options and runs the steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import genai_builder_peer
import llamacpp_peer
import optimum_peer
import peer_models
import peer_report
import peer_runner
from edgelm_peer import build_edgelm_packages
from peer_common import GENAI_BUILDER, GENAI_ON_EDGELM, LLAMACPP, OPTIMUM, REPO, machine, memory_bandwidth


@dataclass
class Built:
    """The packages each system runs: precision -> folder (edgelm) or {"path", "recipe"} (the others)."""

    edgelm: dict = field(default_factory=dict)
    optimum: dict = field(default_factory=dict)
    builder: dict = field(default_factory=dict)
    ggufs: dict = field(default_factory=dict)


# ---- the options --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(peer_models.MODELS), default="gpt2-124m")
    configs = sorted(peer_models.CONFIGS)
    parser.add_argument("--config", choices=configs, help="the older name: gpt2 = gpt2-124m, tiny = gpt2-tiny")
    parser.add_argument("--checkpoint", type=Path, help="a Hugging Face folder to start from (needed for smollm2-135m)")
    parser.add_argument("--prompt-tokens", default="32", help="comma-separated prompt lengths, e.g. 32,512")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (ORT), torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "out" / "peers"))
    parser.add_argument("--rebuild", action="store_true", help="write the checkpoint and packages anew")
    parser.add_argument(
        "--optimum-python",
        type=Path,
        default=optimum_peer.OPTIMUM_PYTHON,
        help="the interpreter that runs Optimum (default: .venv-optimum/bin/python, "
        "see benchmarks/peers/setup_optimum.sh)",
    )
    parser.add_argument(
        "--llamacpp-python",
        type=Path,
        default=llamacpp_peer.LLAMACPP_PYTHON,
        help="the interpreter that runs llama-cpp-python (default: .venv-llamacpp/bin/python, "
        "see benchmarks/peers/setup_llamacpp.sh)",
    )
    parser.add_argument("--shipped-gguf", type=Path, help="also run llama.cpp on this GGUF file as shipped (int4)")
    parser.add_argument("--child", choices=sorted(peer_runner.CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--build", choices=optimum_peer.OPTIMUM_PRECISIONS, help=argparse.SUPPRESS)
    parser.add_argument("--probe-optimum", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--package", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    return parser


def prompt_lengths_of(parser: argparse.ArgumentParser, args) -> list[int]:
    """The checked options: the prompt lengths, and the model --config names."""
    try:
        prompt_lengths = [int(n) for n in args.prompt_tokens.split(",")]
    except ValueError:
        parser.error(f"--prompt-tokens must be comma-separated integers, got {args.prompt_tokens!r}")
    if args.repeats < 1 or args.new_tokens < 2 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1, --new-tokens at least 2")
    for option in ("optimum_python", "llamacpp_python", "shipped_gguf", "checkpoint"):
        value = getattr(args, option)
        if value is not None and value != parser.get_default(option) and not value.exists():
            parser.error(f"--{option.replace('_', '-')} {value} does not exist")
    if args.config:
        args.model = {"gpt2": "gpt2-124m", "tiny": "gpt2-tiny"}[args.config]
    return prompt_lengths


def run_inner_step(args) -> int:
    """The hidden modes peers.py runs itself in: one system's child, an Optimum build, the Optimum probe."""
    if args.child:
        return peer_runner.child_main(args)
    if args.build:
        print(json.dumps(optimum_peer.build_optimum(args.build, Path(args.path), Path(args.package))))
        return 0
    print(json.dumps(optimum_peer.probe()))
    return 0


# ---- the steps ----------------------------------------------------------------------------------


def find_systems(args, model) -> tuple[dict, dict, dict]:
    """(Optimum interpreter, llama.cpp interpreter, system -> why it is missing)."""
    if model.family == "gpt2":
        optimum = optimum_peer.optimum_interpreter(args.optimum_python)
    else:  # the genai_config.json written beside Optimum's export is GPT-2's
        optimum = {"python": str(args.optimum_python), "error": "run on GPT-2 only"}
    llamacpp = llamacpp_peer.interpreter(args.llamacpp_python)
    missing = peer_runner.missing_systems(optimum)
    if "error" in llamacpp:
        missing[LLAMACPP] = llamacpp["error"]
    return optimum, llamacpp, missing


def build_packages(checkpoint: Path, out: Path, *, model, missing: dict, args) -> Built:
    """Every system's packages from the one checkpoint; a system whose build fails is added to `missing`."""
    built = Built()
    print("building edgelm packages ...", flush=True)
    try:
        built.edgelm = build_edgelm_packages(checkpoint, out, rebuild=args.rebuild)
    except RuntimeError as e:  # a family edgelm does not export yet
        missing["edgelm"] = missing[GENAI_ON_EDGELM] = f"edgelm's export or quantize failed: {e}"
    if OPTIMUM not in missing and model.family == "gpt2":
        print(f"building Optimum packages with {args.optimum_python} ...", flush=True)
        python = args.optimum_python
        built.optimum = optimum_peer.build_optimum_packages(checkpoint, out, python=python, rebuild=args.rebuild)
    if model.family in genai_builder_peer.FAMILIES:
        print("building onnxruntime-genai model builder packages ...", flush=True)
        try:
            built.builder = genai_builder_peer.build_packages(checkpoint, out, rebuild=args.rebuild)
        except RuntimeError as e:
            missing[GENAI_BUILDER] = str(e)
    if LLAMACPP not in missing:
        print(f"building GGUF files with llama.cpp's converter and {args.llamacpp_python} ...", flush=True)
        try:
            built.ggufs = llamacpp_peer.build_ggufs(
                checkpoint, out, python=args.llamacpp_python, pre_tokenizer=model.pre_tokenizer, rebuild=args.rebuild
            )
        except (RuntimeError, FileNotFoundError) as e:
            missing[LLAMACPP] = str(e)
    return built


def measure_bandwidth(args) -> dict:
    print(f"measuring memory bandwidth ({args.threads} threads) ...", flush=True)
    megabytes = 64 if args.model.endswith("-tiny") else 512
    bandwidth = memory_bandwidth(args.threads, megabytes)
    bandwidth["one_thread_gb_per_s"] = memory_bandwidth(1, megabytes)["gb_per_s"]
    print(
        f"  copy {bandwidth['copy_gb_per_s']:.1f} GB/s, read {bandwidth['read_gb_per_s']:.1f} GB/s "
        f"({bandwidth['one_thread_gb_per_s']:.1f} GB/s with 1 thread)",
        flush=True,
    )
    return bandwidth


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.child or args.build or args.probe_optimum:
        return run_inner_step(args)
    prompt_lengths = prompt_lengths_of(parser, args)
    model = peer_models.MODELS[args.model]
    optimum, llamacpp, missing = find_systems(args, model)
    if "transformers" in missing:
        print(f"error: {missing['transformers']}", file=sys.stderr)
        return 1
    out = Path(args.out) / model.folder_name
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or out / "checkpoint"
    try:
        peer_models.write_checkpoint(checkpoint, args.model, given=args.checkpoint is not None, rebuild=args.rebuild)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    dims = peer_models.shape(json.loads((checkpoint / "config.json").read_text()))
    longest = max(prompt_lengths) + args.new_tokens
    if longest > dims.context:
        parser.error(f"prompt + new tokens ({longest}) exceed the model's context ({dims.context})")
    built = build_packages(checkpoint, out, model=model, missing=missing, args=args)
    facts = machine()
    bandwidth = measure_bandwidth(args)
    systems = peer_runner.system_rows(checkpoint, built, missing=missing, args=args)
    for name, reason in missing.items():
        print(f"MISSING {name}: {reason}", flush=True)
    results, bounds = peer_runner.measure(
        prompt_lengths, systems, packages=built.edgelm, dims=dims, gb_per_s=bandwidth["gb_per_s"], out=out, args=args
    )
    run = peer_report.Run(
        model_title=model.title,
        args=args,
        facts=facts,
        bandwidth=bandwidth,
        optimum=optimum,
        llamacpp=llamacpp,
        built=built,
        missing=missing,
    )
    peer_report.report(run, results, bounds_by_prompt=bounds, out=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
