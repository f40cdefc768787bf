"""Accuracy of a package on text: perplexity, bits per byte, and agreement with a reference package.

Runs through the runtime (edgelm.runtime), so what is measured is what users run. The text is cut
into windows of the context length that overlap by half (a sliding window): each token is scored
once, by the window that gives it the most context, as Hugging Face's perplexity guide does.

- perplexity = exp(mean negative log-likelihood per token)
- bits per byte = total negative log-likelihood in bits / UTF-8 bytes of the text (independent of
  the tokenizer, so models with different vocabularies compare)
- against a reference: top-1 agreement (the share of positions where both pick the same most likely
  next token) and the mean KL divergence KL(reference || package) over positions, in nats.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..runtime import InvalidInputError, Model, load
from ..runtime.files import read_text


def _progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="window", leave=False, disable=None)


def windows(n_tokens: int, context: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) triples: window [start, end) scores targets ids[first_scored+1 .. end]."""
    stride = max(1, context // 2)
    out, scored_until = [], 0  # every target index < scored_until has been scored
    start = 0
    while True:
        end = min(start + context, n_tokens - 1)
        out.append((start, end, max(scored_until, start)))
        scored_until = end
        if end >= n_tokens - 1:
            return out
        start += stride


def window_logits(model: Model, ids: np.ndarray) -> np.ndarray:
    """Log-probabilities (T, V) for every position of one window, with an empty cache."""
    logits = model.forward(ids[None, :])[0][0].astype(np.float64)
    if logits.shape[0] != len(ids):
        raise InvalidInputError("this package emits last-token logits only; evaluate its full-logits export instead")
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def _token_ids(model: Model, text_path: Path, max_tokens: int | None) -> tuple[np.ndarray, int]:
    """The text's token ids (cut to max_tokens + 1) and the UTF-8 bytes they cover."""
    text = read_text(text_path, "text file")
    ids = np.array(model.tokenizer.encode(text, add_special_tokens=True), dtype=np.int64)  # BOS as transformers
    n_bytes = len(text.encode("utf-8"))
    if max_tokens is not None:
        ids = ids[: max_tokens + 1]
        n_bytes = len(model.tokenizer.decode(ids.tolist()).encode("utf-8"))
    if len(ids) < 2:
        raise InvalidInputError(f"{text_path} is too short to evaluate (needs at least 2 tokens)")
    return ids, n_bytes


def _score(model: Model, ref: Model | None, ids: np.ndarray) -> dict:
    """Sums over every scored position: the package's (and the reference's) negative log-likelihood, the
    positions where both pick the same next token, and KL(reference || package)."""
    sums = {"nll": 0.0, "ref_nll": 0.0, "agree": 0, "kl": 0.0, "count": 0}
    plan = windows(len(ids), model.context_length)
    for start, end, first in _progress(plan, len(plan), f"eval {Path(str(model.spec.folder)).name}"):
        logprobs = window_logits(model, ids[start:end])
        rows = slice(first - start, end - start)  # positions whose next token is newly scored
        targets = ids[first + 1 : end + 1]
        scored = logprobs[rows]
        sums["nll"] -= scored[np.arange(len(targets)), targets].sum()
        sums["count"] += len(targets)
        if ref is not None:
            ref_logprobs = window_logits(ref, ids[start:end])[rows]
            sums["ref_nll"] -= ref_logprobs[np.arange(len(targets)), targets].sum()
            sums["agree"] += int((scored.argmax(-1) == ref_logprobs.argmax(-1)).sum())
            sums["kl"] += float((np.exp(ref_logprobs) * (ref_logprobs - scored)).sum())
    return sums


def _against_reference(report: dict, ref: Model, sums: dict) -> None:
    count = sums["count"]
    report["reference"] = str(ref.spec.folder)
    report["top1_agreement"] = sums["agree"] / count
    report["mean_kl_nats"] = sums["kl"] / count
    report["reference_perplexity"] = math.exp(sums["ref_nll"] / count)
    report["perplexity_ratio"] = report["perplexity"] / report["reference_perplexity"]
    report["reference_size_bytes"] = ref.info()["size_bytes"]
    report["size_ratio"] = report["size_bytes"] / report["reference_size_bytes"]


def evaluate_package(
    package: str | Path | Model,
    text_path: str | Path,
    *,
    reference: str | Path | Model | None = None,
    max_tokens: int | None = None,
    provider: str = "cpu",
    threads: int | None = None,
    verify: bool = True,
) -> dict:
    model = package if isinstance(package, Model) else load(package, provider=provider, threads=threads, verify=verify)
    ref = reference
    if reference is not None and not isinstance(reference, Model):
        ref = load(reference, provider=provider, threads=threads, verify=verify)
    if model.tokenizer is None:
        raise InvalidInputError("evaluation needs a package with a tokenizer.json")
    text_path = Path(text_path)
    ids, n_bytes = _token_ids(model, text_path, max_tokens)
    if ref is not None and ref.vocab_size != model.vocab_size:
        raise InvalidInputError("the reference package has a different vocabulary")

    sums = _score(model, ref, ids)
    nll, count = sums["nll"], sums["count"]
    report = {
        "package": str(model.spec.folder),
        "precision": model.spec.precision,
        "text": text_path.name,
        "tokens": count,
        "bytes": n_bytes,
        "perplexity": math.exp(nll / count),
        "bits_per_byte": nll / math.log(2) / n_bytes,
        "size_bytes": model.info()["size_bytes"],
    }
    if ref is not None:
        _against_reference(report, ref, sums)
    return report


def format_report(report: dict) -> str:
    lines = [
        f"{report['package']} ({report['precision']}) on {report['text']}: {report['tokens']:,} tokens, "
        f"{report['bytes']:,} bytes",
        f"  perplexity {report['perplexity']:.3f} | {report['bits_per_byte']:.4f} bits/byte | "
        f"size {report['size_bytes'] / 1e6:.2f} MB",
    ]
    if "reference" in report:
        lines.append(
            f"  vs {report['reference']}: perplexity x{report['perplexity_ratio']:.4f} | top-1 agreement "
            f"{100 * report['top1_agreement']:.2f}% | mean KL {report['mean_kl_nats']:.5f} nats | size "
            f"x{report['size_ratio']:.3f}"
        )
    return "\n".join(lines)
