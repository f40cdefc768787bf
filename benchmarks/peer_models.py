"""The models benchmarks/peers.py measures, as Hugging Face folders every system starts from.

- gpt2-124m: `GPT2LMHeadModel(GPT2Config())`, random weights (seed 0); gpt2-tiny: 2 layers of width 64,
  to check the script in seconds. Written by peers.make_checkpoint.
- smollm2-135m: SmolLM2-135M-Instruct's GGUF (Q4_1 blocks, Q8_0 embedding) dequantized into a Llama
  folder, so every system runs the same weights. The folder is made outside this script (see
  SMOLLM2_HOWTO) and passed with --checkpoint; `llama_checkpoint` checks it.
- llama-tiny: a random Llama (2 layers, width 64, grouped-query attention, tied embedding like SmolLM2)
  with models/shakespeare's tokenizer, to check the Llama-family peers in seconds.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO / "models" / "shakespeare"  # its tokenizer.json: byte-level BPE, 2,048 tokens
SMOLLM2_HOWTO = (
    "make the folder of SmolLM2-135M's dequantized weights with scripts/fetch_smollm2.py (it reads the GGUF "
    "through export/gguf.py) and pass it with --checkpoint"
)


@dataclass(frozen=True)
class Model:
    family: str  # config.json's model_type: "gpt2" or "llama"
    title: str  # how the report names it
    pre_tokenizer: str | None  # llama.cpp converter's name for a pre-tokenizer it does not recognize
    folder_name: str  # out/peers/<folder_name>: GPT-2's names predate --model, so old runs are reused


MODELS = {
    "gpt2-124m": Model("gpt2", "GPT-2 124M (random weights)", "gpt-2", "gpt2"),
    "gpt2-tiny": Model("gpt2", "GPT-2 tiny (random weights)", "gpt-2", "tiny"),
    "smollm2-135m": Model("llama", "SmolLM2-135M-Instruct (GGUF weights, dequantized)", "smollm", "smollm2-135m"),
    "llama-tiny": Model("llama", "Llama tiny (random weights)", "gpt-2", "llama-tiny"),
}
LLAMA_TINY = {
    "vocab_size": 2048,  # models/shakespeare's tokenizer
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as SmolLM2 (9 heads, 3 KV heads)
    "max_position_embeddings": 1024,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@dataclass(frozen=True)
class Shape:
    """What peers.py needs from any family's config.json."""

    n_layer: int
    kv_width: int  # key (or value) values per token per layer: KV heads x head size
    context: int  # positions the model was built for
    vocab_size: int
    eos_token_id: int


def shape(config: dict) -> Shape:
    if config["model_type"] == "gpt2":
        return Shape(config["n_layer"], config["n_embd"], config["n_positions"], config["vocab_size"], eos(config))
    heads = config["num_attention_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // heads
    kv_width = config.get("num_key_value_heads", heads) * head_size
    context = config["max_position_embeddings"]
    return Shape(config["num_hidden_layers"], kv_width, context, config["vocab_size"], eos(config))


def eos(config: dict) -> int:
    token = config["eos_token_id"]
    return token[0] if isinstance(token, list) else token


def make_llama_tiny(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA_TINY)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHAKESPEARE / name, folder / name)


def llama_checkpoint(folder: Path) -> Path:
    """Checks that `folder` is a Llama-family Hugging Face folder every peer can start from."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: {SMOLLM2_HOWTO}")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type != "llama":
        raise ValueError(f"{folder} holds a {model_type!r} model, not a Llama-family one")
    missing = [name for name in ("tokenizer.json", "model.safetensors") if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {', '.join(missing)} (the genai builder needs a tokenizer)")
    return folder
