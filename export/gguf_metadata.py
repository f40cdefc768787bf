"""What a family module reads a GGUF file with (export/families/): the file's metadata as checked numbers, and
`Entry`, where and how the file stores each Hugging Face tensor. export/gguf.py opens the file and asks the
file's family (its `GGUFLayout`) for the config.json and the tensor map these make.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .limits import checked_number, context_length_problem


class GGUFError(ValueError):
    """A GGUF file that cannot be read: one line saying what is wrong with which file."""


@dataclass(frozen=True)
class Entry:
    gguf_name: str
    shape: tuple[int, ...]  # numpy shape as stored: (out, in) for a linear weight
    transpose: bool = False  # GPT-2 Conv1D: Hugging Face keeps (in, out)
    heads: int = 0  # > 0: undo llama.cpp's rotary row permutation over this many heads
    shift: float = 0.0  # added on reading: -1 for Gemma's norms, which llama.cpp stores as 1 + w
    rows: tuple[int, ...] | None = None  # Hugging Face row i is the file's row rows[i] (Qwen3.5's tiled value heads)
    # Hugging Face column j is the file's column columns[j]: tensor() reorders them; the kept blocks (matmul_nbits)
    # cannot (a block spans neighbouring columns) and keep the file's order, which the family's Decoder then feeds
    columns: tuple[int, ...] | None = None
    inverse: Callable[[np.ndarray], np.ndarray] | None = None  # undoes a rewrite of the values (Qwen3.5's -exp(A_log))


def number(
    meta: dict, key: str, default: Any = None, *, kind: type = int, positive: bool = True, below: float | None = None
) -> Any:
    """Metadata `key` (`default` when absent) as one number of `kind` in range (export/limits.py checked_number)."""
    value = meta.get(key, default)
    if value is None:
        raise GGUFError(f"metadata {key} is missing")
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        with np.errstate(over="ignore"):  # a float64 past float32's range becomes inf, refused below
            value = float(str(np.float32(value)))  # f32 1e-5 -> 1e-05, not 9.99e-06
    try:
        return checked_number(value, f"metadata {key}", kind=kind, positive=positive, below=below)
    except ValueError as error:
        raise GGUFError(str(error)) from None


def context_length(meta: dict, key: str) -> int:
    length = number(meta, key)
    problem = context_length_problem(length)
    if problem:
        raise GGUFError(f"metadata {key} = {problem}")
    return length


def with_head(entries: dict[str, Entry], config: dict, vocab: int, hidden: int) -> dict[str, Entry]:
    """`entries` with the untied LM head's (llama.cpp's output.weight) where config.json says it is untied."""
    if not config["tie_word_embeddings"]:
        entries["lm_head.weight"] = Entry("output.weight", (vocab, hidden))
    return entries
