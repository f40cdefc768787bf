"""`edgelm bench`: time to first token, decode tokens/s, load time, peak memory, runtime overhead.

Everything is measured in one process, several repetitions, median reported. The runtime's own
overhead per decode step is the step's wall time minus the time spent inside ONNX Runtime's
run_with_iobinding: tokenization, sampling, binding and the Python loop.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

import numpy as np

from .errors import ContextLengthError
from .model import Model, load


class TimedSession:
    """Wraps an InferenceSession; adds up the seconds spent inside run_with_iobinding."""

    def __init__(self, session):
        self._session = session
        self.run_seconds: list[float] = []

    def run_with_iobinding(self, binding, *args, **kwargs):
        started = time.perf_counter()
        self._session.run_with_iobinding(binding, *args, **kwargs)
        self.run_seconds.append(time.perf_counter() - started)

    def __getattr__(self, name):
        return getattr(self._session, name)


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def bench(
    package: str,
    *,
    prompt_tokens: int = 32,
    new_tokens: int = 128,
    batch: int = 1,
    provider: str = "auto",
    threads: int | None = None,
    repeats: int = 3,
    model: Model | None = None,
    speculative: Any = None,
) -> dict:
    """speculative: as generate's ("lookup", a draft package; random prompts give lookup little to find)."""
    model = model or load(package, provider=provider, threads=threads)
    check_fits(model, prompt_tokens, new_tokens)
    speculative = model.options(new_tokens, speculative=speculative).speculative  # a bad value fails here
    prompts = random_prompts(model, prompt_tokens=prompt_tokens, batch=batch)
    runs = timed_runs(model, prompts, new_tokens=new_tokens, repeats=repeats, speculative=speculative)
    median = lambda key: statistics.median(r[key] for r in runs)
    return {
        "package": package,
        "precision": model.spec.precision,
        "provider": model.session.get_providers()[0],
        "kernels": model.info()["kernels"],  # packed GGUF blocks: the native kernels or the fallback graph; else None
        "threads": threads,
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "new_tokens": runs[0]["new_tokens"],
        "repeats": repeats,
        "load_s": model.load_s,
        "time_to_first_token_s": median("ttft_s"),
        "decode_tokens_per_s": median("decode_tokens_per_s"),
        "runtime_overhead_pct": 100.0 * (1.0 - median("ort_share")),
        "peak_rss_mb": peak_rss_mb(),
        "size_mb": model.info()["size_bytes"] / 1e6,
        "speculative": speculative
        if speculative is None or isinstance(speculative, str)
        else str(speculative.spec.folder),
        "proposed_tokens": runs[-1]["proposed_tokens"],
        "accepted_tokens": runs[-1]["accepted_tokens"],
    }


def check_fits(model: Model, prompt_tokens: int, new_tokens: int) -> None:
    """ContextLengthError when the run would not fit: an error, never a silent clamp (the numbers would lie)."""
    if prompt_tokens + new_tokens > model.context_length:
        fits = model.context_length - prompt_tokens
        raise ContextLengthError(
            f"{prompt_tokens} prompt tokens + {new_tokens} new tokens is over the model's context length "
            f"({model.context_length} tokens); "
            + (f"use at most {fits} new tokens" if fits > 0 else "use fewer prompt tokens")
        )


def random_prompts(model: Model, *, prompt_tokens: int, batch: int) -> list[list[int]]:
    """Seeded random token ids, none of them an EOS id."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.vocab_size, prompt_tokens).tolist() for _ in range(batch)]
    eos = set(model.spec.tokens.eos_token_ids)
    return [[t if t not in eos else (t + 1) % model.vocab_size for t in p] for p in prompts]


def timed_runs(
    model: Model, prompts: list[list[int]], *, new_tokens: int, repeats: int, speculative: Any = None
) -> list[dict]:
    """A warm-up, then `repeats` generations to the full length, each timed inside and outside ONNX Runtime."""
    batch = len(prompts)
    timed = TimedSession(model.session)
    model.session = timed
    try:
        model.generate_batch(prompts, 4)  # warm-up: first-run allocations and kernel selection
        runs = []
        for _ in range(repeats):
            timed.run_seconds.clear()
            step_started = time.perf_counter()
            results = model.generate_batch(prompts, new_tokens, ignore_eos=True, speculative=speculative)
            total = time.perf_counter() - step_started
            decode_steps = timed.run_seconds[1:]
            timing = results[0].timings
            decode_wall = total - timing.time_to_first_token_s
            runs.append(
                {
                    "ttft_s": timing.time_to_first_token_s,
                    "decode_tokens_per_s": batch * timing.decode_tokens_per_s,
                    "ort_share": sum(decode_steps) / decode_wall if decode_wall > 0 else 1.0,
                    "new_tokens": timing.new_tokens,
                    "proposed_tokens": timing.proposed_tokens,
                    "accepted_tokens": timing.accepted_tokens,
                }
            )
    finally:
        model.session = timed._session
    return runs
