"""Helpers shared by the test files (pytest puts tests/ on sys.path, so `from helpers import ...`): a silent
progress callback, package copies and manifest edits, the `edgelm` command in a subprocess, a random
transformers model saved as a checkpoint folder, greedy runs of transformers and onnxruntime-genai, and a
GGUF file rewritten with changed metadata."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BUNDLED_TOKENIZER = REPO / "models" / "shakespeare" / "tokenizer.json"  # 2048 tokens, <|endoftext|> = 0


def quiet(_: str) -> None:
    """A progress callback that prints nothing."""


def copy_package(package: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(package, tmp_path / name))


def folded_graph(package: Path, tmp_path: Path, *, level: str = "basic"):
    """(graph, initializer name -> array) of the package's model.onnx as ONNX Runtime runs it, after its graph
    optimizations at `level` ("basic", "extended", "all"): compact blocks' unpacking folded into MatMulNBits'
    constant inputs (export/compact_blocks.py)."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    folder = tmp_path / f"folded-{level}"
    folder.mkdir()
    for name in ("model.onnx", "model.onnx.data"):  # the optimized model points into the same data file
        if (package / name).exists():
            shutil.copyfile(package / name, folder / name)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{level.upper()}")
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(folder / "optimized.onnx")).graph
    return graph, {i.name: numpy_helper.to_array(i) for i in graph.initializer}


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_manifest(package: Path, edit: Callable[[dict], None]) -> None:
    """The manifest lists every file but itself, so editing it keeps the hash check passing."""
    edit_json(package / "edgelm.json", edit)


def edgelm(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m edgelm ARGS` in a subprocess, its output captured as UTF-8 text."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    command = [sys.executable, "-m", "edgelm", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, encoding="utf-8", env=env, cwd=cwd, timeout=timeout)


def save_random_model(folder: Path, classes: tuple[str, str], config: dict, *, seed: int = 0):
    """A random transformers model (config class, model class) saved with save_pretrained beside the bundled
    tokenizer; returned in eval mode. Biases and norms are drawn away from transformers' zeros and ones so that
    each one counts (Gemma's norms store w of 1 + w, so they are drawn around zero)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, classes[1])(getattr(transformers, classes[0])(**config)).eval()
    gemma = "Gemma" in classes[1] and "Gemma4" not in classes[1]  # Gemma 4's norms scale by w itself
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5) if gemma else param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, 1 when initialized
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    shutil.copyfile(BUNDLED_TOKENIZER, folder / "tokenizer.json")
    model.generation_config.eos_token_id = None  # transformers generates exactly the tokens asked for
    return model


def hf_greedy(hf, prompt: list[int], new_tokens: int, *, pad_token_id: int = 0) -> list[int]:
    """transformers' greedy continuation of `prompt`."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad_token_id)
    return out[0, len(prompt) :].tolist()


def genai_greedy(folder: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """onnxruntime-genai's greedy continuation of `prompt` by the package in `folder` (skipped without genai)."""
    og = pytest.importorskip("onnxruntime_genai")
    genai_model = og.Model(str(folder))
    params = og.GeneratorParams(genai_model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(genai_model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    sequence = [int(t) for t in generator.get_sequence(0)]
    assert sequence[: len(prompt)] == prompt
    return sequence[len(prompt) :]


def rewrite_gguf(
    source: Path, target: Path, changes: dict, *, add: Callable | None = None, tensors: dict | None = None
) -> Path:
    """The GGUF file `source` with metadata `changes` applied: key -> (value, type) or (value, ARRAY, item type),
    None removes it; then `add(writer)`, if given, writes more keys (and tensors, first). Tensors are copied as
    they are but those `tensors` names: name -> its new float array (written F32), None removes it."""
    tensors = tensors or {}
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(source)
    writer = GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        writer.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for key, change in changes.items():
        if change is not None:
            value, kind, *item = change
            writer.add_key_value(key, value, kind, item[0] if item else None)
    if add is not None:
        add(writer)
    for tensor in reader.tensors:
        if tensor.name not in tensors:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        elif tensors[tensor.name] is not None:
            writer.add_tensor(tensor.name, np.asarray(tensors[tensor.name], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


# ---- LoRA: tiny bases and random PEFT adapters (tests/export/test_lora_*.py) ----------------------------------

LORA_BASES = {  # name: (transformers classes, config)
    "llama": (("LlamaConfig", "LlamaForCausalLM"), dict(
        vocab_size=2048, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=128, max_position_embeddings=128, rope_theta=1e5, rms_norm_eps=1e-5, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, initializer_range=0.15, tie_word_embeddings=True)),
    "qwen2": (("Qwen2Config", "Qwen2ForCausalLM"), dict(
        vocab_size=2048, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=96, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, initializer_range=0.15, tie_word_embeddings=False)),
    "gpt2": (("GPT2Config", "GPT2LMHeadModel"), dict(
        vocab_size=2048, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        initializer_range=0.15)),
}  # fmt: skip
LORA_ATTENTION = {"gpt2": ["c_attn", "attn.c_proj"], "llama": ["q_proj", "k_proj", "v_proj", "o_proj"]}
LORA_MLP = {"gpt2": ["c_fc", "mlp.c_proj"], "llama": ["gate_proj", "up_proj", "down_proj"]}


def lora_targets(base: str, *, mlp: bool) -> list[str]:
    family = "gpt2" if base == "gpt2" else "llama"
    return LORA_ATTENTION[family] + (LORA_MLP[family] if mlp else [])


def save_lora_base(folder: Path, base: str, *, seed: int = 0):
    classes, config = LORA_BASES[base]
    return save_random_model(folder, classes, config, seed=seed)


def save_peft_adapter(hf, folder: Path, *, r: int, targets: list[str], rslora: bool = False, seed: int = 1, **extra):
    """A random PEFT LoRA adapter on a copy of `hf` (B drawn non-zero, so the adapter matters), saved to folder;
    returns the PeftModel (the reference)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    fan_in_fan_out = type(hf).__name__.startswith("GPT2")
    alpha = extra.pop("lora_alpha", 2 * r)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False,
                        fan_in_fan_out=fan_in_fan_out, **extra)  # fmt: skip
    peft_model = get_peft_model(copy.deepcopy(hf), config).eval()
    peft_model.save_pretrained(folder)
    return peft_model


def torch_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by repeated full forward passes (any causal LM, a PeftModel included)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
