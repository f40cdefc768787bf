"""Build a Hugging Face `tokenizer.json` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF file carries its vocabulary as metadata, not as a tokenizer.json. Two kinds are rebuilt here:
- `gpt2`: byte-level BPE (tokens + merges). How text is split before the merges is named by `tokenizer.ggml.pre`;
  the splits below are the ones llama.cpp's llama-vocab.cpp uses for those names (and the models' own
  tokenizer.json files say the same). An unknown name is refused: a wrong split gives wrong ids silently.
- `llama`: SentencePiece BPE (tokens + scores, byte fallback), as TinyLlama / Llama 2 / Mistral ship it. Merges
  are recovered from the scores: a token is the merge of any two tokens that spell it, ranked by its score.
  Gemma files (general.architecture gemma*) differ twice, as transformers' GGUF reader also handles them: their
  runs of spaces are stored as spaces, not "▁", and their merge order is the tokens' order in the file, not
  their scores. Gemma writes add_space_prefix false: no "▁" is prepended.
Token types (llama.cpp's llama_token_type): 3 control -> special added token, 4 user-defined -> added token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4
# Longest ordinary SentencePiece piece whose merges are rebuilt. Trying each cut of a piece costs its length, so
# a piece of n characters costs n**2 (a 1 MB one, minutes), and a vocabulary of n pieces "a" * k makes n**3 / 6
# characters of merges. Bounded, both are linear in the vocabulary's size. Control and user-defined tokens have
# no merges and any length.
MAX_MERGED_LENGTH = 256
# Llama 3's split: case-insensitive contractions, a letter run with one leading non-letter, up to 3 digits, ...
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: the same, with single digits.
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _regex_split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:  # StarCoder / SmolLM: every digit alone, then GPT-2's split
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


# tokenizer.ggml.pre -> (pre-tokenizer factory, normalizer factory or None)
PRE_TOKENIZERS = {
    "default": (_gpt2_split, None),
    "gpt-2": (_gpt2_split, None),
    "gpt2": (_gpt2_split, None),
    "smollm": (_digits_then_gpt2, None),
    "starcoder": (_digits_then_gpt2, None),
    "llama-bpe": (lambda: _regex_split(LLAMA3_SPLIT), None),
    "llama3": (lambda: _regex_split(LLAMA3_SPLIT), None),
    "llama-v3": (lambda: _regex_split(LLAMA3_SPLIT), None),
    "qwen2": (lambda: _regex_split(QWEN2_SPLIT), lambda: normalizers.NFC()),  # Qwen2's tokenizer.json normalizes NFC
}


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unknown BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre); known: {sorted(PRE_TOKENIZERS)}")
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError("a gpt2-style tokenizer needs tokenizer.ggml.merges")
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    make_pre, make_normalizer = PRE_TOKENIZERS[pre]
    tokenizer.pre_tokenizer = make_pre()
    if make_normalizer is not None:
        tokenizer.normalizer = make_normalizer()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("a llama-style (SentencePiece) tokenizer needs one tokenizer.ggml.scores entry per token")
    if str(meta.get("general.architecture", "")).startswith("gemma"):
        tokens = ["▁" * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
        scores = [-float(index) for index in range(len(tokens))]  # earlier in the file merges first
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)  # checked: one per token
    for index, score in enumerate(scores):  # the merge ranks: a NaN compares false with every other score
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ValueError(f"tokenizer.ggml.scores[{index}] is {score!r:.60}, not a finite number")
    vocab = {token: index for index, token in enumerate(tokens)}
    # Only ordinary tokens (type 1) are merge results; pieces may be any token in the vocabulary.
    ranked = []
    for index, (token, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        if kind != 1 or len(token) < 2:
            continue
        if len(token) > MAX_MERGED_LENGTH:  # every cut slices the token: quadratic in its length
            raise ValueError(
                f"token {index} is an ordinary SentencePiece piece of {len(token)} characters; merges are rebuilt for "
                f"pieces of up to {MAX_MERGED_LENGTH} (trained vocabularies' are 16 to 31)"
            )
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True)
    )
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if space_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tokenizer


def _post_processor(meta: Mapping[str, Any], tokens: list[str], byte_level: bool) -> processors.PostProcessor | None:
    """BOS/EOS added around every encoding when the file says so (add_bos_token, add_eos_token)."""
    default_bos = not byte_level  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    before, after, specials = [], [], {}
    for flag, key, default, side in (
        ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id", default_bos, before),
        ("tokenizer.ggml.add_eos_token", "tokenizer.ggml.eos_token_id", False, after),
    ):
        token_id = meta.get(key)
        if meta.get(flag, default) and token_id is not None:
            side.append(tokens[token_id])
            specials[tokens[token_id]] = token_id
    steps = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if specials:
        single = " ".join([*before, "$A", *after])
        pair = " ".join([*before, "$A", *after, *(f"{t}:1" for t in before), "$B:1", *(f"{t}:1" for t in after)])
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(specials.items())))
    return processors.Sequence(steps) if len(steps) > 1 else (steps[0] if steps else None)


def build_tokenizer_json(meta: Mapping[str, Any]) -> str:
    """tokenizer.json text for the tokenizer described by `meta` (GGUF key -> value); ValueError when unsupported."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("no tokenizer.ggml.tokens in the metadata")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id"):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key} should be one integer token id, not {value!r:.60}")
        if value is not None and not 0 <= value < len(tokens):
            raise ValueError(f"{key} {value} is outside the vocabulary of {len(tokens)} tokens")
    if kind == "gpt2":
        tokenizer = _byte_level(meta, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece(meta, tokens)
    else:
        raise ValueError(f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; 'gpt2' and 'llama' are")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{len(types)} token types for {len(tokens)} tokens")
    control = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED
    ]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)
    post = _post_processor(meta, tokens, byte_level=kind == "gpt2")
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer.to_str()
