"""Bounds on what a checkpoint's config may claim, checked where the value is read, before export allocates
anything sized by it (a config is a few bytes; what it sizes is not).

The context length sizes the tables with one row per position that export builds and the package holds: the
rotary cos/sin caches (positions, head_dim / 2) of the fused Llama-family graph, GPT-2's sinusoidal table
(positions, n_embd). (GPT-2's learned position table is a checkpoint tensor: its shape is checked against the
file before anything is built.) Those tables count positions in float32, which holds every integer only up to
2**24, so a longer context could not be represented even with the memory for it; and a table must fit in the
memory the runtime's own generation check would grant (runtime/kvcache.py), or the package could never load.
"""

from __future__ import annotations

import math

MAX_CONTEXT_LENGTH = 1 << 24  # float32 positions are exact integers up to here
# export's accuracy check (export/parity.py) runs a prompt and five decode steps: a shorter context cannot be checked
MIN_CONTEXT_LENGTH = 8
MAX_NORM_EPSILON = 1.0  # an epsilon this large swamps the variance it is added to: not a trained model's


def checked_number(
    value: object, what: str, *, kind: type = int, positive: bool = True, below: float | None = None
) -> int | float:
    """`value` as one number of `kind`, or ValueError naming `what`. An int is an integer (not a float: 1.5 is not
    read as 1; not a bool, string or list) in [1, 2**31), [0, 2**31) when not `positive`; a float is finite, above 0
    when `positive`, and below `below` when given. A NaN, zero or negative rotary base or norm epsilon makes a
    model that can never generate; a fractional head count or id was always a mistake."""
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise ValueError(f"{what} should be a single {kind.__name__}, not {value!r:.60}")
    if kind is int:
        if not (0 < value if positive else 0 <= value) or value >= 1 << 31:
            raise ValueError(f"{what} = {value} is out of range")
        return int(value)
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0) or (below is not None and value >= below):
        wanted = (
            "a finite number"
            + (" above 0" if positive else "")
            + (f" and below {below:g}" if below is not None else "")
        )
        raise ValueError(f"{what} = {value} is out of range: it must be {wanted}")
    return value


def context_length_problem(length: int) -> str | None:
    """Why `length` positions cannot be exported, or None when it can."""
    if length > MAX_CONTEXT_LENGTH:
        return (
            f"{length} is above edgelm's limit of {MAX_CONTEXT_LENGTH} (2**24) positions: position tables are float32, "
            "which holds positions exactly only up to 2**24"
        )
    if length < MIN_CONTEXT_LENGTH:
        return f"{length} is below {MIN_CONTEXT_LENGTH} positions, the fewest export's accuracy check needs"
    return None


def check_table_memory(positions: int, width: int, what: str) -> None:
    """MemoryError (clear, before allocating) when `what`, positions * width float32 values, would not fit twice
    in the memory a generation may use (runtime/kvcache.py: what is available, at most MAX_GENERATION_BYTES).
    Twice: export holds a table and its graph copy at once (measured: tables of 256 MiB raised its peak 366 MiB),
    as ONNX Runtime does folding the rotary tables a graph computes (64 MiB of them raised a load's peak 126 MiB)."""
    from ..runtime.kvcache import MAX_GENERATION_BYTES, available_memory_bytes  # numpy and onnxruntime: not at import

    needed = 2 * positions * width * 4
    limit = min(available_memory_bytes(), MAX_GENERATION_BYTES)
    if needed > limit:
        raise MemoryError(
            f"{what} for a context of {positions} positions need {needed / 2**30:.1f} GiB while they are built, "
            f"more than the {limit / 2**30:.1f} GiB available; the checkpoint's context length is too long for this "
            "machine"
        )
