"""Read a GGUF file (llama.cpp's model format) as a Hugging Face checkpoint: config, tokenizer.json, tensors.

The header is read by export/gguf_header.py (bounded, checked), the tensor data memory-mapped, and the
quantized tensors dequantized with llama.cpp's own Python package (`gguf`), one tensor at a time, on demand.
The file's general.architecture names its family (export/families/), whose `GGUFLayout` says what config.json
the metadata makes and where each Hugging Face tensor is stored: its name (`blk.N.attn_q.weight` is
`model.layers.N.self_attn.q_proj.weight`), its shape, and what llama.cpp's converter did to it (Llama's
permuted Q/K rows, which `_unpermute_rows` puts back; GPT-2's Conv1D weights stored (out, in); Gemma's norms
stored as 1 + w; Qwen3.5's value heads reordered and A_log stored as -exp(A_log)): an `Entry`
(export/gguf_metadata.py).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from .checkpoint import CheckpointError
from .families import Family, gguf_family
from .gguf_blocks import SUPPORTED_TYPES, LazyRuns, Runs, by_rows, lazy_runs, to_runs
from .gguf_header import HeaderError, read_header
from .gguf_metadata import Entry, GGUFError, number
from .gguf_tokenizer import build_tokenizer_json, end_of_generation_ids

__all__ = ["GGUFError", "GGUFModel", "read_gguf"]

TOKEN_IDS = ("bos", "eos", "eot", "padding", "unknown")  # the tokenizer.ggml.{name}_token_id keys export reads


class _Stored(NamedTuple):
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length
    data: np.ndarray  # uint8 (rows, bytes per row), memory-mapped: what gguf.quants.dequantize takes
    pages: Callable[[], None] | None = None  # lets go of the pages of `data` this process has read (_forget)


def _drop_pages(mapping: mmap.mmap, start: int, length: int) -> None:
    """Let go of the mapped file's pages in [start, start + length) (whole pages within it): the kernel keeps them
    in its page cache, but they no longer count as this process's memory, which would otherwise grow to the
    whole file as export reads it tensor by tensor."""
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def _forget(stored: _Stored) -> None:
    if stored.pages is not None and hasattr(mmap, "MADV_DONTNEED"):
        stored.pages()


def _forgotten(load: Callable[[], Runs], stored: _Stored) -> Runs:
    runs = load()
    _forget(stored)
    return runs


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """GGUF rows per head (hd/2, 2) interleaved -> HF (2, hd/2) halves; works on any trailing dimensions."""
    head_dim = rows.shape[0] // heads
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _row_change(entry: Entry) -> Callable[[np.ndarray], np.ndarray] | None:
    """What puts the file's rows of `entry` (of any array with one row per output) in Hugging Face order."""
    if entry.heads:
        return lambda a: _unpermute_rows(a, entry.heads)
    if entry.rows is not None:
        order = np.array(entry.rows, dtype=np.int64)
        return lambda a: a[order]
    return None


@dataclass
class GGUFModel:
    path: Path
    architecture: str  # general.architecture
    family: Family  # the row that architecture names (export/families/)
    hf_config: dict  # what a Hugging Face config.json for this model would say
    tokenizer_json: str  # tokenizer.json text built from tokenizer.ggml.*
    chat_template: str | None  # tokenizer.chat_template
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    tensor_names: list[str]  # Hugging Face names, in file order
    _entries: dict[str, Entry] = field(repr=False, default_factory=dict)
    _stored: dict[str, _Stored] = field(repr=False, default_factory=dict)  # GGUF name -> its memory-mapped data

    def _lookup(self, name: str):
        if name not in self._entries:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        entry = self._entries[name]
        return entry, self._stored[entry.gguf_name]

    def quant_type(self, name: str) -> str:
        """The GGUF tensor type of `name`: "F32", "F16", "Q8_0", "Q4_0", "Q4_1", ..."""
        return self._lookup(name)[1].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape `tensor(name)` returns (Hugging Face orientation), without reading it."""
        entry = self._lookup(name)[0]
        return tuple(reversed(entry.shape)) if entry.transpose else tuple(entry.shape)

    def reads_rows(self, name: str) -> bool:
        """Whether the file's rows of `name` are the tensor's own, so that some of them can be dequantized alone
        (not a transposed, permuted or changed one)."""
        entry = self._lookup(name)[0]
        moved = entry.heads or entry.rows is not None or entry.columns is not None or entry.inverse is not None
        return not (entry.transpose or moved or len(entry.shape) != 2)

    def rows(self, name: str, indices: np.ndarray) -> np.ndarray | None:
        """Rows `indices` of tensor(name), dequantizing only them; None where the file's rows are not the
        tensor's (reads_rows)."""
        if not self.reads_rows(name):
            return None
        entry, stored = self._lookup(name)
        weight = np.array(dequantize(stored.data[indices], stored.tensor_type), dtype=np.float32)
        return weight.reshape(len(indices), entry.shape[1]) + np.float32(entry.shift)

    def row_range(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor(name), dequantizing only them (reads_rows(name) must hold); the mapped
        pages read are let go, as tensor() lets go of its. What reads a large tensor a slice at a time: gguf-py's
        dequantizers take about twice the float32 result in temporaries (3.4 GB for a 1B model's tied head)."""
        assert self.reads_rows(name), f"{name}: the file's rows are not the tensor's; read it whole"
        entry, stored = self._lookup(name)
        weight = np.array(dequantize(stored.data[start:stop], stored.tensor_type), dtype=np.float32)
        _forget(stored)
        return weight.reshape(-1, entry.shape[1]) + np.float32(entry.shift)

    def tensor(self, name: str) -> np.ndarray:
        """`name` dequantized to a new float32 array in Hugging Face orientation."""
        entry, stored = self._lookup(name)
        weight = np.array(dequantize(stored.data, stored.tensor_type), dtype=np.float32).reshape(entry.shape)
        _forget(stored)
        change = _row_change(entry)
        if change is not None:
            weight = change(weight)
        if entry.columns is not None:
            weight = weight[:, list(entry.columns)]
        if entry.shift:
            weight += np.float32(entry.shift)
        if entry.inverse is not None:
            weight = entry.inverse(weight).astype(np.float32)
        return np.ascontiguousarray(weight.T) if entry.transpose else weight

    def lazy_nbits(self, name: str) -> LazyRuns | None:
        """matmul_nbits(name), unpacked only when used (what export keeps: one linear's blocks unpacked at a time)."""
        entry, stored = self._lookup(name)
        if len(entry.shape) != 2:
            return None
        runs = lazy_runs(stored.tensor_type, stored.data, entry.shape[1], _row_change(entry))
        if runs is None:
            return None
        some = None if runs.rows is None else lambda start, stop: _forgotten(lambda: runs.rows(start, stop), stored)
        return runs.with_load(lambda: _forgotten(runs.load, stored), some)

    def matmul_nbits(self, name: str) -> Runs | None:
        """Linear weight `name` (N = out features, K = in features) as MatMulNBits runs, from its own quantized
        blocks without requantizing (export/gguf_blocks.py); None for float types and those with no such form. Its
        rows are the Hugging Face tensor's, its columns the file's (Entry.columns)."""
        entry, stored = self._lookup(name)
        if len(entry.shape) != 2:
            return None
        runs = to_runs(stored.tensor_type, stored.data, entry.shape[1])
        change = _row_change(entry)
        return runs if runs is None or change is None else by_rows(runs, change)


def _token_id(meta: dict, key: str, vocab: int) -> int | None:
    """Token id `key`, absent or one integer inside the tokenizer's `vocab` tokens (1.5 is not read as 1)."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"metadata {key} should be one integer token id, not {value!r:.60}")
    if not 0 <= value < vocab:
        raise GGUFError(f"metadata {key} = {value} is outside the tokenizer's {vocab} tokens")
    return value


def _one_line(path: Path, error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__  # a hostile name may hold newlines
    return f"{path.name}: {text[:300]}"


def read_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file of an architecture a family names (export/families/); GGUFError (one line) when it cannot
    be used."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        header = read_header(path)
    except (HeaderError, UnicodeDecodeError) as error:
        raise GGUFError(_one_line(path, error)) from None
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    file = np.asarray(mapped)  # a plain view: np.memmap slices cost per call
    stored = {}
    for t in header.tensors:
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        rows = file[t.start : t.start + t.nbytes].reshape(-1, t.dims[0] // block * type_size)
        stored[t.name] = _Stored(t.tensor_type, t.dims, rows, partial(_drop_pages, mapped._mmap, t.start, t.nbytes))
    try:
        return _build(path, stored, header.metadata)
    except (GGUFError, CheckpointError) as error:  # CheckpointError: the config the metadata makes, refused
        raise GGUFError(_one_line(path, error)) from None


def _build(path: Path, stored: dict[str, _Stored], meta: dict) -> GGUFModel:
    arch = meta.get("general.architecture")
    family = gguf_family(arch)
    for name, t in stored.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise GGUFError(f"tensor {name} has type {t.tensor_type.name}, not supported")
    if "token_embd.weight" not in stored:
        raise GGUFError("tensor token_embd.weight is missing")
    embedding = tuple(reversed(stored["token_embd.weight"].shape))
    if len(embedding) != 2:  # its rows are the vocabulary the config is made with, before _check_tensors
        hidden = number(meta, f"{arch}.embedding_length")
        raise GGUFError(f"tensor token_embd.weight has shape {embedding}, expected (vocabulary, {hidden})")
    vocab = int(embedding[0])
    config = family.gguf.config(meta, stored, vocab)
    blocks = meta[f"{arch}.block_count"]  # every llama.cpp architecture's key, checked by the family's config
    if blocks > len(stored):  # before the tensor map makes an entry for each
        raise GGUFError(f"{len(stored)} tensors cannot hold the {blocks} blocks it claims")
    entries = family.gguf.tensors(config)
    left_out = family.gguf.left_out(config) if family.gguf.left_out else ()
    _check_tensors(stored, entries, arch, also=family.gguf.also_read, left_out=left_out)
    ids, tokenizer_json = _tokenizer(meta, vocab)
    bos, pad = ids["bos"], ids["padding"]
    eos_ids = list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], *end_of_generation_ids(meta)) if i is not None))
    config |= {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    chat_template = meta.get("tokenizer.chat_template")
    if not isinstance(chat_template, str):
        chat_template = family.gguf.chat_template
    return GGUFModel(
        path=path,
        architecture=arch,
        family=family,
        hf_config=config,
        tokenizer_json=tokenizer_json,
        chat_template=chat_template,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        tensor_names=list(entries),
        _entries=entries,
        _stored=stored,
    )


def _check_tensors(
    stored: dict[str, _Stored], entries: dict, arch: str, *, also: tuple[str, ...], left_out: tuple[str, ...] = ()
) -> None:
    """Every tensor the family expects is there with its shape, and no other (but those `also` read and those
    whose names start with one of `left_out`)."""
    for hf_name, entry in entries.items():
        if entry.gguf_name not in stored:
            raise GGUFError(f"tensor {entry.gguf_name} ({hf_name}) is missing")
        shape = tuple(reversed(stored[entry.gguf_name].shape))
        if shape != entry.shape:
            raise GGUFError(f"tensor {entry.gguf_name} has shape {shape}, expected {entry.shape}")
    extra = {name for name in stored if not name.startswith(left_out)} - {e.gguf_name for e in entries.values()}
    extra -= set(also)
    if extra:
        raise GGUFError(f"unexpected tensor {sorted(extra)[0]} for architecture {arch}")


def _tokenizer(meta: dict, vocab: int) -> tuple[dict[str, int | None], str]:
    """The special token ids (TOKEN_IDS -> id or None) and tokenizer.json built from the tokenizer metadata."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError("tokenizer.ggml.tokens is missing or not a list of tokens")
    if len(tokens) > vocab:  # fewer is normal: padding rows
        raise GGUFError(f"the tokenizer has {len(tokens)} tokens but token_embd.weight only {vocab} rows to embed them")
    ids = {name: _token_id(meta, f"tokenizer.ggml.{name}_token_id", len(tokens)) for name in TOKEN_IDS}
    try:
        tokenizer_json = build_tokenizer_json(meta)
    except Exception as error:  # `tokenizers` raises its own plain Exception on a bad vocabulary
        raise GGUFError(f"tokenizer: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    return ids, tokenizer_json
