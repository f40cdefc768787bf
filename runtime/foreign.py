"""Readers of package folders that other tools write: onnxruntime-genai's `genai_config.json` and an Optimum
export of GPT-2 (`model.onnx` beside Hugging Face's `config.json`).

Each reader turns the folder's JSON into the facts edgelm.json states (architecture, I/O names, special
tokens); read_package (runtime/package.py) then resolves the model file's name inside the folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from .contract import (
    GENAI_CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    Architecture,
    IONames,
    Tokens,
)
from .errors import PackageError
from .fields import heads, integer, io_name, optional_id, token_list

HF_CONFIG_FILE = "config.json"


@dataclass
class ForeignPackage:
    """What a genai or Optimum folder's JSON says about its package."""

    kind: str  # "genai" or "optimum"
    model_file: object  # as the JSON names it; read_package checks that it is a file inside the folder
    model_file_what: str  # what an error calls that name
    arch: Architecture
    io: IONames
    tokens: Tokens


def read_genai(config: dict) -> ForeignPackage:
    """genai_config.json: model.* holds the vocabulary and special tokens, model.decoder.* the rest."""
    model, decoder = _genai_decoder(config)
    return ForeignPackage(
        kind="genai",
        model_file=decoder.get("filename"),
        model_file_what="decoder filename",
        arch=_genai_architecture(model, decoder),
        io=_genai_io(config, decoder),
        tokens=_tokens(model, f"{GENAI_CONFIG_FILE} model"),
    )


def _genai_decoder(config: dict) -> tuple[dict, dict]:
    """model and model.decoder, with the decoder's inputs and outputs tables checked to be objects."""
    model = config.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise PackageError(f"{GENAI_CONFIG_FILE}: model.decoder is missing")
    if not isinstance(decoder.get("inputs", {}), dict) or not isinstance(decoder.get("outputs", {}), dict):
        raise PackageError(f"{GENAI_CONFIG_FILE}: model.decoder.inputs and .outputs must be objects")
    return model, decoder


def _genai_architecture(model: dict, decoder: dict) -> Architecture:
    # messages name the object a key is in: "genai_config.json model.decoder: num_attention_heads ..."
    in_model, in_decoder = f"{GENAI_CONFIG_FILE} model", f"{GENAI_CONFIG_FILE} model.decoder"
    n_head, n_kv_head = heads(
        decoder, in_decoder, n_head_key="num_attention_heads", n_kv_head_key="num_key_value_heads"
    )
    if decoder.get("head_size") is not None:
        head_dim = integer(decoder, "head_size", in_decoder, minimum=1)
    else:  # derived from hidden_size: an error names the key the file has
        head_dim = integer(decoder, "hidden_size", in_decoder, minimum=n_head) // n_head
    return Architecture(
        type=str(model.get("type", "")),
        vocab_size=integer(model, "vocab_size", in_model, minimum=1),
        context_length=integer(model, "context_length", in_model, minimum=1),
        n_layer=integer(decoder, "num_hidden_layers", in_decoder, minimum=1),
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=head_dim,
    )


def _genai_io(config: dict, decoder: dict) -> IONames:
    inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
    in_inputs, in_outputs = f"{GENAI_CONFIG_FILE} model.decoder.inputs", f"{GENAI_CONFIG_FILE} model.decoder.outputs"
    search = config.get("search")
    shared = isinstance(search, dict) and search.get("past_present_share_buffer") is True
    return IONames(
        input_ids=io_name(inputs, "input_ids", "input_ids", in_inputs),
        attention_mask=io_name(inputs, "attention_mask", "attention_mask", in_inputs),
        position_ids=io_name(inputs, "position_ids", "position_ids", in_inputs, optional=True),
        logits=io_name(outputs, "logits", "logits", in_outputs),
        past_key=io_name(inputs, "past_key_names", IONames.past_key, in_inputs, per_layer=True),
        past_value=io_name(inputs, "past_value_names", IONames.past_value, in_inputs, per_layer=True),
        present_key=io_name(outputs, "present_key_names", IONames.present_key, in_outputs, per_layer=True),
        present_value=io_name(outputs, "present_value_names", IONames.present_value, in_outputs, per_layer=True),
        kv_cache="shared_buffer" if shared else "concat",
    )


def _tokens(data: dict, where: str, *, eos_default: object = None) -> Tokens:
    """Special tokens as genai's model.* and Hugging Face's config.json both name them; pad defaults to EOS."""
    eos = token_list(data.get("eos_token_id", eos_default), where)
    pad = optional_id(data.get("pad_token_id"))
    return Tokens(
        file=TOKENIZER_FILE,
        bos_token_id=optional_id(data.get("bos_token_id")),
        eos_token_ids=eos,
        pad_token_id=pad if pad is not None else eos[0],
    )


def read_optimum(config: dict) -> ForeignPackage:
    """An Optimum export of GPT-2: config.json is Hugging Face's GPT2Config; the graph uses Optimum's names."""
    where = HF_CONFIG_FILE
    if config.get("model_type") != "gpt2":
        raise PackageError(f"{where}: unknown model_type {config.get('model_type')!r} (this runtime runs 'gpt2')")
    n_embd, n_head = integer(config, "n_embd", where, minimum=1), integer(config, "n_head", where, minimum=1)
    tokens = _tokens(config, where, eos_default=50256)  # GPT-2's <|endoftext|>
    arch = Architecture(
        type="gpt2",
        vocab_size=integer(config, "vocab_size", where, minimum=1),
        context_length=integer(config, "n_positions", where, minimum=1),
        n_layer=integer(config, "n_layer", where, minimum=1),
        n_head=n_head,
        n_kv_head=n_head,
        head_dim=n_embd // n_head,
    )
    return ForeignPackage(
        kind="optimum", model_file=MODEL_FILE, model_file_what="model file", arch=arch, io=IONames(), tokens=tokens
    )
