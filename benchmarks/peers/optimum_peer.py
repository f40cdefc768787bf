"""Optimum as a peer for benchmarks/peers/peers.py: ORTModelForCausalLM on Optimum's export (fp32) and its
ORTQuantizer dynamic int8, plus a MatMulNBits int4 of that export for onnxruntime-genai. All of it runs in a
second interpreter (optimum[onnxruntime] needs transformers<4.58; benchmarks/peers/setup_optimum.sh makes it)."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import time
from pathlib import Path

from peer_common import PEERS_SCRIPT, REPO, onnx_file, read_lines, timed_child, version_of
from transformers_peer import generate_runs

OPTIMUM_PRECISIONS = ("fp32", "int8-dynamic", "int4")  # the Optimum export, ORTQuantizer's int8, MatMulNBits int4
OPTIMUM_PYTHON = REPO / ".venv-optimum" / "bin" / "python"  # made by benchmarks/peers/setup_optimum.sh
OPTIMUM_VERSIONS = ("optimum", "optimum-onnx", "transformers", "torch", "onnxruntime", "onnx", "accelerate", "numpy")

# ---- the interpreter and the packages, seen from the main process --------------------------------


def optimum_interpreter(python: Path) -> dict:
    """The interpreter that runs Optimum: its versions, or "error", why it cannot. It is a venv of its
    own because optimum[onnxruntime] (optimum-onnx 0.1.0) needs transformers<4.58, and installing it
    here would downgrade the transformers 5 (and tokenizers) that the transformers baseline runs on."""
    setup = "run benchmarks/peers/setup_optimum.sh to make it, or pass --optimum-python"
    if not python.is_file():
        return {"python": str(python), "error": f"no Optimum interpreter at {python}: {setup}"}
    done = subprocess.run([str(python), str(PEERS_SCRIPT), "--probe-optimum"], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"python": str(python), "error": f"{python} cannot run Optimum ({last}): {setup}"}
    return {"python": str(python), "versions": json.loads(done.stdout.strip().splitlines()[-1])}


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
            command = [
                str(python),
                str(PEERS_SCRIPT),
                "--build",
                precision,
                "--path",
                str(source),
                "--package",
                str(package),
            ]
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


# ---- in the Optimum interpreter ------------------------------------------------------------------


def probe() -> dict:
    """The versions this interpreter runs Optimum with; fails here when it cannot run Optimum."""
    import optimum.onnxruntime  # noqa: F401

    return {name: version_of(name) for name in OPTIMUM_VERSIONS}


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
    tied = "deduplicated" if version_of("accelerate") else "duplicated (Optimum deduplicates them with accelerate)"
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

    flags = next(
        (line.split(":", 1)[1].split() for line in read_lines("/proc/cpuinfo") if line.startswith("flags")), []
    )
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
    return {"load_s": load_s, "runs": generate_runs(model, prompt, args)}
