"""Calibration data for static quantization, shaped the way a decoder LM is really run.

A decoder sees two kinds of input: the prompt pass (many tokens, empty cache) and decode steps
(one token, a cache of past keys/values). Activation ranges differ between them, so calibrating on
prompt passes alone (what a generic reader does) mis-sizes the decode path. For every sample window
of the calibration text this reader runs the fp32 package itself: one prompt pass over the window's
first part, then a few decode steps, each fed the past keys/values the fp32 model produced.
"""

from __future__ import annotations

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from ..runtime import Model


class DecoderCalibrationReader(CalibrationDataReader):
    def __init__(self, model: Model, ids: np.ndarray, *, samples: int = 32, decode_steps: int = 4, seed: int = 0):
        if samples < 1:
            raise ValueError(f"calibration samples must be >= 1, got {samples}")
        self.samples = samples
        spec = model.spec
        window = min(model.context_length, 128)
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, max(1, len(ids) - window), size=samples)
        self._feeds: list[dict] = []
        progress = _progress(range(samples), "calibration (fp32 runs)")
        for i in progress:
            tokens = ids[starts[i] : starts[i] + window]
            # vary the prompt length so ranges cover short and long prompts and caches
            prompt_length = int(rng.integers(max(1, len(tokens) // 4), len(tokens) - decode_steps + 1))
            feed = self._feed(model, tokens[:prompt_length][None, :], 0, None)
            self._feeds.append(feed)
            past = self._run(model, feed)
            for step in range(decode_steps):
                position = prompt_length + step
                feed = self._feed(model, tokens[position : position + 1][None, :], position, past)
                self._feeds.append(feed)
                past = self._run(model, feed)
        self._iter = None
        self._bar = None
        del spec

    @staticmethod
    def _feed(model: Model, input_ids: np.ndarray, past_length: int, past: list | None) -> dict:
        spec = model.spec
        length = input_ids.shape[1]
        feed = {
            spec.input_ids: input_ids.astype(np.int64),
            spec.attention_mask: np.ones((1, past_length + length), dtype=np.int64),
        }
        if model._use_position_ids:
            feed[spec.position_ids] = np.arange(past_length, past_length + length, dtype=np.int64)[None, :]
        empty = np.zeros((1, spec.n_head, 0, spec.head_dim), dtype=np.float32)
        for i, (key_name, value_name) in enumerate(model._past_names):
            feed[key_name] = empty if past is None else past[2 * i]
            feed[value_name] = empty if past is None else past[2 * i + 1]
        return feed

    @staticmethod
    def _run(model: Model, feed: dict) -> list:
        names = [n for pair in model._present_names for n in pair]
        return model.session.run(names, feed)

    def __len__(self) -> int:
        return len(self._feeds)

    def get_next(self) -> dict | None:
        if self._iter is None:
            self._iter = iter(self._feeds)
            self._bar = _progress(None, "calibration (ranges)", total=len(self._feeds))
        feed = next(self._iter, None)
        if self._bar is not None:
            if feed is None:
                self._bar.close()
            else:
                self._bar.update(1)
        return feed

    def rewind(self) -> None:
        self._iter = None


def _progress(iterable, desc: str, total: int | None = None):
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return iterable if iterable is not None else None
    return tqdm(
        iterable, desc=desc, total=total, unit="feed" if iterable is None else "sample", leave=False, disable=None
    )
