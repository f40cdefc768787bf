"""The models benchmarks/peers/peers.py measures, as Hugging Face folders every system starts from.

- gpt2-124m: `GPT2LMHeadModel(GPT2Config())`, random weights (seed 0); gpt2-tiny: 2 layers of width 64,
  to check the script in seconds. Written by make_checkpoint.
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

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = REPO / "models" / "shakespeare"  # its tokenizer.json: byte-level BPE, 2,048 tokens
CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"
CONFIGS = {
    "gpt2": {},  # GPT2Config() itself: 12 layers, width 768, 12 heads, vocab 50257, context 1024 (124M)
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4},  # 3.4M parameters (most of them the embedding)
}
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


# ---- the checkpoint every system starts from ----------------------------------------------------


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
    model = MODELS[model_name]
    if given or model_name == "smollm2-135m":
        if model.family == "llama":
            llama_checkpoint(checkpoint)
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
            make_llama_tiny(checkpoint)
            stamp.write_text(json.dumps({"model": model_name}))
    add_n_ctx(checkpoint)  # a GPT-2 checkpoint from before the llama.cpp peer
