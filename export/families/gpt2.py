"""GPT-2 (model_type gpt2: gpt2, distilgpt2, gpt2-medium and their fine-tunes): how its folder and its GGUF
file load into the reference model (export/models/gpt2.py), the Decoder that model makes, and its row.

A folder holds `config.json` (GPT-2's config keys) and `model.safetensors` (or a `pytorch_model.bin`,
export/checkpoint.py read_pickle), plus the tokenizer files when there are any. Hugging Face's GPT-2 stores
its projections as `Conv1D` weights, (in, out); ours are `nn.Linear`, (out, in): the four names in TRANSPOSED
are the whole mapping, in both directions (save_checkpoint writes a folder transformers loads).
llama.cpp writes the same weights as `blk.N.attn_qkv.weight` ..., each Conv1D weight stored (out, in).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from edgelm.writers.package_writer import StagedFiles, check_file_output

from ...runtime.contract import TOKENIZER_FILE
from ..checkpoint import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    CheckpointError,
    config_context_length,
    config_errors,
    config_number,
    load_weights,
    read_config,
    read_json,
    read_safetensors_folder,
)
from ..decoder import Decoder, Layer
from ..gguf_metadata import Entry, GGUFError, context_length, number, with_head
from ..limits import MAX_NORM_EPSILON
from ..models.gpt2 import GPT, GPTConfig, sinusoidal_table
from .family import Blocks, Family, GGUFLayout, array, checked_tokens, head_blocks, kept_blocks, linear, norm

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some GPT-2 checkpoints carry that are not parameters (the causal mask).
IGNORED_SUFFIXES = ("attn.bias", "attn.masked_bias")
SUPPORTED_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu"}


def config_from_hf(hf: dict) -> GPTConfig:
    """Map a Hugging Face GPT-2 config.json onto GPTConfig; refuse what this model does not implement."""
    model_type = hf.get("model_type")
    if model_type != "gpt2":
        raise CheckpointError(f"unsupported model_type {model_type!r}: edgelm exports GPT-2-family models ('gpt2')")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise CheckpointError(
            f"unsupported activation_function {activation!r}; supported: {sorted(SUPPORTED_ACTIVATIONS)}"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise CheckpointError(f"config.json sets {flag}=true, which edgelm's GPT-2 does not implement")
    if hf.get("scale_attn_weights") is False:
        raise CheckpointError("config.json sets scale_attn_weights=false, which edgelm's GPT-2 does not implement")
    positions_key = "n_positions" if hf.get("n_positions") is not None else "n_ctx"
    with config_errors():
        return GPTConfig(
            vocab_size=config_number(hf, "vocab_size"),
            n_positions=config_context_length(config_number(hf, positions_key, 1024), positions_key),
            n_embd=config_number(hf, "n_embd"),
            n_layer=config_number(hf, "n_layer"),
            n_head=config_number(hf, "n_head"),
            n_inner=config_number(hf, "n_inner") if hf.get("n_inner") is not None else None,
            positional=hf.get("edgelm_positional", "learned"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            layer_norm_epsilon=config_number(hf, "layer_norm_epsilon", 1e-5, kind=float, below=MAX_NORM_EPSILON),
            activation=SUPPORTED_ACTIVATIONS[activation],
            bos_token_id=config_number(hf, "bos_token_id", 50256, positive=False),
            eos_token_id=config_number(hf, "eos_token_id", 50256, positive=False),
        )


def config_to_hf(config: GPTConfig) -> dict:
    hf = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.n_inner,
        "activation_function": config.activation,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }
    if config.positional != "learned":
        hf["edgelm_positional"] = config.positional  # not a GPT-2 key: transformers ignores it
    return hf


def load_checkpoint(folder: str | Path) -> GPT:
    """Load a GPT-2-layout checkpoint folder into the reference model (eval mode), its weights read when used
    (export/lazy_weights.py)."""
    folder = Path(folder)
    return build_gpt(config_from_hf(read_config(folder)), read_safetensors_folder(folder, lazy=True))


def build_gpt(config: GPTConfig, state: dict[str, torch.Tensor]) -> GPT:
    """The reference model from a Hugging Face GPT-2 state dict (Conv1D weights, (in, out)), every shape checked
    before anything is allocated (a position table of 2**24 rows is only a claim until the tensors bear it out)."""
    model = load_weights(
        lambda: GPT(config), state, prefix="transformer.", embedding="transformer.wte.weight",
        tied=config.tie_word_embeddings, what="GPT-2", ignored=IGNORED_SUFFIXES, transposed=TRANSPOSED,
    )  # fmt: skip
    if config.positional != "learned":  # the buffer is not in the state dict; it was built on meta
        model.sinusoid = sinusoidal_table(config.n_positions, config.n_embd)
    return model.eval()


def _checkpoint_paths(folder: str | Path, extra: Iterable[str]) -> list[Path]:
    folder = Path(folder)
    if folder.is_symlink():
        raise ValueError(f"the output {folder} is a symlink; give the real folder's path (never written through)")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"the output {folder} exists and is not a folder; a checkpoint is written as a folder")
    names = [CONFIG_FILE, SAFETENSORS_FILE, *extra]
    if any(Path(name).name != name or name in ("", ".", "..") for name in names):
        raise ValueError(f"checkpoint files are plain names in the folder, got {names}")
    return [folder / name for name in names]


def check_checkpoint_output(folder: str | Path, *, extra: Iterable[str] = (), overwrite: bool = False) -> None:
    """Raise (ValueError, FileExistsError) when save_checkpoint would refuse `folder` (before any work)."""
    for path in _checkpoint_paths(folder, extra):
        check_file_output(path, overwrite=overwrite)


def save_checkpoint(
    model: GPT, folder: str | Path, *, extra: dict[str, str] | None = None, overwrite: bool = False
) -> None:
    """Write config.json + model.safetensors in Hugging Face GPT-2's layout (loads in transformers), and the
    `extra` text files (name -> text: a tokenizer), through writers/package_writer.py's StagedFiles: a symlinked
    folder or file is refused, an existing file is replaced only with overwrite, and the files appear together."""
    from safetensors.torch import save_file

    extra = extra or {}
    staged = StagedFiles(_checkpoint_paths(folder, extra), overwrite=overwrite)  # before any work
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        state[name] = (tensor.t() if name.endswith(TRANSPOSED) else tensor).contiguous()
    with staged as stage:
        save_file(state, str(stage / SAFETENSORS_FILE), metadata={"format": "pt"})
        (stage / CONFIG_FILE).write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n", encoding="utf-8")
        for name, text in extra.items():
            (stage / name).write_text(text, encoding="utf-8")


def _build_from_gguf(hf: dict, state: dict) -> GPT:
    """GPTConfig keeps one EOS id, which a GGUF export does not use (the package's are the file's own)."""
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        hf = {**hf, "eos_token_id": eos[0] if eos else None}
    return build_gpt(config_from_hf(hf), state)


# GGUF block tensor -> HF name (`transformer.h.N.` + this)
GGUF_BLOCK = {
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    "attn_qkv.weight": "attn.c_attn.weight",
    "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight",
    "attn_output.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight",
    "ffn_norm.bias": "ln_2.bias",
    "ffn_up.weight": "mlp.c_fc.weight",
    "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight",
    "ffn_down.bias": "mlp.c_proj.bias",
}


def gguf_config(meta: dict, stored: dict, vocab: int) -> dict:
    """config.json of a GPT-2 file."""
    hidden, heads = number(meta, "gpt2.embedding_length"), number(meta, "gpt2.attention.head_count")
    if hidden % heads:
        raise GGUFError(f"embedding_length {hidden} is not a multiple of head_count {heads}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_embd": hidden,
        "n_inner": number(meta, "gpt2.feed_forward_length"),
        "n_layer": number(meta, "gpt2.block_count"),
        "n_head": heads,
        "n_positions": context_length(meta, "gpt2.context_length"),
        "layer_norm_epsilon": number(meta, "gpt2.attention.layer_norm_epsilon", kind=float, below=MAX_NORM_EPSILON),
        "tie_word_embeddings": "output.weight" not in stored,
    }


def gguf_tensors(config: dict) -> dict[str, Entry]:
    """HF name -> where and how it is stored, for every tensor of a GPT-2 file."""
    hidden, inner, vocab = config["n_embd"], config["n_inner"], config["vocab_size"]
    entries = {"transformer.wte.weight": Entry("token_embd.weight", (vocab, hidden))}
    entries["transformer.wpe.weight"] = Entry("position_embd.weight", (config["n_positions"], hidden))
    shapes = {"attn_qkv": (3 * hidden, hidden), "attn_output": (hidden, hidden)}
    shapes |= {"ffn_up": (inner, hidden), "ffn_down": (hidden, inner)}
    for layer in range(config["n_layer"]):
        for gguf_suffix, hf_suffix in GGUF_BLOCK.items():
            stem, kind = gguf_suffix.split(".")
            weight = shapes.get(stem, (hidden,))
            shape = weight if kind == "weight" else weight[:1]
            entries[f"transformer.h.{layer}.{hf_suffix}"] = Entry(f"blk.{layer}.{gguf_suffix}", shape, len(shape) == 2)
    entries["transformer.ln_f.weight"] = Entry("output_norm.weight", (hidden,))
    entries["transformer.ln_f.bias"] = Entry("output_norm.bias", (hidden,))
    return with_head(entries, config, vocab, hidden)


def decoder(model: GPT, *, blocks: Blocks | None = None) -> Decoder:
    """blocks: keep the checkpoint's own quantized blocks where it has them (a GGUF file's)."""
    c, t = model.config, model.transformer

    def kept(layer: torch.nn.Linear, name: str):
        return linear(layer, kept_blocks(blocks, [f"{name}.weight"]))

    layers = [
        Layer(
            attention_norm=norm(block.ln_1),
            qkv=kept(block.attn.c_attn, f"transformer.h.{i}.attn.c_attn"),
            attention_out=kept(block.attn.c_proj, f"transformer.h.{i}.attn.c_proj"),
            mlp_norm=norm(block.ln_2),
            up=kept(block.mlp.c_fc, f"transformer.h.{i}.mlp.c_fc"),
            down=kept(block.mlp.c_proj, f"transformer.h.{i}.mlp.c_proj"),
        )
        for i, block in enumerate(t.h)
    ]
    positions = t.wpe.weight if c.positional == "learned" else model.sinusoid
    return Decoder(
        family="gpt2",
        vocab_size=c.vocab_size,
        context_length=c.n_positions,
        n_embd=c.n_embd,
        n_head=c.n_head,
        n_kv_head=c.n_head,
        head_dim=c.head_dim,
        inner_dim=c.inner_dim,
        norm="layer",
        norm_eps=c.layer_norm_epsilon,
        activation=c.activation,
        gated_mlp=False,
        embedding=array(t.wte.weight),
        layers=layers,
        final_norm=norm(t.ln_f),
        lm_head=None if c.tie_word_embeddings else array(model.lm_head.weight).T,
        head_nbits=head_blocks(blocks, c.tie_word_embeddings, "transformer.wte.weight"),
        embedding_nbits=None if c.tie_word_embeddings else kept_blocks(blocks, ["transformer.wte.weight"]),
        position_table=array(positions),
    )


def details(model: GPT) -> dict:
    c = model.config
    return {
        "n_embd": c.n_embd,
        "positional": c.positional,
        "tie_word_embeddings": c.tie_word_embeddings,
        "parameters": model.num_parameters(),
    }


def tokens(checkpoint: Path, model: GPT) -> dict:
    """Token ids from config.json, the pad token from tokenizer_config.json when tokenizer.json has it."""
    config = model.config
    eos, bos = config.eos_token_id, config.bos_token_id
    pad = eos
    tokenizer_config = checkpoint / "tokenizer_config.json"
    if tokenizer_config.is_file() and (checkpoint / TOKENIZER_FILE).is_file():
        names = read_json(tokenizer_config)
        added = read_json(checkpoint / TOKENIZER_FILE).get("added_tokens")
        vocab = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)} if isinstance(added, list) else {}
        pad_name = names.get("pad_token")
        if isinstance(pad_name, str) and pad_name in vocab:
            pad = vocab[pad_name]
    return checked_tokens(config.vocab_size, bos, [eos], pad)


ROWS = (
    Family(
        model_type="gpt2",
        name="gpt2",
        label="GPT-2",
        genai_type="phi",  # genai's decoder-only type; its own "gpt2" expects a legacy combined past_%d cache
        load=load_checkpoint,
        build=_build_from_gguf,
        decoder=decoder,
        details=details,
        tokens=tokens,
        gguf=GGUFLayout(architecture="gpt2", config=gguf_config, tensors=gguf_tensors),
        lora_linears=(
            ("transformer.h.%d.attn.c_attn", "qkv"),
            ("transformer.h.%d.attn.c_proj", "attention_out"),
            ("transformer.h.%d.mlp.c_fc", "up"),
            ("transformer.h.%d.mlp.c_proj", "down"),
        ),
        lazy_weights=True,
    ),
)
