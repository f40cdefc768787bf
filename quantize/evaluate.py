"""Accuracy of a package on text: perplexity, bits per byte, and agreement with a reference package.

Runs through the runtime (edgelm.runtime), so what is measured is what users run. The text is cut
into windows of the context length (at most EVAL_WINDOW tokens unless asked) that overlap by half (a
sliding window): each token is scored once, by the window that gives it the most context, as Hugging
Face's perplexity guide does.

Memory is bounded whatever the text's length: the text is read and tokenized a chunk at a time, one
window of ids is held, and each window is fed EVAL_CHUNK tokens at a time through the cache, its logits
scored and dropped; the bound is docs/results.md's ("Scale": window x KV size, EVAL_CHUNK x vocabulary).

- perplexity = exp(mean negative log-likelihood per token)
- bits per byte = total negative log-likelihood in bits / UTF-8 bytes of the text (independent of
  the tokenizer, so models with different vocabularies compare)
- against a reference: top-1 agreement (the share of positions where both pick the same most likely
  next token) and the mean KL divergence KL(reference || package) over positions, in nats.
"""

from __future__ import annotations

import codecs
import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..runtime import InvalidInputError, Model, load
from ..runtime.files import check_file, decode_utf8

EVAL_WINDOW = 2048  # default window cap: the KV cache and the attention's work grow with the window
EVAL_CHUNK = 256  # tokens a window is fed in at a time (with the cache of the ones before): logits (EVAL_CHUNK, V)
SCORE_ROWS = 64  # positions scored at a time, in float64
TEXT_CHUNK = 1 << 20  # characters of text read and tokenized at a time
TOKEN_MARGIN = 64  # tokens at the end of a tokenized chunk held back: more text may change them
CONTEXT_TOKENS = 16  # committed tokens re-tokenized before held-back text, so it is not tokenized as a start


def _progress(iterable, desc: str):
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return iterable
    return tqdm(iterable, desc=desc, unit="window", leave=False, disable=None)


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


def text_chunks(path: str | Path, chunk: int | None = None, *, what: str = "text file") -> Iterator[str]:
    """The UTF-8 text of the regular file at path, `chunk` bytes (default TEXT_CHUNK) at a time; ValueError, one
    line naming the file, where it is not UTF-8 text (the checks of runtime/files.read_text, made as it is read)."""
    check_file(path, what)
    chunk = chunk or TEXT_CHUNK
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            held = len(decoder.getstate()[0])  # bytes of a character the last chunk ended inside
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                if offset == 0:  # its one-line error, naming a byte-order mark (UTF-16 text)
                    decode_utf8(data, path, what)
                raise ValueError(
                    f"{what} {path} is not UTF-8 text: bytes at offset {offset - held + e.start} cannot be decoded "
                    "(Latin-1 or another encoding?); save it as UTF-8"
                ) from None
            if "\x00" in text:
                raise ValueError(f"{what} {path} is not UTF-8 text: it holds NUL bytes (UTF-16 or a binary file?)")
            if text:
                yield text
            if not data:
                return
            offset += len(data)


def token_stream(tokenizer, chunks: Iterator[str]) -> Iterator[int]:
    """The ids of the concatenated chunks, as tokenizer.encode(whole text) gives them, tokenized a chunk at a time.

    The last TOKEN_MARGIN tokens of each tokenized piece are held back with their text (more text may merge
    into them) and re-tokenized with the next chunk, behind some committed text that starts a word (at least
    CONTEXT_TOKENS tokens of it): so the held-back text is tokenized as inside the text, not as its start (a
    tokenizer may mark a text's first word). The ids from the token that starts where the held-back text starts
    are the whole text's wherever tokenization is local to a few words, as BPE's pre-tokenizers make it.
    """
    context, pending = "", ""  # committed text before the cut; text after it, not yet committed
    chunks = iter(chunks)
    piece = next(chunks, None)
    while piece is not None:
        following = next(chunks, None)
        text = context + pending + piece
        ids, offsets = tokenizer.encode_offsets(text)
        first = next((i for i, (begin, _) in enumerate(offsets) if begin >= len(context)), len(ids))
        if following is None:
            yield from ids[first:]
            return
        cut = _clean_cut(offsets, first, len(ids) - TOKEN_MARGIN)
        if cut is None:  # too few tokens yet to hold any back: read on
            pending, piece = pending + piece, following
            continue
        yield from ids[first:cut]
        context = text[_word_start(text, offsets, cut - CONTEXT_TOKENS) : offsets[cut][0]]
        pending, piece = text[offsets[cut][0] :], following


def _word_start(text: str, offsets: list[tuple[int, int]], last: int) -> int:
    """Where committed text to re-tokenize may start: the latest token start at or before token `last` (within a
    few hundred tokens) where whitespace follows a non-space; the text's start (itself such a place, or where the
    whole input starts) when `last` is before the first token; else token `last`'s start."""
    if last <= 0:
        return 0
    for i in range(last, max(0, last - 512) - 1, -1):
        start = offsets[i][0]
        if text[start].isspace() and (start == 0 or not text[start - 1].isspace()):
            return start
    return offsets[last][0]


def _clean_cut(offsets: list[tuple[int, int]], first: int, last: int) -> int | None:
    """The latest token index in (first, last] where a token starts after the previous one ends (a byte-level
    tokenizer splits a character over two tokens with the same span): text can be cut there."""
    for i in range(last, first, -1):
        if offsets[i][0] >= offsets[i - 1][1]:
            return i
    return None


def _windows(ids: Iterator[int], context: int, text_path: Path) -> Iterator[tuple[np.ndarray, int]]:
    """windows() over a stream of ids: each window's ids [start, end + 1) (the last one is only a target) and the
    index in it of the first newly scored position. Holds one window's ids."""
    stride = max(1, context // 2)
    buffer = np.fromiter(itertools.islice(ids, context + 1), dtype=np.int64)
    if len(buffer) < 2:
        raise InvalidInputError(f"{text_path} is too short to evaluate (needs at least 2 tokens)")
    first = 0
    while True:
        yield buffer, first
        if len(buffer) < context + 1:  # the text ended inside this window
            return
        more = np.fromiter(itertools.islice(ids, stride), dtype=np.int64)
        if not len(more):
            return
        buffer = np.concatenate([buffer[stride:], more])
        first = context - stride  # the positions scored by an earlier window


def _leading_special_ids(tokenizer) -> list[int]:
    """The ids tokenizer.json's post-processor puts before a text (BOS, for tokenizers that add it), as
    transformers' tokenizer.encode(text) and llama.cpp's perplexity tool start the text with them."""
    bare = tokenizer.encode("x")
    full = tokenizer.encode("x", add_special_tokens=True)
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start]
    return []


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def _pieces(model: Model, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, logits (T, V)) of one window's positions, fed EVAL_CHUNK tokens at a time after the cache of the
    ones before; a window of at most EVAL_CHUNK tokens is one run with an empty cache."""
    past = None
    for offset in range(0, len(ids), EVAL_CHUNK):
        piece = ids[offset : offset + EVAL_CHUNK]
        logits, past = model.forward(piece[None, :], past)
        if logits.shape[1] != len(piece):
            raise InvalidInputError(
                "this package emits last-token logits only; evaluate its full-logits export instead"
            )
        yield offset, logits[0]


def _score(model: Model, ref: Model | None, ids: Iterator[int], text_path: Path, *, window: int) -> dict:
    """Sums over every scored position: the package's (and the reference's) negative log-likelihood, the
    positions where both pick the same next token, and KL(reference || package). Each window's logits are
    made EVAL_CHUNK positions at a time and scored SCORE_ROWS at a time, then dropped."""
    sums = {"nll": 0.0, "ref_nll": 0.0, "agree": 0, "kl": 0.0, "count": 0}
    plan = _windows(ids, window, text_path)
    for window, first in _progress(plan, f"eval {Path(str(model.spec.folder)).name}"):
        inputs = window[:-1]  # the last id is only a target
        references = _pieces(ref, inputs) if ref is not None else None
        for offset, logits in _pieces(model, inputs):
            ref_logits = next(references)[1] if references is not None else None
            for row in range(max(first, offset), offset + len(logits), SCORE_ROWS):
                rows = slice(row - offset, min(row + SCORE_ROWS, offset + len(logits)) - offset)
                targets = window[row + 1 : row + 1 + rows.stop - rows.start]
                scored = _log_softmax(logits[rows])
                sums["nll"] -= scored[np.arange(len(targets)), targets].sum()
                sums["count"] += len(targets)
                if ref_logits is not None:
                    ref_logprobs = _log_softmax(ref_logits[rows])
                    sums["ref_nll"] -= ref_logprobs[np.arange(len(targets)), targets].sum()
                    sums["agree"] += int((scored.argmax(-1) == ref_logprobs.argmax(-1)).sum())
                    sums["kl"] += float((np.exp(ref_logprobs) * (ref_logprobs - scored)).sum())
    return sums


def _window(model: Model, ref: Model | None, window: int | None) -> int:
    context = min(model.context_length, ref.context_length if ref is not None else model.context_length)
    if window is None:
        return min(context, EVAL_WINDOW)
    if not 2 <= window <= context:
        raise InvalidInputError(f"window must be 2 to the context length {context}, got {window}")
    return window


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
    window: int | None = None,
) -> dict:
    """window: tokens a window scores with (default: the context length, at most EVAL_WINDOW)."""
    model = package if isinstance(package, Model) else load(package, provider=provider, threads=threads, verify=verify)
    ref = reference
    if reference is not None and not isinstance(reference, Model):
        ref = load(reference, provider=provider, threads=threads, verify=verify)
    if model.tokenizer is None:
        raise InvalidInputError("evaluation needs a package with a tokenizer.json")
    if ref is not None and ref.vocab_size != model.vocab_size:
        raise InvalidInputError("the reference package has a different vocabulary")
    text_path, read = Path(text_path), [0]  # UTF-8 bytes read

    def chunks():
        for text in text_chunks(text_path):
            read[0] += len(text.encode("utf-8"))
            yield text

    ids = itertools.chain(_leading_special_ids(model.tokenizer), token_stream(model.tokenizer, chunks()))
    kept = None
    if max_tokens is not None:  # the bytes these cover: the decoded ids', as the text's first part
        kept = list(itertools.islice(ids, max_tokens + 1))
        ids = iter(kept)
    window = _window(model, ref, window)
    sums = _score(model, ref, ids, text_path, window=window)
    n_bytes = read[0] if kept is None else len(model.tokenizer.decode(kept).encode("utf-8"))
    nll, count = sums["nll"], sums["count"]
    report = {
        "package": str(model.spec.folder),
        "precision": model.spec.precision,
        "text": text_path.name,
        "tokens": count,
        "bytes": n_bytes,
        "window": window,
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
