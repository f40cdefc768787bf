"""SmolLM2-135M's GGUF weights, dequantized, as the Hugging Face folder benchmarks/peers/peers.py starts from.

Every system in the SmolLM2 benchmark runs these same float32 weights (the Q4_1 blocks and the Q8_0
embedding of the shipped file, dequantized by edgelm's GGUF reader, export/gguf.py): transformers
directly, llama.cpp after converting the folder back to GGUF, onnxruntime-genai after its builder, edgelm
after `edgelm export`. Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json.

    python benchmarks/peers/smollm2_folder.py OUT [--gguf FILE]     # default: the file scripts/fetch_smollm2.py caches
    python benchmarks/peers/smollm2_folder.py OUT --check           # also: transformers loads it, greedy ids = edgelm's
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))


def write_folder(gguf_file: Path, out: Path) -> dict:
    """Writes the folder from `gguf_file`; returns its config.json content."""
    from safetensors.numpy import save_file

    from edgelm.export.gguf import read_gguf

    model = read_gguf(gguf_file)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(model.tensor(name), dtype=np.float32) for name in model.tensor_names}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in model.hf_config.items() if v is not None} | {"torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokens = {"bos_token_id": model.bos_token_id, "eos_token_id": config["eos_token_id"]}
    if model.pad_token_id is not None:
        tokens["pad_token_id"] = model.pad_token_id
    (out / "generation_config.json").write_text(json.dumps(tokens, indent=2))
    (out / "tokenizer.json").write_text(model.tokenizer_json)
    vocab = json.loads(model.tokenizer_json)["model"]["vocab"]
    names = {i: token for token, i in vocab.items()}
    context = config["max_position_embeddings"]
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context}
    for key, token_id in (("bos_token", model.bos_token_id), ("eos_token", model.eos_token_ids[0])):
        if token_id is not None and token_id in names:
            tokenizer_config[key] = names[token_id]
    if model.chat_template:
        tokenizer_config["chat_template"] = model.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return config


def check(folder: Path, package: Path, *, new_tokens: int = 16) -> tuple[list[int], list[int]]:
    """Greedy ids from transformers on `folder` and from edgelm's fp32 `package` (exported from it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from edgelm.runtime import load

    prompt = np.random.default_rng(0).integers(0, 49_152, 12).tolist()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens
        )
    reference = out[0, len(prompt) :].tolist()
    ours = load(package, provider="cpu", threads=2).generate(prompt, new_tokens, ignore_eos=True).token_ids
    return reference, list(ours)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--gguf", type=Path, help="SmolLM2-135M's GGUF (default: fetched and cached)")
    parser.add_argument("--check", action="store_true", help="export with edgelm and compare greedy ids")
    args = parser.parse_args()
    if args.gguf is None:
        from fetch_smollm2 import fetch_smollm2

        args.gguf = fetch_smollm2()
    config = write_folder(args.gguf, args.out)
    shape = f"{config['num_hidden_layers']} layers, width {config['hidden_size']}, vocab {config['vocab_size']}"
    print(f"{args.out}: {shape}")
    if args.check:
        import subprocess

        package = args.out.parent / f"{args.out.name}-edgelm-fp32-check"
        command = [sys.executable, "-m", "edgelm", "export", str(args.out), str(package), "--overwrite"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        reference, ours = check(args.out, package)
        print(f"transformers: {reference}\nedgelm fp32:  {ours}")
        if reference != ours:
            print("greedy ids DIFFER", file=sys.stderr)
            return 1
        print("greedy ids identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
