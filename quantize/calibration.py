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
from ..runtime.kvcache import plain_feed


class DecoderCalibrationReader(CalibrationDataReader):
    def __init__(self, model: Model, ids: np.ndarray, *, samples: int = 32, decode_steps: int = 4, seed: int = 0):
        if samples < 1:
            raise ValueError(f"calibration samples must be >= 1, got {samples}")
        self.samples = samples
        window = min(model.context_length, 128)
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, max(1, len(ids) - window), size=samples)
        self._feeds: list[dict] = []
        progress = _progress(range(samples), "calibration (fp32 runs)")
        for i in progress:
            tokens = ids[starts[i] : starts[i] + window]
            # vary the prompt length so ranges cover short and long prompts and caches
            prompt_length = int(rng.integers(max(1, len(tokens) // 4), len(tokens) - decode_steps + 1))
            feed = plain_feed(model, tokens[:prompt_length][None, :])
            self._feeds.append(feed)
            past = model.forward(tokens[:prompt_length][None, :])[1]
            for step in range(decode_steps):
                position = prompt_length + step
                step_ids = tokens[position : position + 1][None, :]
                self._feeds.append(plain_feed(model, step_ids, past))
                past = model.forward(step_ids, past)[1]
        self._iter = None
        self._bar = None

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
