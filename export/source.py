"""What export reads: a Hugging Face-layout checkpoint folder or a GGUF file opened as one `Source`, the
reference model and what the package carries beside it (tokenizer, chat template, the GGUF file's own blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from ..runtime.contract import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Sampling
from ..runtime.files import check_file, kind_of
from ..runtime.package import file_sha256
from .checkpoint import (
    CheckpointError,
    combined_hash,
    read_config,
    read_extras,
    read_sampling,
    source_hashes,
    tokenizer_files,
)
from .families import Blocks, Family, checked_tokens, family_for
from .gguf import read_gguf
from .lazy_weights import TensorLoader, materialize


@dataclass
class Source:
    """What export reads: the reference model and what the package carries beside it."""

    model: torch.nn.Module  # eval mode, the shared forward signature (export/parity.py); lazy weights
    # (export/lazy_weights.py): on the meta device, read from the checkpoint when used
    family: Family
    tokens: dict  # bos_token_id, eos_token_ids, pad_token_id
    name: str  # the checkpoint's name, for the manifest
    sha256: str  # identifies what was exported: the file's, or combined_hash over a folder's files
    hashes: dict[str, str]  # sha256 of every file export read, by name in the folder (or the GGUF file's name)
    files: dict[str, Path] = field(default_factory=dict)  # package file name -> file to copy (tokenizer)
    texts: dict[str, str] = field(default_factory=dict)  # package file name -> contents to write
    chat_template: str | None = None
    blocks: Blocks | None = None  # a GGUF file's own MatMulNBits blocks by tensor name (GGUFModel.lazy_nbits)
    quant_types: dict[str, str] = field(default_factory=dict)  # tensor name -> GGUF type ("Q4_1", "F32", ...)
    sampling: Sampling | None = None  # what a folder's generation_config.json recommends


def check_tokenizer_file(path: Path, vocab_size: int) -> None:
    """CheckpointError unless `path` loads as the runtime will load it, with no more tokens than the embedding has
    rows (fewer is normal: padding rows). Either way the package would never load."""
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # `tokenizers` raises its own plain Exception
        reason = str(e).splitlines()[0] if str(e) else repr(e)
        raise CheckpointError(f"{path} does not load as a tokenizer: {reason}") from None
    if size > vocab_size:
        raise CheckpointError(f"{path} has {size} tokens but the model's embedding only {vocab_size} rows")


def open_folder(folder: Path) -> Source:
    """A Hugging Face-layout checkpoint folder: config.json names the family."""
    hf_config = read_config(folder)
    family = family_for(hf_config.get("model_type"))
    model = family.load(folder)
    if not family.lazy_weights:
        materialize(model)
    hashes = source_hashes(folder)
    files = tokenizer_files(folder)  # each one text (UTF-8) or JSON first: the errors name the file's kind
    if TOKENIZER_FILE in files:
        check_tokenizer_file(files[TOKENIZER_FILE], model.config.vocab_size)
    return Source(
        model=model,
        family=family,
        tokens=family.tokens(folder, model),
        name=folder.resolve().name,
        sha256=combined_hash(hashes),
        hashes=hashes,
        # the package writes its own tokenizer_config.json (export/tokenizer_config.py)
        files={n: p for n, p in files.items() if n != TOKENIZER_CONFIG_FILE},
        chat_template=read_extras(folder)["chat_template"],
        sampling=read_sampling(folder),
    )


def _dequantized(gguf, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.tensor(name))


def _rows(gguf, name: str, indices: torch.Tensor) -> torch.Tensor:
    rows = gguf.rows(name, indices.numpy())
    return torch.from_numpy(rows) if rows is not None else torch.from_numpy(gguf.tensor(name))[indices]


def _row_range(gguf, name: str, start: int, stop: int) -> torch.Tensor:
    return torch.from_numpy(gguf.row_range(name, start, stop))


def _loader(gguf, name: str) -> TensorLoader:
    """`name` unread: whole, some rows (an Embedding's lookup), or a range of rows where the file's rows are the
    tensor's (a Linear's weight read slice by slice)."""
    row_range = partial(_row_range, gguf, name) if gguf.reads_rows(name) else None
    return TensorLoader(gguf.shape(name), partial(_dequantized, gguf, name), partial(_rows, gguf, name), row_range)


def open_gguf(path: Path) -> Source:
    """A GGUF file (llama.cpp's format): weights dequantized to fp32, tokenizer.json built from its
    tokenizer metadata, its chat template kept (export/gguf.py)."""
    gguf = read_gguf(path)
    family = gguf.family
    state = {
        name: _loader(gguf, name) if family.lazy_weights else _dequantized(gguf, name) for name in gguf.tensor_names
    }
    model = family.build(gguf.hf_config, state)  # lazy: each tensor dequantized when used
    if not family.lazy_weights:
        materialize(model)
    tokens = checked_tokens(model.config.vocab_size, gguf.bos_token_id, gguf.eos_token_ids, gguf.pad_token_id)
    sha256 = file_sha256(path)
    return Source(
        model=model,
        family=family,
        tokens=tokens,
        name=path.name,
        sha256=sha256,
        hashes={path.name: sha256},
        texts={TOKENIZER_FILE: gguf.tokenizer_json},
        chat_template=gguf.chat_template,
        blocks=gguf.lazy_nbits,
        quant_types={name: gguf.quant_type(name) for name in gguf.tensor_names},
    )


def open_source(path: str | Path) -> Source:
    """A checkpoint folder or a .gguf file."""
    path = Path(path)
    kind = kind_of(path)
    if path.suffix.lower() == ".gguf" and kind != "a folder":
        check_file(path, "GGUF file", error=CheckpointError)  # missing, or a FIFO or device: said so, not opened
    elif kind not in (None, "a folder", "a regular file"):
        raise CheckpointError(f"{path} is {kind}; a checkpoint is a folder or a .gguf file")
    if kind == "a regular file":
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{path} is a file but not a GGUF file; a checkpoint is a folder or a .gguf file")
        return open_gguf(path)
    return open_folder(path)
