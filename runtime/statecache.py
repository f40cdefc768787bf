"""A hybrid model's cache (LFM2, Qwen3.5): a KV driver (runtime/kvdrivers.py) for the attention layers, and for
the convolution and recurrent layers a fixed-size state that folds every token in (what the manifest says of them
is runtime/state_layout.py's). Such a state cannot be cut back to an earlier length, so _Snapshots keeps copies of
it at turn boundaries and before a speculative step, and rewinding restores one and feeds the ids after it again.
StateCache is the standard graph's, SharedStateCache the fused graph's; runtime/kvcache.py's make_cache picks them
for a package whose architecture has states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from .kvdrivers import ConcatCache, SharedCache
from .state_layout import STATE_KINDS

if TYPE_CHECKING:
    from .runner import Runner


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


class SharedStateCache(_Snapshots, SharedCache):
    """A hybrid model's cache in the fused graph: the attention layers' shared KV buffers, each state as two
    buffers bound as past and present in turn (a state is replaced, not appended), rewound through _Snapshots.
    Right padding would fold a shorter row's padding into its state, so a batch of unequal prompts is prefilled
    row by row (SharedCache._prompt_rows) and then decoded together: a decode step feeds every row one real token."""

    def __init__(self, model: Runner, prompts: list[list[int]], *, capacity: int):
        super().__init__(model, prompts, capacity=capacity)
        self._start_snapshots(prompts)

    def _read_states(self) -> list[np.ndarray]:
        return [np.array(past.numpy()) for past, _ in self.state_pairs]

    def _write_states(self, arrays: list[np.ndarray]) -> None:
        for (past, _), array in zip(self.state_pairs, arrays, strict=True):
            past.update_inplace(np.ascontiguousarray(array))
