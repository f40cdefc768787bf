"""edgelm against the tools a user would pick instead, on one GPT-2 checkpoint, in one run.

    python benchmarks/peers.py [--model gpt2-124m|gpt2-tiny|smollm2-135m|llama-tiny] [--checkpoint FOLDER]
                               [--prompt-tokens 32,512] [--new-tokens 128] [--threads 2] [--repeats 3]
                               [--out out/peers] [--optimum-python PATH] [--llamacpp-python PATH]
                               [--shipped-gguf FILE]

The default checkpoint is Hugging Face's GPT-2 124M (`GPT2LMHeadModel(GPT2Config())`, random weights,
seed 0) written with `save_pretrained`: no download. Random weights say nothing about accuracy, only about
speed and size. `--model gpt2-tiny` (2 layers, width 64; also `--config tiny`) checks the script in
seconds. `--model smollm2-135m --checkpoint FOLDER` runs the Llama family on SmolLM2-135M's GGUF weights,
dequantized into a Hugging Face folder (benchmarks/peer_models.py); `--model llama-tiny` checks the
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
- llama.cpp through llama-cpp-python (benchmarks/llamacpp_peer.py): GGUF files by llama.cpp's converter
  from the same folder (f32, q8_0) and `llama_model_quantize` (q4_0 from the f32 file), generated in a
  child of its own interpreter (--llamacpp-python, .venv-llamacpp made by benchmarks/setup_llamacpp.sh);
  q8_0 sits with the dynamic int8 rows (ggml quantizes activations per block at run time). With
  --shipped-gguf, also the GGUF file as shipped (SmolLM2's Q4_1), an int4 row.
- Llama family only: onnxruntime-genai on its own model builder's export, fp32 and int4
  (benchmarks/genai_builder_peer.py). Optimum's rows are GPT-2's only (the genai_config.json written for
  its export is GPT-2's).

Optimum runs in a second interpreter: optimum[onnxruntime] (optimum-onnx 0.1.0) needs
transformers<4.58, and this environment's transformers baseline is 5.x. benchmarks/setup_optimum.sh
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
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import genai_builder_peer
import llamacpp_peer
import numpy as np
import peer_models

REPO = Path(__file__).resolve().parent.parent
CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"
CONFIGS = {
    "gpt2": {},  # GPT2Config() itself: 12 layers, width 768, 12 heads, vocab 50257, context 1024 (124M)
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4},  # 3.4M parameters (most of them the embedding)
}
EDGELM_MODES = {
    "fp32": None,
    "int8-dynamic": "dynamic",
    "int8-static": "static",
    "int8-weight-only": "int8-weight-only",  # the int8 edgelm recommends for Llama-family models
    "int4": "int4",
}
PRECISIONS = tuple(EDGELM_MODES)
OPTIMUM_PRECISIONS = ("fp32", "int8-dynamic", "int4")  # the Optimum export, ORTQuantizer's int8, MatMulNBits int4
OPTIMUM_PYTHON = REPO / ".venv-optimum" / "bin" / "python"  # made by benchmarks/setup_optimum.sh
OPTIMUM_VERSIONS = ("optimum", "optimum-onnx", "transformers", "torch", "onnxruntime", "onnx", "accelerate", "numpy")
# row labels: the runtime, and for onnxruntime-genai whose package it runs
OPTIMUM = "Optimum ORTModelForCausalLM"
GENAI_ON_OPTIMUM = "onnxruntime-genai on Optimum export"
GENAI_ON_EDGELM = "onnxruntime-genai on edgelm package"
GENAI_BUILDER = "onnxruntime-genai on its model builder's export"
LLAMACPP = "llama.cpp"
LLAMACPP_SHIPPED = "llama.cpp on the GGUF as shipped"
CHILD_TIMEOUT_S = 1800
CONTENTION_PCT = 5  # other processes' share of the machine's CPU above which a row is reported as contended


# ---- the checkpoint and the packages ------------------------------------------------------------


def make_checkpoint(folder: Path, config_name: str) -> None:
    """A Hugging Face GPT-2 folder with random weights, plus a small byte-level BPE tokenizer.json:
    edgelm's static int8 calibrates on text, and the tokenizer's 512 ids are a subset of GPT-2's
    vocabulary (with random weights, which text it is does not matter for speed)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**CONFIGS[config_name])).save_pretrained(folder)
    add_n_ctx(folder)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CALIBRATION.read_text(encoding="utf-8")], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "peers-config.json").write_text(json.dumps({"config": config_name}))


def add_n_ctx(checkpoint: Path) -> None:
    """GPT-2's config.json on the Hub carries n_ctx (= n_positions), and llama.cpp's converter reads it;
    transformers 5 no longer writes it. Added when absent; transformers and edgelm ignore it."""
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    if config.get("model_type") == "gpt2" and "n_ctx" not in config:
        config["n_ctx"] = config["n_positions"]
        config_file.write_text(json.dumps(config, indent=2))


def write_checkpoint(checkpoint: Path, model_name: str, *, given: bool, rebuild: bool) -> None:
    """The Hugging Face folder every system starts from: checked when given (--checkpoint), else
    written with random weights unless an earlier run left one (smollm2-135m must be given)."""
    model = peer_models.MODELS[model_name]
    if given or model_name == "smollm2-135m":
        if model.family == "llama":
            peer_models.llama_checkpoint(checkpoint)
        elif not (checkpoint / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {checkpoint}")
        add_n_ctx(checkpoint)
        return
    stamp = checkpoint / "peers-config.json"
    if rebuild or not stamp.is_file():
        print(f"writing a random checkpoint ({model_name}) with transformers ...", flush=True)
        shutil.rmtree(checkpoint, ignore_errors=True)
        if model.family == "gpt2":
            make_checkpoint(checkpoint, model.folder_name)
        else:
            peer_models.make_llama_tiny(checkpoint)
            stamp.write_text(json.dumps({"model": model_name}))
    add_n_ctx(checkpoint)  # a GPT-2 checkpoint from before the llama.cpp peer


def timed_child(command: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:5])} failed: {done.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - started


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


def build_optimum_packages(checkpoint: Path, out: Path, *, python: Path, rebuild: bool) -> dict[str, dict]:
    """The Optimum export and its quantizations, each in a child of the Optimum interpreter, then a
    genai_config.json beside each model (written here: edgelm's genai_config needs edgelm).
    Returns precision -> {"path", "recipe"}."""
    packages = {}
    for precision in OPTIMUM_PRECISIONS:
        package = out / f"optimum-{precision}"
        source = checkpoint if precision == "fp32" else out / "optimum-fp32"
        recipe_file = package / "peers-recipe.json"
        if (package / "genai_config.json").is_file() and recipe_file.is_file() and not rebuild:
            print(f"  {package.name}: reusing (--rebuild to redo)", flush=True)
        else:
            shutil.rmtree(package, ignore_errors=True)
            command = [str(python), __file__, "--build", precision, "--path", str(source), "--package", str(package)]
            print(f"  {package.name}: {timed_child(command):.1f} s", flush=True)
            write_genai_config(package, json.loads((checkpoint / "config.json").read_text()))
        packages[precision] = {"path": package, "recipe": json.loads(recipe_file.read_text())}
    return packages


def write_genai_config(package: Path, checkpoint_config: dict) -> None:
    """edgelm's genai_config.json (runtime/contract.py), pointed at Optimum's model file: its "phi"
    decoder type with separate past/present key and value names is the I/O contract of Optimum's
    GPT-2 graph too (checked when the export is built)."""
    from edgelm.runtime.contract import Architecture, IONames, Manifest, Tokens, genai_config

    c = checkpoint_config
    n_embd, n_head = c["n_embd"], c["n_head"]
    architecture = Architecture(
        type="gpt2",
        vocab_size=c["vocab_size"],
        context_length=c["n_positions"],
        n_layer=c["n_layer"],
        n_head=n_head,
        n_kv_head=n_head,
        head_dim=n_embd // n_head,
        details={"n_embd": n_embd},
    )
    tokens = Tokens(
        file=None, bos_token_id=c["bos_token_id"], eos_token_ids=[c["eos_token_id"]], pad_token_id=c["eos_token_id"]
    )
    manifest = Manifest(architecture=architecture, io=IONames(), tokenizer=tokens, model_file=onnx_file(package).name)
    (package / "genai_config.json").write_text(json.dumps(genai_config(manifest), indent=1))


def onnx_file(package: Path) -> Path:
    files = sorted(package.glob("*.onnx"))
    assert len(files) == 1, f"expected one .onnx file in {package}, found {[f.name for f in files]}"
    return files[0]


def folder_bytes(folder: Path, only: tuple[str, ...] = ()) -> int:
    if folder.is_file():  # a GGUF file
        return folder.stat().st_size
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and (not only or f.suffix in only))


# ---- the machine --------------------------------------------------------------------------------


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")), "")
    mem_kb = next((int(line.split()[1]) for line in _lines("/proc/meminfo") if line.startswith("MemTotal")), 0)
    versions = {}
    for name in ("torch", "transformers", "onnxruntime", "onnxruntime-genai", "numpy", "edgelm"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu or platform.processor(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
        "versions": versions,
    }


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


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


# ---- the Optimum packages, built in the Optimum interpreter -------------------------------------


def build_optimum(precision: str, source: Path, package: Path) -> dict:
    """One Optimum package: "fp32" exports the checkpoint `source`, the others quantize the fp32
    export `source`. Writes the recipe to the package as peers-recipe.json and returns it."""
    import logging

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # an INFO line per node
    if precision == "fp32":
        recipe = optimum_export(source, package)
    elif precision == "int8-dynamic":
        recipe = optimum_int8(source, package)
    elif precision == "int4":
        recipe = optimum_int4(source, package)
    else:
        raise ValueError(f"unknown Optimum precision {precision!r}; valid: {', '.join(OPTIMUM_PRECISIONS)}")
    (package / "peers-recipe.json").write_text(json.dumps(recipe, indent=1))
    return recipe


def optimum_export(checkpoint: Path, package: Path) -> dict:
    """`main_export` as `optimum-cli export onnx --task text-generation-with-past` runs it (it checks
    the graph against PyTorch itself); then the I/O names that genai_config.json will name."""
    import onnx
    from optimum.exporters.onnx import main_export

    main_export(str(checkpoint), str(package), task="text-generation-with-past")
    n_layer = json.loads((checkpoint / "config.json").read_text())["n_layer"]
    graph = onnx.load(str(onnx_file(package)), load_external_data=False).graph
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    expected_inputs = {"input_ids", "attention_mask", "position_ids"}
    expected_inputs |= {f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")}
    expected_outputs = {"logits"} | {f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")}
    if inputs != expected_inputs or outputs != expected_outputs:
        raise RuntimeError(
            f"Optimum's export has inputs {sorted(inputs)} and outputs {sorted(outputs)}, not the names "
            "genai_config.json names (input_ids, attention_mask, position_ids, past_key_values.N.key/value; "
            "logits, present.N.key/value)"
        )
    tied = "deduplicated" if _version("accelerate") else "duplicated (Optimum deduplicates them with accelerate)"
    return {
        "tool": "optimum.exporters.onnx.main_export",
        "task": "text-generation-with-past",
        "tied_weights": tied,
        "summary": f"main_export(task='text-generation-with-past'), tied weights {tied}",
    }


def optimum_int8(export: Path, package: Path) -> dict:
    """ORTQuantizer with Optimum's dynamic config for this CPU: the instruction set decides the weight
    type (uint8 on AVX2, int8 on AVX-512, VNNI and arm64; activations uint8, quantized at run time)."""
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    flags = next((line.split(":", 1)[1].split() for line in _lines("/proc/cpuinfo") if line.startswith("flags")), [])
    if platform.machine() in ("aarch64", "arm64"):
        target = "arm64"
    elif "avx512_vnni" in flags:
        target = "avx512_vnni"
    elif "avx512f" in flags:
        target = "avx512"
    else:
        target = "avx2"
    config = getattr(AutoQuantizationConfig, target)(is_static=False, per_channel=True)
    ORTQuantizer.from_pretrained(export).quantize(save_dir=package, quantization_config=config)
    call = f"AutoQuantizationConfig.{target}(is_static=False, per_channel=True)"
    weights = f"{config.weights_dtype.name} {'symmetric' if config.weights_symmetric else 'asymmetric'}"
    return {
        "tool": "optimum.onnxruntime.ORTQuantizer",
        "config": call,
        "format": config.format.name,
        "weights": weights,
        "activations": f"{config.activations_dtype.name}, quantized at run time",
        "operators": config.operators_to_quantize,
        "summary": f"ORTQuantizer, {call}: {config.format.name}, weights {weights}",
    }


def optimum_int4(export: Path, package: Path) -> dict:
    """MatMulNBitsQuantizer as edgelm quantizes its blocks (quantize/quantize.py: block 32, symmetric,
    accuracy level 4) on the Optimum export, after the rewrite that lets it see the linear layers."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    shutil.copytree(export, package, ignore=shutil.ignore_patterns("*.onnx", "*.onnx_data", "peers-*.json"))
    model = onnx.load(str(onnx_file(export)))
    rewrite = matmuls_with_constant_weights(model)
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    quantized = quantizer.model.model
    weights = {i.name for i in quantized.graph.initializer}
    ops = [n.op_type for n in quantized.graph.node]
    left = [n.name for n in quantized.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
    onnx.save(quantized, str(package / "model.onnx"))
    return {
        "tool": "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer",
        "block_size": 32,
        "symmetric": True,
        "accuracy_level": 4,
        **rewrite,
        "matmulnbits_nodes": ops.count("MatMulNBits"),
        "float_matmuls_with_constant_weight": left,
        "embedding": "fp32 (the Gather reads the unquantized wte)",
        "summary": f"MatMulNBitsQuantizer (block 32, symmetric, accuracy level 4): {ops.count('MatMulNBits')} "
        f"MatMulNBits after {rewrite['gemms_made_matmul_add']} Gemm -> MatMul + Add and "
        f"{rewrite['transposed_weights_folded']} transposed weight folded; {len(left)} float MatMul with a "
        "constant weight left; embedding fp32",
    }


def matmuls_with_constant_weights(model) -> dict:
    """MatMulNBitsQuantizer only rewrites MatMul nodes whose weight is an initializer. Optimum's GPT-2
    graph has none: Conv1D exports as Gemm (x @ W + b, x flattened to 2-D), and the tied LM head
    multiplies by Transpose(wte). Each such Gemm becomes MatMul + Add, and each transposed initializer
    that feeds a MatMul becomes an initializer of its own. In place; returns the counts."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    matmul_weights = {n.input[1] for n in graph.node if n.op_type == "MatMul"}
    nodes, gemms, transposes = [], 0, 0
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and node.input[1] in initializers:
            plain = {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}
            assert all(attributes.get(k, v) == v for k, v in plain.items()), f"{node.name}: Gemm {attributes}"
            has_bias = len(node.input) > 2 and node.input[2] != ""
            product = node.output[0] + "_matmul" if has_bias else node.output[0]
            nodes.append(helper.make_node("MatMul", node.input[:2], [product], name=node.name + "_matmul"))
            if has_bias:
                nodes.append(helper.make_node("Add", [product, node.input[2]], node.output, name=node.name + "_bias"))
            gemms += 1
        elif node.op_type == "Transpose" and node.input[0] in initializers and node.output[0] in matmul_weights:
            weight = numpy_helper.to_array(initializers[node.input[0]])
            graph.initializer.append(numpy_helper.from_array(weight.transpose(attributes.get("perm")), node.output[0]))
            transposes += 1
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return {"gemms_made_matmul_add": gemms, "transposed_weights_folded": transposes}


# ---- the child processes: one system, one precision, one prompt -------------------------------


def child_transformers(path: str, prompt: list[int], args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    load_s = time.perf_counter() - started
    runs = _generate_runs(model, prompt, args)
    # untimed: transformers' logits, for the top-1/top-2 gap at any token where another system differs
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=args.new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    gaps = [float(d[0] - d[1]) for d in (torch.topk(step[0], 2).values for step in out.logits)]
    return {"load_s": load_s, "runs": runs, "top2_gaps": gaps}


def child_optimum(path: str, prompt: list[int], args) -> dict:
    """Optimum's ORTModelForCausalLM (in the Optimum interpreter): ONNX Runtime runs the graph, the
    generate() loop and its logits processing are transformers' in PyTorch, as for child_transformers."""
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(args.threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    started = time.perf_counter()
    model = ORTModelForCausalLM.from_pretrained(
        path, file_name=onnx_file(Path(path)).name, provider="CPUExecutionProvider", session_options=options
    )
    load_s = time.perf_counter() - started
    return {"load_s": load_s, "runs": _generate_runs(model, prompt, args)}


def _generate_runs(model, prompt: list[int], args) -> list[dict]:
    """transformers' `generate`, greedy, EOS disabled (like edgelm's ignore_eos), a streamer clocking
    each token: a warm-up, then --repeats timed runs."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.eos_token_id  # batch 1, no padding: silences a warning

    class Clock(BaseStreamer):
        """generate() calls put() with the prompt, then once per new token."""

        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    input_ids = torch.tensor([prompt])
    mask = torch.ones_like(input_ids)

    def run(new_tokens: int) -> dict:
        clock = Clock()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, streamer=clock
            )
        ended = time.perf_counter()
        first = clock.times[1]
        return _run(started, first, ended, out[0, len(prompt) :].tolist())

    run(4)
    return [run(args.new_tokens) for _ in range(args.repeats)]


def child_genai(path: str, prompt: list[int], args) -> dict:
    import onnxruntime_genai as og

    started = time.perf_counter()
    config = og.Config(path)
    config.clear_providers()  # CPU
    options = {"intra_op_num_threads": args.threads, "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - started
    ids = np.array(prompt, dtype=np.int32)

    def run(new_tokens: int) -> dict:
        started = time.perf_counter()
        params = og.GeneratorParams(model)
        length = len(prompt) + new_tokens
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        tokens, first = [], 0.0
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            first = first or time.perf_counter()
        return _run(started, first, time.perf_counter(), tokens)

    run(4)
    return {"load_s": load_s, "runs": [run(args.new_tokens) for _ in range(args.repeats)]}


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


def _run(started: float, first: float, ended: float, tokens: list[int]) -> dict:
    rate = (len(tokens) - 1) / (ended - first) if len(tokens) > 1 else 0.0
    return {"ttft_s": first - started, "decode_tokens_per_s": rate, "token_ids": tokens}


CHILDREN = {
    "transformers": child_transformers,
    "optimum": child_optimum,
    "onnxruntime-genai": child_genai,
    "edgelm": child_edgelm,
    "llamacpp": llamacpp_peer.child_llamacpp,
}


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


def peak_rss_mb() -> float:
    """This process's peak resident memory. Not getrusage's ru_maxrss: Linux carries that across
    fork + exec, so a child would report its parent's peak when it is higher; VmHWM is this image's."""
    for line in _lines("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux: bytes on macOS, kB elsewhere
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def busy_cpu_seconds() -> float:
    """Seconds of CPU time the whole machine has spent busy since boot (/proc/stat; 0 elsewhere)."""
    fields = next((line.split()[1:] for line in _lines("/proc/stat") if line.startswith("cpu ")), None)
    if fields is None:
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def bench_in_child(child: str, path: Path, prompt_file: Path, args, *, python: str = sys.executable) -> dict:
    """Runs one system in a child of `python`; also reports the share of the machine's CPU that other
    processes used meanwhile (busy time of the machine minus the child's own), so contention is visible."""
    command = [python, __file__, "--child", child, "--path", str(path), "--prompt-file", str(prompt_file)]
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


# ---- the systems this machine has --------------------------------------------------------------


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


def optimum_interpreter(python: Path) -> dict:
    """The interpreter that runs Optimum: its versions, or "error", why it cannot. It is a venv of its
    own because optimum[onnxruntime] (optimum-onnx 0.1.0) needs transformers<4.58, and installing it
    here would downgrade the transformers 5 (and tokenizers) that the transformers baseline runs on."""
    setup = "run benchmarks/setup_optimum.sh to make it, or pass --optimum-python"
    if not python.is_file():
        return {"python": str(python), "error": f"no Optimum interpreter at {python}: {setup}"}
    done = subprocess.run([str(python), __file__, "--probe-optimum"], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"python": str(python), "error": f"{python} cannot run Optimum ({last}): {setup}"}
    return {"python": str(python), "versions": json.loads(done.stdout.strip().splitlines()[-1])}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- the report ---------------------------------------------------------------------------------


def compare_with_reference(rows: list[dict]) -> list[dict]:
    """Every row's token ids against transformers' fp32 ids: where they first differ, and
    transformers' top-1/top-2 logit gap there (a near-tie flips on rounding alone)."""
    reference = next((r for r in rows if r["system"] == "transformers" and "token_ids" in r), None)
    if reference is None:
        return []
    mismatches = []
    for row in rows:
        if "token_ids" not in row or row is reference:
            continue
        ids, ref = row["token_ids"], reference["token_ids"]
        first = next((i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b), None)
        if first is None and len(ids) != len(ref):
            first = min(len(ids), len(ref))
        row["same_as_reference"] = first is None
        row["first_difference"] = first
        if first is not None and row["precision"] == "fp32":
            row["flagged"] = True
            gap = reference["top2_gaps"][first] if first < len(reference["top2_gaps"]) else None
            mismatches.append(
                {
                    "system": row["system"],
                    "precision": row["precision"],
                    "prompt_tokens": row["prompt_tokens"],
                    "first_difference": first,
                    "reference_top2_gap": gap,
                    "eos_in_reference": row["eos_token_id"] in ref[: first + 1],
                }
            )
    return mismatches


def add_ratios(rows: list[dict]) -> None:
    """Each row's figures divided by edgelm's at the same precision (same run, same prompt)."""
    edgelm = {r["precision"]: r for r in rows if r["system"] == "edgelm" and "decode_tokens_per_s" in r}
    for r in rows:
        ours = edgelm.get(r["precision"])
        if ours and "decode_tokens_per_s" in r:
            keys = ("decode_tokens_per_s", "ttft_s", "load_s", "peak_rss_mb", "size_bytes")
            r["vs_edgelm"] = {key: r[key] / ours[key] for key in keys}
            if r["system"] == GENAI_ON_EDGELM:  # the very same package file: expect the very same ids
                r["same_as_edgelm"] = r["token_ids"] == ours["token_ids"]


# what users would pick instead (genai on edgelm's own package runs edgelm's graph, so it is reported
# beside them but is not a peer)
PEERS = ("transformers", OPTIMUM, GENAI_ON_OPTIMUM, GENAI_BUILDER, LLAMACPP, LLAMACPP_SHIPPED)


def best_peers(rows: list[dict], bounds: dict) -> str:
    """edgelm at each precision against the best peer at that precision (each edgelm int8 against the best
    int8 peer: the peers' int8 is one recipe, labelled int8-dynamic): decode tokens/s (higher is better), first
    token, load time and peak RSS (lower is better), and edgelm's fraction of the bandwidth bound."""
    measured = [r for r in rows if "decode_tokens_per_s" in r]
    lines = [
        "| precision | edgelm tokens/s | best peer | its tokens/s | edgelm / best | of bound "
        "| first token: edgelm / best peer | load: edgelm / best peer | peak RSS: edgelm / best peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ours in (r for r in measured if r["system"] == "edgelm"):
        kind = "int8-dynamic" if ours["precision"].startswith("int8") else ours["precision"]
        peers = [r for r in measured if r["system"] in PEERS and r["precision"] == kind]
        if not peers:
            continue
        best = max(peers, key=lambda r: r["decode_tokens_per_s"])
        fastest = min(r["ttft_s"] for r in peers)
        quickest = min(r["load_s"] for r in peers)
        smallest = min(r["peak_rss_mb"] for r in peers)
        rate, best_rate = ours["decode_tokens_per_s"], best["decode_tokens_per_s"]
        lines.append(
            f"| {ours['precision']} | {rate:.1f} | {best['system']} {best['precision']} | {best_rate:.1f} | "
            f"**{rate / best_rate:.2f}x** | {100 * rate / bounds[ours['precision']]['tokens_per_s']:.0f}% | "
            f"{ours['ttft_s'] / fastest:.2f}x | {ours['load_s'] / quickest:.2f}x | "
            f"{ours['peak_rss_mb'] / smallest:.2f}x |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict], bounds: dict) -> str:
    header = (
        "| system | precision | size MB | load s | first token ms | vs edgelm | decode tokens/s | vs edgelm "
        "| of bound | peak RSS MB | ids = transformers fp32 |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    edgelm = {r["precision"]: r for r in rows if r["system"] == "edgelm" and "decode_tokens_per_s" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['precision']} | | | | | failed: {r['error'][:80]} | | | | |")
            continue
        rate = r["decode_tokens_per_s"]
        ours = edgelm.get(r["precision"])
        ttft_versus = f"{r['ttft_s'] / ours['ttft_s']:.2f}x" if ours else "-"
        versus = f"{rate / ours['decode_tokens_per_s']:.2f}x" if ours else "-"
        bound = bounds[r["precision"]]["tokens_per_s"] if r["precision"] in bounds else None
        of_bound = f"{100 * rate / bound:.0f}%" if bound else "-"
        if r["system"] == "transformers":
            same = "(reference)"
        elif r.get("first_difference") is None:
            same = "yes"
        else:
            same = f"differs from token {r['first_difference']}"
        flag = " ⚠" if r.get("flagged") else ""
        lines.append(
            f"| {r['system']} | {r['precision']} | {r['size_bytes'] / 1e6:.0f} | {r['load_s']:.2f} | "
            f"{r['ttft_s'] * 1000:.1f} | {ttft_versus} | {rate:.1f}{flag} | {versus} | {of_bound} | "
            f"{r['peak_rss_mb']:.0f} | {same} |"
        )
    return header + "\n".join(lines)


def plot(results: dict, bounds_by_prompt: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(results)
    fig, axes = plt.subplots(1, len(prompts), figsize=(max(9, 7 * len(prompts)), 5), squeeze=False)
    systems = list(dict.fromkeys(r["system"] for rows in results.values() for r in rows))
    width = 0.8 / len(systems)
    for ax, prompt in zip(axes[0], prompts, strict=True):
        for s, system in enumerate(systems):
            for p, precision in enumerate(PRECISIONS):
                row = next((r for r in results[prompt] if r["system"] == system and r["precision"] == precision), None)
                if row is None or "decode_tokens_per_s" not in row:
                    continue
                x, rate = p - 0.4 + (s + 0.5) * width, row["decode_tokens_per_s"]
                ax.bar(x, rate, width, color=f"C{s}", label=system)
                mark = " (ids differ!)" if row.get("flagged") else ""
                ax.text(x, rate, f"{rate:.0f}{mark}", ha="center", va="bottom", fontsize=7, rotation=90 if mark else 0)
        for p, precision in enumerate(PRECISIONS):
            if precision not in bounds_by_prompt[prompt]:
                continue
            bound = bounds_by_prompt[prompt][precision]["tokens_per_s"]
            ax.hlines(bound, p - 0.45, p + 0.45, colors="black", linestyles="dashed", label="memory-bandwidth bound")
        ax.set_xticks(range(len(PRECISIONS)), PRECISIONS)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{prompt}-token prompt")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the run ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(peer_models.MODELS), default="gpt2-124m")
    parser.add_argument("--config", choices=sorted(CONFIGS), help="the older name: gpt2 = gpt2-124m, tiny = gpt2-tiny")
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
        default=OPTIMUM_PYTHON,
        help="the interpreter that runs Optimum (default: .venv-optimum/bin/python, see benchmarks/setup_optimum.sh)",
    )
    parser.add_argument(
        "--llamacpp-python",
        type=Path,
        default=llamacpp_peer.LLAMACPP_PYTHON,
        help="the interpreter that runs llama-cpp-python (default: .venv-llamacpp/bin/python, "
        "see benchmarks/setup_llamacpp.sh)",
    )
    parser.add_argument("--shipped-gguf", type=Path, help="also run llama.cpp on this GGUF file as shipped (int4)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--build", choices=OPTIMUM_PRECISIONS, help=argparse.SUPPRESS)
    parser.add_argument("--probe-optimum", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--package", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    if args.build:
        print(json.dumps(build_optimum(args.build, Path(args.path), Path(args.package))))
        return 0
    if args.probe_optimum:
        import optimum.onnxruntime  # noqa: F401  (fails here when the interpreter cannot run Optimum)

        print(json.dumps({name: _version(name) for name in OPTIMUM_VERSIONS}))
        return 0
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
    model = peer_models.MODELS[args.model]
    if model.family == "gpt2":
        optimum = optimum_interpreter(args.optimum_python)
    else:  # the genai_config.json written beside Optimum's export is GPT-2's
        optimum = {"python": str(args.optimum_python), "error": "run on GPT-2 only"}
    llamacpp = llamacpp_peer.interpreter(args.llamacpp_python)
    missing = missing_systems(optimum)
    if "error" in llamacpp:
        missing[LLAMACPP] = llamacpp["error"]
    if "transformers" in missing:
        print(f"error: {missing['transformers']}", file=sys.stderr)
        return 1
    out = Path(args.out) / model.folder_name
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or out / "checkpoint"
    try:
        write_checkpoint(checkpoint, args.model, given=args.checkpoint is not None, rebuild=args.rebuild)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    config = json.loads((checkpoint / "config.json").read_text())
    dims = peer_models.shape(config)
    longest = max(prompt_lengths) + args.new_tokens
    if longest > dims.context:
        parser.error(f"prompt + new tokens ({longest}) exceed the model's context ({dims.context})")
    print("building edgelm packages ...", flush=True)
    try:
        packages = build_edgelm_packages(checkpoint, out, rebuild=args.rebuild)
    except RuntimeError as e:  # a family edgelm does not export yet
        packages = {}
        missing["edgelm"] = missing[GENAI_ON_EDGELM] = f"edgelm's export or quantize failed: {e}"
    optimum_packages, builder_packages, ggufs = {}, {}, {}
    if OPTIMUM not in missing and model.family == "gpt2":
        print(f"building Optimum packages with {args.optimum_python} ...", flush=True)
        optimum_packages = build_optimum_packages(checkpoint, out, python=args.optimum_python, rebuild=args.rebuild)
    if model.family in genai_builder_peer.FAMILIES:
        print("building onnxruntime-genai model builder packages ...", flush=True)
        try:
            builder_packages = genai_builder_peer.build_packages(checkpoint, out, rebuild=args.rebuild)
        except RuntimeError as e:
            missing[GENAI_BUILDER] = str(e)
    if LLAMACPP not in missing:
        print(f"building GGUF files with llama.cpp's converter and {args.llamacpp_python} ...", flush=True)
        try:
            ggufs = llamacpp_peer.build_ggufs(
                checkpoint, out, python=args.llamacpp_python, pre_tokenizer=model.pre_tokenizer, rebuild=args.rebuild
            )
        except (RuntimeError, FileNotFoundError) as e:
            missing[LLAMACPP] = str(e)

    facts = machine()
    print(f"measuring memory bandwidth ({args.threads} threads) ...", flush=True)
    megabytes = 64 if args.model.endswith("-tiny") else 512
    bandwidth = memory_bandwidth(args.threads, megabytes)
    bandwidth["one_thread_gb_per_s"] = memory_bandwidth(1, megabytes)["gb_per_s"]
    print(
        f"  copy {bandwidth['copy_gb_per_s']:.1f} GB/s, read {bandwidth['read_gb_per_s']:.1f} GB/s "
        f"({bandwidth['one_thread_gb_per_s']:.1f} GB/s with 1 thread)",
        flush=True,
    )

    # (row label, child, precision, path, interpreter)
    here, optimum_python = sys.executable, str(args.optimum_python)
    systems = [("transformers", "transformers", "fp32", checkpoint, here)]
    if optimum_packages:
        # ORTModelForCausalLM on Optimum's own recipes; the int4 is not one, it runs under genai only
        systems += [
            (OPTIMUM, "optimum", p, optimum_packages[p]["path"], optimum_python) for p in ("fp32", "int8-dynamic")
        ]
        if GENAI_ON_OPTIMUM not in missing:
            systems += [
                (GENAI_ON_OPTIMUM, "onnxruntime-genai", p, optimum_packages[p]["path"], here)
                for p in OPTIMUM_PRECISIONS
            ]
    systems += [(GENAI_BUILDER, "onnxruntime-genai", p, b["path"], here) for p, b in builder_packages.items()]
    llamacpp_python = str(args.llamacpp_python)
    systems += [(LLAMACPP, "llamacpp", p, g["path"], llamacpp_python) for p, g in ggufs.items()]
    if ggufs and args.shipped_gguf:
        systems.append((LLAMACPP_SHIPPED, "llamacpp", "int4", args.shipped_gguf, llamacpp_python))
    if GENAI_ON_EDGELM not in missing:
        systems += [(GENAI_ON_EDGELM, "onnxruntime-genai", p, packages[p], here) for p in packages]
    systems += [("edgelm", "edgelm", p, packages[p], here) for p in packages]
    for name, reason in missing.items():
        print(f"MISSING {name}: {reason}", flush=True)

    # bytes one decode step reads: every weight (the model file of edgelm's package at that precision;
    # the position table is read one row at a time, 0.6% of GPT-2's) + the KV cache at mean length
    kv_per_token = 2 * dims.n_layer * dims.kv_width * 4
    results, bounds_by_prompt = {}, {}
    for prompt_tokens in prompt_lengths:
        rng = np.random.default_rng(prompt_tokens)
        prompt = rng.integers(0, dims.vocab_size, prompt_tokens)
        prompt = [int(t) if t != dims.eos_token_id else (int(t) + 1) % dims.vocab_size for t in prompt]
        prompt_file = out / f"prompt-{prompt_tokens}.json"
        prompt_file.write_text(json.dumps(prompt))
        mean_context = prompt_tokens + args.new_tokens / 2
        bounds = {}
        for precision, package in packages.items():
            weights = folder_bytes(package, only=(".onnx", ".data"))
            per_token = weights + kv_per_token * mean_context
            bounds[precision] = {
                "bytes_per_token": per_token,
                "tokens_per_s": bandwidth["gb_per_s"] * 1e9 / per_token,
            }
        bounds_by_prompt[prompt_tokens] = bounds
        rows = []
        for system, child, precision, path, python in systems:
            print(f"[{prompt_tokens}-token prompt] {system} {precision} ...", flush=True)
            row = {"system": system, "precision": precision, "prompt_tokens": prompt_tokens}
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
            rows.append(row)
        results[prompt_tokens] = rows

    mismatches = [m for rows in results.values() for m in compare_with_reference(rows)]
    for rows in results.values():
        add_ratios(rows)
    same_package = [
        f"{r['precision']} ({r['prompt_tokens']}-token prompt): {'same ids' if r['same_as_edgelm'] else 'ids DIFFER'}"
        for rows in results.values()
        for r in rows
        if "same_as_edgelm" in r
    ]
    title = (
        f"{model.title}, CPU, {args.threads} threads, "
        f"batch 1, greedy, {args.new_tokens} new tokens, median of {args.repeats}"
    )
    print(f"\n{title}")
    print(f"machine: {facts['nproc']} CPUs, {facts['cpu']}, {facts['ram_gib']} GiB; load average at start ", end="")
    print(f"{facts['load_average_at_start'][0]:.2f}; memory bandwidth {bandwidth['gb_per_s']:.1f} GB/s")
    print("versions:", ", ".join(f"{name} {v}" for name, v in facts["versions"].items() if v))
    if "versions" in optimum:
        versions = optimum["versions"]
        print(f"Optimum interpreter {optimum['python']}:", ", ".join(f"{n} {v}" for n, v in versions.items() if v))
        if versions["onnxruntime"] != facts["versions"]["onnxruntime"]:
            print(
                f"WARNING: Optimum runs onnxruntime {versions['onnxruntime']}, the other systems "
                f"{facts['versions']['onnxruntime']}: the rows differ by more than the system"
            )
    for precision, package in optimum_packages.items():
        print(f"Optimum {precision}: {package['recipe']['summary']}")
    if "versions" in llamacpp:
        print(
            f"llama.cpp interpreter {llamacpp['python']}:",
            ", ".join(f"{n} {v}" for n, v in llamacpp["versions"].items()),
        )
        print(f"llama.cpp system info: {llamacpp['system_info']}")
    for precision, gguf in ggufs.items():
        print(f"llama.cpp {precision}: {gguf['path'].name}, {gguf['recipe']}")
    for precision, package in builder_packages.items():
        print(f"genai model builder {precision}: {package['recipe']}")
    for prompt_tokens, rows in results.items():
        print(f"\n{prompt_tokens}-token prompt\n")
        print(markdown(rows, bounds_by_prompt[prompt_tokens]))
        print(f"\nedgelm against the best peer ({', '.join(PEERS)}), {prompt_tokens}-token prompt\n")
        print(best_peers(rows, bounds_by_prompt[prompt_tokens]))
        print("\n| precision | MB read per decode step | bound tokens/s |\n|---|---|---|")
        for precision, b in bounds_by_prompt[prompt_tokens].items():
            print(f"| {precision} | {b['bytes_per_token'] / 1e6:.0f} | {b['tokens_per_s']:.1f} |")
    print("\nfp32 greedy ids against transformers:", "all identical" if not mismatches else "")
    for m in mismatches:
        gap = m["reference_top2_gap"]
        print(
            f"  MISMATCH {m['system']} {m['precision']}, {m['prompt_tokens']}-token prompt: differs from token "
            f"{m['first_difference']} (transformers' top-1/top-2 logit gap there: "
            f"{'n/a' if gap is None else f'{gap:.2e}'}{'; EOS in the reference' if m['eos_in_reference'] else ''})"
        )
    contended = [
        f"{r['system']} {r['precision']} ({r['prompt_tokens']}): {r['other_cpu_pct']:.0f}%"
        for rows in results.values()
        for r in rows
        if r.get("other_cpu_pct", 0) > CONTENTION_PCT
    ]
    print(
        f"rows measured while other processes used more than {CONTENTION_PCT}% of the CPU: "
        + ("; ".join(contended) if contended else "none")
    )
    if same_package:
        print("onnxruntime-genai against edgelm on the same package:", "; ".join(same_package))
    if missing:
        print("\nnot measured:")
        for name, reason in missing.items():
            print(f"  {name}: {reason}")

    report = {
        "title": title,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": facts,
        "memory_bandwidth": bandwidth,
        "bounds": bounds_by_prompt,
        "results": results,
        "mismatches": mismatches,
        "missing": missing,
        "optimum_interpreter": optimum,
        "optimum_packages": {p: {"path": str(o["path"]), "recipe": o["recipe"]} for p, o in optimum_packages.items()},
        "llamacpp_interpreter": llamacpp,
        "ggufs": {p: {"path": str(g["path"]), "recipe": g["recipe"]} for p, g in ggufs.items()},
        "genai_builder_packages": {
            p: {"path": str(b["path"]), "recipe": b["recipe"]} for p, b in builder_packages.items()
        },
    }
    (out / "peers.json").write_text(json.dumps(report, indent=1))
    plot(results, bounds_by_prompt, out / "peers.png", title)
    print(f"\nwrote {out / 'peers.json'} and {out / 'peers.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
