"""The two KV cache drivers, one per kind of graph, each implementing runtime/kvcache.py's Cache protocol (make_cache
there picks one): ConcatCache for the standard graph (past keys and values in, past + new out as new OrtValues,
left padding) and SharedCache for the fused graph (one buffer per cache tensor bound as both past and present and
written in place, right padding). What the manifest says of keys and values is runtime/kv_layout.py's. The cache
never goes through numpy between steps and, with CUDA, stays on the device. runtime/statecache.py adds a hybrid
model's convolution and recurrent states to each.

A prompt or a turn longer than PREFILL_CHUNK tokens is fed in runs of that many (chunked prefill, llama.cpp's
n_ubatch): a run's logits are (batch, tokens, vocab) and its attention scores tokens x cache, so one run of a long
prompt would need gigabytes that a chunk does not. The fused graph feeds a batch's long prompts row by row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from .kv_layout import KV_KINDS

if TYPE_CHECKING:
    from .runner import Runner

PREFILL_CHUNK = 512  # the most tokens one run of a prompt or a turn feeds


def pieces(length: int) -> list[tuple[int, int]]:
    """(start, end) of each run that feeds `length` tokens, PREFILL_CHUNK at most each; one run for 0."""
    return [(start, min(start + PREFILL_CHUNK, length)) for start in range(0, max(length, 1), PREFILL_CHUNK)]


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
        mask = self.attention_mask  # left padding: every row ends at the last position, so each run may stop anywhere
        for start, end in pieces(self.input_ids.shape[1]):
            self.attention_mask = np.ascontiguousarray(mask[:, :end])
            logits = self._step(self.input_ids[:, start:end])
        return logits

    def next(self, next_ids: np.ndarray) -> np.ndarray:
        self.attention_mask = np.concatenate([self.attention_mask, np.ones((len(next_ids), 1), np.int64)], axis=1)
        self.lengths += 1
        return self._step(next_ids)

    def extend(self, ids: list[int], *, all_logits: bool = False) -> np.ndarray:
        assert len(self.lengths) == 1, "extend is for a batch of one"
        if all_logits:  # a speculative step: every position's logits, so one run
            return self._feed(ids, last=False)
        for start, end in pieces(len(ids)):
            logits = self._feed(ids[start:end], last=True)
        return logits

    def _feed(self, ids: list[int], *, last: bool) -> np.ndarray:
        self.attention_mask = np.ones((1, int(self.lengths[0]) + len(ids)), dtype=np.int64)
        self.lengths += len(ids)
        return self._step(np.array([ids], dtype=np.int64), last=last)[0]

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
            if kind not in KV_KINDS:  # a state, fixed size: kept as they are when the buffers grow
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
        if batch > 1 and (width > PREFILL_CHUNK or (self.state_pairs and np.any(self.lengths < width))):
            return self._prompt_rows()
        if not np.all(self.lengths == width):  # right padding: one run, and each row's last real position
            logits = self._run_tokens(self.input_ids, np.ascontiguousarray(self.mask[:, :width]), 0, keep_last=False)
            return logits[np.arange(batch), self.lengths - 1]
        for start, end in pieces(width):  # every row full: only the last position needs logits
            mask = np.ascontiguousarray(self.mask[:, :end])
            logits = self._run_tokens(self.input_ids[:, start:end], mask, start, keep_last=True)
        return logits[:, -1, :]

    def _prompt_rows(self) -> np.ndarray:
        """Each row's prompt fed alone (chunked), its keys, values and states then copied into the batch's buffers:
        ONNX Runtime's GroupQueryAttention takes several tokens after cached ones for batch 1 only, and right
        padding would fold a shorter row's padding into a hybrid's state."""
        kv = [np.array(buffer.numpy()) for buffer in self.buffers]
        states = [np.array(past.numpy()) for past, _ in self.state_pairs]
        logits = []
        for row, length in enumerate(self.lengths):
            one = type(self)(self.model, [self.input_ids[row, :length].tolist()], capacity=self.capacity)
            logits.append(one.prompt())
            for array, buffer in zip(kv, one.buffers, strict=True):
                array[row] = buffer.numpy()[0]
            for array, (past, _) in zip(states, one.state_pairs, strict=True):
                array[row] = past.numpy()[0]
        for buffer, array in zip(self.buffers, kv, strict=True):
            buffer.update_inplace(array)
        for (past, _), array in zip(self.state_pairs, states, strict=True):
            past.update_inplace(array)
        return np.concatenate(logits)

    def extend(self, ids: list[int], *, all_logits: bool = False) -> np.ndarray:
        assert len(self.lengths) == 1, "extend is for a batch of one"
        if all_logits:  # a speculative step: every position's logits, so one run
            return self._feed(ids, all_logits=True)
        for start, end in pieces(len(ids)):
            logits = self._feed(ids[start:end], all_logits=False)
        return logits

    def _feed(self, ids: list[int], *, all_logits: bool) -> np.ndarray:
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
