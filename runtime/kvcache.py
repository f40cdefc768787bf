"""The model's cache, whatever kinds of state it holds: the Cache protocol every driver implements, make_cache (the
driver a package wants) and the memory check. Each kind of state is a pair of modules, its manifest record (parsed
and validated there; runtime/contract.py's Architecture holds one of each) and its drivers: attention's keys and
values (runtime/kv_layout.py KVLayout; runtime/kvdrivers.py ConcatCache, SharedCache for the two kinds of graph),
and a hybrid model's convolution and recurrent states (runtime/state_layout.py StateLayout; runtime/statecache.py
StateCache, SharedStateCache beside the KV drivers: LFM2, Qwen3.5).

Every driver implements the `Cache` protocol that the decode loops drive (gpt-fast's KVCache has one job too):

    cache = make_cache(model, prompts, capacity=...)
    logits = cache.prompt()          # (B, V): each row's last prompt position
    logits = cache.next(next_ids)    # (B, V) after one token per row, next_ids (B, 1)
    cache.lengths                    # (B,) tokens held per row
    logits = cache.extend(ids)       # batch 1: feed several more tokens (a chat turn), (V,)
    logits = cache.extend(ids, all_logits=True)  # the same, logits of every fed position (T, V)
    cache.rewind_point(length)       # batch 1: the longest length <= `length` that rewind can go back to
    cache.rewind(length)             # batch 1: forget everything after the first `length` tokens

`plain_feed` builds the feed of an unbound run (a prompt with an empty cache, or a step with a growing
one), for code that runs the session itself: calibration and evaluation. `check_generation_memory` refuses, before
anything is allocated, a generation whose cache and logits would not fit in the memory available.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

import numpy as np

from . import kvdrivers
from .kvdrivers import ConcatCache, SharedCache
from .statecache import SharedStateCache, StateCache

if TYPE_CHECKING:
    from .package import PackageSpec
    from .runner import Runner


class Cache(Protocol):
    """A model's state for a batch of sequences, as the decode loops (runtime/decode.py, speculative.py) and a
    Conversation (runtime/chat.py) drive it. A KV cache keeps every position, so it can rewind to any length it
    holds; a state that does not (a recurrent or convolution state, which folds each token in) says through
    `rewind_point` which lengths it kept a snapshot of (turn boundaries, each position of its last `extend`), and
    its users rewind there and feed the rest again."""

    lengths: np.ndarray  # (B,) tokens held per row

    def prompt(self) -> np.ndarray:
        """Feed the prompts the cache was made with; each row's last position's logits, (B, V)."""
        ...

    def next(self, next_ids: np.ndarray) -> np.ndarray:
        """Feed one token per row, next_ids (B, 1); the logits of each row's new position, (B, V)."""
        ...

    def extend(self, ids: list[int], *, all_logits: bool = False) -> np.ndarray:
        """Batch 1: feed several tokens after what the cache holds; the last position's logits (V,), or every fed
        position's (T, V) with all_logits (speculative decoding checks its guesses with them)."""
        ...

    def rewind_point(self, length: int) -> int:
        """Batch 1: the longest length <= `length` that rewind() can go back to."""
        ...

    def rewind(self, length: int) -> None:
        """Batch 1: forget every token after the first `length` (a length rewind_point returned)."""
        ...


def plain_feed(model: Runner, input_ids: np.ndarray, past: list | None = None) -> dict:
    """The feed for one unbound run: input_ids (B, T) after `past` (the present arrays of the previous
    run, in present_names order, or None for an empty cache). Every row is unpadded."""
    spec = model.spec
    batch, length = input_ids.shape
    layers = spec.arch.cache_layers()
    past_length = 0 if past is None else past[[kind for _, kind in layers].index("key")].shape[2]
    feed = {
        spec.io.input_ids: input_ids.astype(np.int64),
        spec.io.attention_mask: np.ones((batch, past_length + length), dtype=np.int64),
    }
    if model.uses_position_ids:
        positions = np.arange(past_length, past_length + length, dtype=np.int64)
        feed[spec.io.position_ids] = np.broadcast_to(positions, (batch, length)).copy()
    if past is None:
        past = [np.zeros(spec.arch.cache_shape(kind, batch, layer), dtype=model.kv_dtype) for layer, kind in layers]
    feed.update(zip(spec.arch.past_names(spec.io), past, strict=True))
    return feed


# What a generation may allocate for its KV cache and logits: a manifest that lies about its
# architecture or context length, with a large max_new_tokens, must not make the runtime ask for
# hundreds of GiB; the limit is the memory the machine has free (or MAX_GENERATION_BYTES where the OS
# does not say).
MAX_GENERATION_BYTES = 64 << 30


def kv_cache_bytes(spec: PackageSpec, *, batch: int, capacity: int, itemsize: int = 4) -> int:
    """Bytes of a (batch, KV heads, capacity, head size) key and value buffer for every layer that keeps its own
    (a layer reading another's cache keeps none; heads and head sizes per layer), plus a hybrid model's
    fixed-size states (which do not grow with the context)."""
    arch = spec.arch
    if arch.states.layer_types is None and arch.kv.uniform:
        return 2 * arch.n_layer * batch * arch.n_kv_head * capacity * arch.head_dim * itemsize
    shapes = [arch.cache_shape(kind, batch, layer, capacity) for layer, kind in arch.cache_layers()]
    return sum(int(np.prod(shape)) for shape in shapes) * itemsize


def available_memory_bytes() -> int:
    """Memory a new allocation can get: Linux's MemAvailable (free + reclaimable cache), else the free
    physical pages, else MAX_GENERATION_BYTES."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not every OS names these
        return MAX_GENERATION_BYTES


def check_generation_memory(spec: PackageSpec, prompt_lengths: list[int], *, new_tokens: int, kv_dtype=None) -> None:
    """Raise MemoryError (a clear one, before allocating) when a batch's KV cache plus the logits of one prompt
    run (batch, at most PREFILL_CHUNK tokens, vocab) would not fit in the memory available."""
    batch, width = len(prompt_lengths), max(prompt_lengths)
    capacity = width + new_tokens
    itemsize = 4 if kv_dtype is None else kv_dtype().itemsize
    needed = kv_cache_bytes(spec, batch=batch, capacity=capacity, itemsize=itemsize)
    needed += batch * min(width, kvdrivers.PREFILL_CHUNK) * spec.arch.vocab_size * 4
    limit = min(available_memory_bytes(), MAX_GENERATION_BYTES)
    if needed > limit:
        raise MemoryError(
            f"this generation needs {needed / 2**30:.1f} GiB for its KV cache and logits (batch {batch}, "
            f"{capacity} positions, {spec.arch.n_layer} layers x {spec.arch.n_kv_head} KV heads x "
            f"{spec.arch.head_dim}), more than the {limit / 2**30:.1f} GiB available; lower max_new_tokens or "
            "the batch size"
        )


def make_cache(model: Runner, prompts: list[list[int]], *, capacity: int) -> Cache:
    """The driver the package's graph wants (its manifest's io.kv_cache; a hybrid model's layer states)."""
    if model.spec.arch.has_state:
        if model.spec.io.kv_cache == "shared_buffer":
            return SharedStateCache(model, prompts, capacity=capacity)
        return StateCache(model, prompts)
    if model.spec.io.kv_cache == "shared_buffer":
        return SharedCache(model, prompts, capacity=capacity)
    return ConcatCache(model, prompts)
