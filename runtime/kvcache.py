"""The KV cache: how past keys and values move between decode steps, for the two kinds of graph; and, for hybrid
models (LFM2, Qwen3.5), the convolution and recurrent states beside them (StateCache, SharedStateCache).

Every driver implements the `Cache` protocol that the decode loops drive (gpt-fast's KVCache has one job too):

    cache = make_cache(model, prompts, capacity=...)
    logits = cache.prompt()          # (B, V): each row's last prompt position
    logits = cache.next(next_ids)    # (B, V) after one token per row, next_ids (B, 1)
    cache.lengths                    # (B,) tokens held per row
    logits = cache.extend(ids)       # batch 1: feed several more tokens (a chat turn), (V,)
    logits = cache.extend(ids, all_logits=True)  # the same, logits of every fed position (T, V)
    cache.rewind_point(length)       # batch 1: the longest length <= `length` that rewind can go back to
    cache.rewind(length)             # batch 1: forget everything after the first `length` tokens

The cache never goes through numpy between steps and, with CUDA, stays on the device. `plain_feed`
builds the feed of an unbound run (a prompt with an empty cache, or a step with a growing one), for
code that runs the session itself: calibration and evaluation. `check_generation_memory` refuses, before
anything is allocated, a generation whose cache and logits would not fit in the memory available.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

import numpy as np
import onnxruntime as ort

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
    if arch.layer_types is None and arch.kv_source is None and arch.layer_head_dim is None:
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
    """Raise MemoryError (a clear one, before allocating) when a batch's KV cache plus its prompt
    logits (batch, longest prompt, vocab) would not fit in the memory available."""
    batch, width = len(prompt_lengths), max(prompt_lengths)
    capacity = width + new_tokens
    itemsize = 4 if kv_dtype is None else kv_dtype().itemsize
    needed = kv_cache_bytes(spec, batch=batch, capacity=capacity, itemsize=itemsize)
    needed += batch * width * spec.arch.vocab_size * 4
    limit = min(available_memory_bytes(), MAX_GENERATION_BYTES)
    if needed > limit:
        raise MemoryError(
            f"this generation needs {needed / 2**30:.1f} GiB for its KV cache and logits (batch {batch}, "
            f"{capacity} positions, {spec.arch.n_layer} layers x {spec.arch.n_kv_head} KV heads x "
            f"{spec.arch.head_dim}), more than the {limit / 2**30:.1f} GiB available; lower max_new_tokens or "
            "the batch size"
        )


STATE_KINDS = ("conv", "recurrent")  # cache tensors that hold a state, not keys or values


def make_cache(model: Runner, prompts: list[list[int]], *, capacity: int) -> Cache:
    """The driver the package's graph wants (its manifest's io.kv_cache; a hybrid model's layer states)."""
    if model.spec.arch.has_state:
        if model.spec.io.kv_cache == "shared_buffer":
            return SharedStateCache(model, prompts, capacity=capacity)
        return StateCache(model, prompts)
    if model.spec.io.kv_cache == "shared_buffer":
        return SharedCache(model, prompts, capacity=capacity)
    return ConcatCache(model, prompts)


class ConcatCache:
    """The standard graph's cache: past keys/values go in, past + new come out as new OrtValues, bound
    as the next step's past. Left padding, so every row's newest token is the last position."""

    def __init__(self, model: Runner, prompts: list[list[int]]):
        spec = self.spec = model.spec
        self.model = model
        batch, width = len(prompts), max(len(p) for p in prompts)
        self.input_ids = np.full((batch, width), spec.tokens.pad_token_id, dtype=np.int64)
        self.attention_mask = np.zeros((batch, width), dtype=np.int64)
        for row, ids in enumerate(prompts):
            self.input_ids[row, width - len(ids) :] = ids
            self.attention_mask[row, width - len(ids) :] = 1
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.past = self._empty(batch)
        self.binding = model.session.io_binding()
        arch = spec.arch  # the cache tensors' names, built once rather than every step
        self.past_names = arch.past_names(spec.io)
        self.present_names = arch.present_names(spec.io)

    def _empty(self, batch: int) -> list[ort.OrtValue]:
        arch, device = self.spec.arch, self.model.device
        shapes = [arch.cache_shape(kind, batch, layer) for layer, kind in arch.cache_layers()]
        return [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.model.kv_dtype), device) for shape in shapes]

    def prompt(self) -> np.ndarray:
        self.lengths += self.attention_mask.sum(axis=1)
        return self._step(self.input_ids)

    def next(self, next_ids: np.ndarray) -> np.ndarray:
        self.attention_mask = np.concatenate([self.attention_mask, np.ones((len(next_ids), 1), np.int64)], axis=1)
        self.lengths += 1
        return self._step(next_ids)

    def extend(self, ids: list[int], *, all_logits: bool = False) -> np.ndarray:
        assert len(self.lengths) == 1, "extend is for a batch of one"
        self.attention_mask = np.ones((1, int(self.lengths[0]) + len(ids)), dtype=np.int64)
        self.lengths += len(ids)
        return self._step(np.array([ids], dtype=np.int64), last=not all_logits)[0]

    def rewind_point(self, length: int) -> int:
        return max(0, min(length, int(self.lengths[0])))  # every position is kept

    def rewind(self, length: int) -> None:
        assert len(self.lengths) == 1 and 0 <= length <= self.lengths[0], f"cannot rewind to {length}"
        if length == 0:
            self.past = self._empty(1)
        else:
            kept = [np.array(value.numpy()[:, :, :length]) for value in self.past]  # copies, never views
            self.past = [ort.OrtValue.ortvalue_from_numpy(array, self.model.device) for array in kept]
        self.lengths[0] = length
        self.attention_mask = np.ones((1, length), dtype=np.int64)

    def _step(self, input_ids: np.ndarray, *, last: bool = True) -> np.ndarray:
        io, binding, device = self.spec.io, self.binding, self.model.device
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(io.input_ids, input_ids)
        binding.bind_cpu_input(io.attention_mask, self.attention_mask)
        if self.model.uses_position_ids:
            # positions count real tokens only, so a left-padded row starts at 0 like an unpadded one
            positions = np.cumsum(self.attention_mask, axis=1)[:, -input_ids.shape[1] :] - 1
            binding.bind_cpu_input(io.position_ids, np.maximum(positions, 0).astype(np.int64))
        for name, value in zip(self.past_names, self.past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(io.logits, "cpu")
        for name in self.present_names:
            binding.bind_output(name, device)
        self.model.run(binding)
        outputs = binding.get_outputs()
        self.past = outputs[1:]
        return outputs[0].numpy()[:, -1, :] if last else outputs[0].numpy()  # (B, V) or (B, T, V)


class _Snapshots:
    """Rewinding a cache whose states fold every token in (a hybrid model's convolution and recurrent states),
    for batch 1: snapshots of the states at the lengths where a turn or a multi-token step began or ended (the
    prompt's end, before and after each `extend`; the latest MAX_SNAPSHOTS, and the empty state always), and the
    ids the cache holds. `rewind_point(length)` is the longest snapshot <= length: a Conversation rewinds there
    and feeds the rest itself, as speculative decoding does with its next round. `rewind(length)` to any other
    length restores the snapshot before it and feeds the ids between again (one more run).
    The attention layers' keys and values are cut as a KV cache's are. A driver supplies _read_states and
    _write_states; the rest of the protocol is the KV driver it is mixed into."""

    MAX_SNAPSHOTS = 16
    lengths: np.ndarray

    def _start_snapshots(self, prompts: list[list[int]]) -> None:
        self.ids: list[int] = []  # batch 1: the ids the cache holds
        self._prompt = list(prompts[0]) if len(prompts) == 1 else []
        self.snapshots: dict[int, list[np.ndarray]] = {0: self._read_states()}
        self._boundaries: set[int] = {0}  # snapshot lengths at turn boundaries (not a speculative step's)
        self._transient: int | None = None  # the last speculative step's snapshot

    def _read_states(self) -> list[np.ndarray]:
        """Copies of the states, never views (OrtValue.numpy() may share a buffer that goes with the OrtValue)."""
        raise NotImplementedError

    def _write_states(self, arrays: list[np.ndarray]) -> None:
        raise NotImplementedError

    def _snapshot(self) -> None:
        if len(self.lengths) != 1:
            return
        self.snapshots[int(self.lengths[0])] = self._read_states()
        while len(self.snapshots) > self.MAX_SNAPSHOTS + 1:  # the oldest beyond the empty state goes first
            del self.snapshots[min(k for k in self.snapshots if k)]

    def prompt(self) -> np.ndarray:
        logits = super().prompt()
        self.ids = list(self._prompt)
        self._snapshot()
        self._boundaries.add(int(self.lengths[0]))
        return logits

    def next(self, next_ids: np.ndarray) -> np.ndarray:
        if len(self.lengths) == 1:
            self.ids.append(int(next_ids[0, 0]))
        return super().next(next_ids)

    def extend(self, ids: list[int], *, all_logits: bool = False) -> np.ndarray:
        """A turn's tokens: snapshots before and after. A speculative step's guesses (all_logits): one snapshot
        before, kept only until the next such step, so a long generation does not push the turns' out."""
        if all_logits and self._transient in self.snapshots and self._transient not in self._boundaries:
            del self.snapshots[self._transient]
        self._snapshot()
        self._transient = int(self.lengths[0]) if all_logits else None
        if not all_logits:
            self._boundaries.add(int(self.lengths[0]))
        logits = super().extend(ids, all_logits=all_logits)
        self.ids += ids
        if not all_logits:
            self._snapshot()
            self._boundaries.add(int(self.lengths[0]))
        return logits

    def rewind_point(self, length: int) -> int:
        length = max(0, min(length, int(self.lengths[0])))
        return max(k for k in self.snapshots if k <= length)

    def rewind(self, length: int) -> None:
        assert len(self.lengths) == 1 and 0 <= length <= self.lengths[0], f"cannot rewind to {length}"
        if length == self.lengths[0]:
            return
        point = self.rewind_point(length)
        ids = self.ids[point:length]
        super().rewind(point)  # the keys and values; the states are put back here
        self._write_states(self.snapshots[point])
        self.ids = self.ids[:point]
        self.snapshots = {k: v for k, v in self.snapshots.items() if k <= point}
        self._boundaries = {k for k in self._boundaries if k <= point}
        if ids:  # fed again as a speculative step is: its snapshot transient, not a turn boundary
            self.extend(ids, all_logits=True)


class StateCache(_Snapshots, ConcatCache):
    """A hybrid model's cache in the standard graph (left padding): KV for attention layers, and for the others
    a convolution or recurrent state (rewound through _Snapshots). A left-padded row's state is exact: the
    graph zeroes a padded position's input, which leaves an empty state empty."""

    def __init__(self, model: Runner, prompts: list[list[int]]):
        super().__init__(model, prompts)
        kinds = self.spec.arch.cache_kinds()
        self.states = [i for i, kind in enumerate(kinds) if kind in STATE_KINDS]  # indices into past
        self._start_snapshots(prompts)

    def _read_states(self) -> list[np.ndarray]:
        return [np.array(self.past[i].numpy()) for i in self.states]

    def _write_states(self, arrays: list[np.ndarray]) -> None:
        for i, array in zip(self.states, arrays, strict=True):
            self.past[i] = ort.OrtValue.ortvalue_from_numpy(np.array(array), self.model.device)


class SharedCache:
    """The fused graph's cache: one (B, n_kv_head, capacity, head_dim) buffer per cache tensor, bound
    as both past and present; the graph writes each row's new keys/values at that row's length, in
    place, so a step copies no cache. Right padding: row b's tokens are positions 0 .. length_b - 1,
    and attention_mask row b is length_b ones (then zeros: in decode steps the mask is as wide as the
    buffer). Decode steps bind nothing: their token, position, mask and logits arrays are bound once
    and rewritten in place."""

    def __init__(self, model: Runner, prompts: list[list[int]], *, capacity: int):
        spec = self.spec = model.spec
        self.model = model
        batch, width = len(prompts), max(len(p) for p in prompts)
        self.lengths = np.array([len(p) for p in prompts], dtype=np.int64)  # tokens in the cache after a step
        self.rows = np.arange(batch)
        self.input_ids = np.full((batch, width), spec.tokens.pad_token_id, dtype=np.int64)
        for row, ids in enumerate(prompts):
            self.input_ids[row, : len(ids)] = ids
        self.keep = {}
        if spec.io.logits_to_keep:  # an overridable initializer: bound as an OrtValue
            self.keep = {k: ort.OrtValue.ortvalue_from_numpy(np.array(k, dtype=np.int64)) for k in (0, 1)}
        self.step_ids = np.zeros((batch, 1), dtype=np.int64)
        self.step_positions = np.zeros((batch, 1), dtype=np.int64)
        self.logits = np.empty((batch, 1, spec.arch.vocab_size), dtype=model.logits_dtype)
        self.state_pairs: list[list[ort.OrtValue]] = []  # a hybrid's states: [past, present], swapped after a run
        self._allocate(batch, capacity)

    def _allocate(self, batch: int, capacity: int, old: list[ort.OrtValue] | None = None) -> None:
        """Bind fresh buffers of `capacity` positions, copying the cached part of `old` into them."""
        arch, io, model = self.spec.arch, self.spec.io, self.model
        self.capacity = capacity
        binding = self.binding = model.session.io_binding()
        binding.bind_output(io.logits, "cpu")  # bound first: a prompt's logits are get_outputs()[0]
        past, present = arch.past_names(io), arch.present_names(io)
        self.buffers, self.state_names, pairs = [], [], []
        for past_name, present_name, (layer, kind) in zip(past, present, arch.cache_layers(), strict=True):
            if kind in STATE_KINDS:  # fixed size: kept as they are when the buffers grow
                state_shape = arch.cache_shape(kind, batch)
                new = [ort.OrtValue.ortvalue_from_numpy(np.zeros(state_shape, model.kv_dtype), model.device)]
                new.append(ort.OrtValue.ortvalue_from_numpy(np.zeros(state_shape, model.kv_dtype), model.device))
                pairs.append(self.state_pairs[len(pairs)] if old is not None else new)
                self.state_names.append((past_name, present_name))
                continue
            array = np.zeros(arch.cache_shape(kind, batch, layer, capacity), model.kv_dtype)
            if old is not None:
                kept = old[len(self.buffers)].numpy()[:, :, : min(capacity, old[len(self.buffers)].shape()[2])]
                array[:, :, : kept.shape[2]] = kept
            self.buffers.append(ort.OrtValue.ortvalue_from_numpy(array, model.device))
            binding.bind_ortvalue_input(past_name, self.buffers[-1])
            binding.bind_ortvalue_output(present_name, self.buffers[-1])
        self.state_pairs = pairs
        self._bind_states()
        self.mask = (np.arange(capacity)[None, :] < self.lengths[:, None]).astype(np.int64)  # (B, capacity)
        self._decode_bound = False

    def _bind_states(self) -> None:
        for (past_name, present_name), (past, present) in zip(self.state_names, self.state_pairs, strict=True):
            self.binding.bind_ortvalue_input(past_name, past)
            self.binding.bind_ortvalue_output(present_name, present)

    def _run(self) -> None:
        """Run the bound step; a state's present becomes the next step's past."""
        self.model.run(self.binding)
        if self.state_pairs:
            self.state_pairs = [[present, past] for past, present in self.state_pairs]
            self._bind_states()

    def prompt(self) -> np.ndarray:
        batch, width = self.input_ids.shape
        uniform = bool(np.all(self.lengths == width))  # then only the last position needs logits
        logits = self._run_tokens(self.input_ids, np.ascontiguousarray(self.mask[:, :width]), 0, keep_last=uniform)
        if uniform:
            return logits[:, -1, :]
        return logits[np.arange(batch), self.lengths - 1]  # each row's last real position

    def extend(self, ids: list[int], *, all_logits: bool = False) -> np.ndarray:
        assert len(self.lengths) == 1, "extend is for a batch of one"
        start = int(self.lengths[0])
        if start + len(ids) > self.capacity:
            self._allocate(1, max(start + len(ids), self._grown()), old=self.buffers)
        self.lengths[0] = start + len(ids)
        self.mask[0, : start + len(ids)] = 1
        mask = np.ones((1, start + len(ids)), dtype=np.int64)
        logits = self._run_tokens(np.array([ids], dtype=np.int64), mask, start, keep_last=not all_logits)[0]
        return logits if all_logits else logits[-1]

    def _grown(self) -> int:
        # no wider than the context: a decode step's mask is as wide as the buffer, and the graph's rotary
        # tables have context_length rows
        return min(2 * self.capacity, self.spec.arch.context_length)

    def rewind_point(self, length: int) -> int:
        return max(0, min(length, int(self.lengths[0])))  # every position is kept

    def rewind(self, length: int) -> None:
        assert len(self.lengths) == 1 and 0 <= length <= self.lengths[0], f"cannot rewind to {length}"
        self.lengths[0] = length  # positions past it are overwritten by the next tokens
        self.mask[0, length:] = 0

    def _run_tokens(self, input_ids: np.ndarray, mask: np.ndarray, start: int, *, keep_last: bool) -> np.ndarray:
        """A multi-token run (a prompt, or more tokens after `start` cached ones): bound per call."""
        binding, io = self.binding, self.spec.io
        binding.bind_cpu_input(io.input_ids, input_ids)
        binding.bind_cpu_input(io.attention_mask, mask)
        if self.model.uses_position_ids:
            positions = (start + np.arange(input_ids.shape[1]))[None, :] * mask[:, start:]
            binding.bind_cpu_input(io.position_ids, positions.astype(np.int64))
        if self.keep:
            binding.bind_ortvalue_input(io.logits_to_keep, self.keep[1 if keep_last else 0])
        binding.bind_output(io.logits, "cpu")
        self._run()
        self._decode_bound = False  # the next decode step binds its own arrays again
        return binding.get_outputs()[0].numpy()  # (B, T or 1, V)

    def next(self, next_ids: np.ndarray) -> np.ndarray:
        if np.any(self.lengths >= self.capacity):
            assert len(self.lengths) == 1, "a batch's buffers are sized for its whole generation"
            self._allocate(1, self._grown(), old=self.buffers)
        binding, io = self.binding, self.spec.io  # after _allocate: growing binds new buffers to a new binding
        if not self._decode_bound:
            # the mask keeps the buffer's width: every decode step then has the same input shapes,
            # so ONNX Runtime reuses its memory plan instead of making one per step
            binding.bind_ortvalue_input(io.attention_mask, ort.OrtValue.ortvalue_from_numpy(self.mask))
            binding.bind_ortvalue_input(io.input_ids, ort.OrtValue.ortvalue_from_numpy(self.step_ids))
            if self.model.uses_position_ids:
                binding.bind_ortvalue_input(io.position_ids, ort.OrtValue.ortvalue_from_numpy(self.step_positions))
            if self.keep:
                binding.bind_ortvalue_input(io.logits_to_keep, self.keep[1])
            binding.bind_ortvalue_output(io.logits, ort.OrtValue.ortvalue_from_numpy(self.logits))
            self._decode_bound = True
        self.step_ids[:] = next_ids
        self.step_positions[:, 0] = self.lengths  # the new token's position is the row's current length
        self.mask[self.rows, self.lengths] = 1
        self.lengths += 1
        self._run()
        return self.logits[:, -1, :]


class SharedStateCache(_Snapshots, SharedCache):
    """A hybrid model's cache in the fused graph: the attention layers' shared KV buffers, each state as two
    buffers bound as past and present in turn (a state is replaced, not appended), rewound through _Snapshots.
    Right padding would fold a shorter row's padding into its state, so a batch of unequal prompts is prefilled
    row by row, each its own run, and then decoded together: a decode step feeds every row one real token."""

    def __init__(self, model: Runner, prompts: list[list[int]], *, capacity: int):
        super().__init__(model, prompts, capacity=capacity)
        self.prompts = prompts
        self._start_snapshots(prompts)

    def _read_states(self) -> list[np.ndarray]:
        return [np.array(past.numpy()) for past, _ in self.state_pairs]

    def _write_states(self, arrays: list[np.ndarray]) -> None:
        for (past, _), array in zip(self.state_pairs, arrays, strict=True):
            past.update_inplace(np.ascontiguousarray(array))

    def prompt(self) -> np.ndarray:
        if len(set(self.lengths.tolist())) == 1:
            return super().prompt()
        rows = [SharedStateCache(self.model, [ids], capacity=self.capacity) for ids in self.prompts]
        logits = np.concatenate([row.prompt() for row in rows])
        for i, buffer in enumerate(self.buffers):
            buffer.update_inplace(np.concatenate([row.buffers[i].numpy() for row in rows]))
        states = zip(*(row._read_states() for row in rows), strict=True)  # per state, every row's
        self._write_states([np.concatenate(arrays) for arrays in states])
        return logits
