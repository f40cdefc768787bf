"""Build a Hugging Face `tokenizer.json` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF file carries its vocabulary as metadata, not as a tokenizer.json. Three kinds (`tokenizer.ggml.model`) are
rebuilt here, each to give the ids llama.cpp gives on the same file (llama-vocab.cpp):
- `gpt2`: byte-level BPE (tokens + merges). How text is cut into words before the merges is named by
  `tokenizer.ggml.pre`; PRE_TOKENIZERS maps each label llama.cpp knows to its Split (regexes, whether a word that is
  a token skips the merges, BOS by default); no NFC, as llama.cpp has none. An unknown label is refused: a wrong
  split gives wrong ids silently.
- `gemma4`: BPE on SentencePiece-spelled text ("▁" for the space, raw UTF-8, byte fallback) with the file's
  merges (the "gemma4" row).
- `llama`: SentencePiece BPE (tokens + scores, byte fallback), as TinyLlama / Llama 2 / Mistral / Gemma ship it.
  Merges are recovered from the scores as llama.cpp's SPM tokenizer applies them: any two pieces whose
  concatenation is a token merge, the highest-scored first. Gemma writes add_space_prefix false: no "▁" is
  prepended.
Token types (llama.cpp's llama_token_type): 3 control -> special added token, matched only where special tokens
are parsed; 4 user-defined -> added token matched in the raw text before anything else, as llama.cpp's
tokenizer_st_partition does whatever parse_special says (Gemma 3's runs of spaces, tabs and newlines, its HTML
tags). Every added token keeps its own id: the tokenizer has exactly the file's tokens. Where HF tokenizers cannot
do what llama.cpp does, docs/tokenization.md says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
# llama.cpp (llama_vocab::impl::load) makes every token spelled as one of these a control token whatever the file
# says: its end-of-generation list. A user-defined "</s>" (Gemma 3's, Phi-3's) is then text unless special tokens
# are parsed. (Its EOT / FIM look-ups, which mark only a slot the file leaves unset, are not mirrored.)
LLAMACPP_END_OF_GENERATION = frozenset(
    ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
     "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
     "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
)  # fmt: skip
# ... except "</s>" in a vocabulary with one of these end tokens (Gemma 4, PLaMo): there it is an ordinary token.
ORDINARY_END_OF_SENTENCE = ("<|tool_response>", "<|plamo:eos|>")
# Phi-3 (general.name containing "phi-3"/"phi3"): every special or user-defined token but these swallows the
# whitespace after it (llama.cpp's RSTRIP attribute, set by name).
PHI3_NO_RSTRIP = frozenset(("<unk>", "<s>", "<|endoftext|>"))
# Longest ordinary SentencePiece piece whose merges are rebuilt. Trying each cut of a piece costs its length, so
# a piece of n characters costs n**2 (a 1 MB one, minutes), and a vocabulary of n pieces "a" * k makes n**3 / 6
# characters of merges. Bounded, both are linear in the vocabulary's size. User-defined tokens have no merges, and
# a longer control token gets none (it is matched whole where special tokens are parsed).
MAX_MERGED_LENGTH = 256


@dataclass(frozen=True)
class Split:
    """How text is cut into words before BPE merges them, for one `tokenizer.ggml.pre` label (llama-vocab.cpp)."""

    regexes: tuple[str, ...]  # applied in turn to every piece so far, each match kept as a piece of its own
    ignore_merges: bool = False  # a word that is itself a token is that token, whatever the merges say
    add_bos: bool = False  # BOS added when the file has no tokenizer.ggml.add_bos_token (llama.cpp's default)
    byte_level: bool = True  # GPT-2's bytes-as-characters spelling; else "▁" for the space and byte fallback


GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's: case-insensitive contractions, a letter run with one leading non-letter, up to 3 digits, ...
LLAMA3_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_WORDS = LLAMA3_WORDS.replace(r"\p{N}{1,3}", r"\p{N}")  # single digits
# Qwen3.5's: combining marks (\p{M}) stay with their letters
QWEN35_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken: a capitalised word splits from the next ("CamelCase" -> "Camel", "Case"), single digits
TEKKEN_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (Llama 4's): tekken's words with the contractions attached, up to 3 digits
GPT4O_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Written with escapes: several of these characters have canonical equivalents that an editor may substitute.
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # DeepSeek's: CJK ideographs, Hangul, and U+0800..U+4E00 as upstream
KANA_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"  # DeepSeek V3's: CJK ideographs, hiragana, katakana
# DeepSeek LLM's letter runs: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, ... (CJK has its own split)
DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d"
    "\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
DEEPSEEK_LLM_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"  # ASCII and full-width
DEEPSEEK_V3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GPT2 = Split((GPT2_WORDS,))
LLAMA3 = Split((LLAMA3_WORDS,), ignore_merges=True, add_bos=True)
LLAMA3_MERGED = Split((LLAMA3_WORDS,))  # the same words, every one built by the merges
QWEN2 = Split((QWEN2_WORDS,))  # no NFC, as llama.cpp (docs/tokenization.md)
STARCODER = Split((r"\p{N}", GPT2_WORDS))  # every digit alone, then GPT-2's words
DEEPSEEK_V3 = Split((r"\p{N}{1,3}", KANA_CJK, DEEPSEEK_V3_WORDS))
GPT4O = Split((GPT4O_WORDS,))

# tokenizer.ggml.pre -> its Split, for the labels llama.cpp's converter writes (llama-vocab.cpp reads them). The
# regexes are the models' own tokenizer.json ones, which llama.cpp's are rewritten from. A file without the key
# is "default", as in llama.cpp. A new label is one row.
PRE_TOKENIZERS = {
    "default": Split((r"[\p{P}\$\+<=>\^~\|]+", GPT2_WORDS, r"\p{N}+", "[0-9][0-9][0-9]")),
    "gpt-2": GPT2,
    "phi-2": GPT2,
    "olmo": GPT2,
    "granite-docling": GPT2,
    "mpt": GPT2,  # GPT-NeoX's tokenizer
    "llama-bpe": LLAMA3,
    "llama3": LLAMA3,
    "llama-v3": LLAMA3,
    "falcon3": LLAMA3,
    "falcon-h1": LLAMA3,
    "lfm2": LLAMA3,
    "midm-2.0": LLAMA3,
    "pixtral": LLAMA3,
    "smaug-bpe": LLAMA3_MERGED,
    "dbrx": LLAMA3_MERGED,
    "qwen2": QWEN2,
    "deepseek-r1-qwen": QWEN2,
    "qwen35": Split((QWEN35_WORDS,)),  # no NFC: decomposed accents stay two tokens
    "tekken": Split((TEKKEN_WORDS,), ignore_merges=True, add_bos=True),
    "gpt-4o": GPT4O,
    "llama4": GPT4O,
    "starcoder": STARCODER,
    "smollm": STARCODER,
    "refact": STARCODER,
    "command-r": STARCODER,
    "falcon": Split((r"[\p{P}\$\+<=>\^~\|`]+", GPT2_WORDS, "[0-9][0-9][0-9]")),
    "deepseek-llm": Split((r"[\r\n]", DEEPSEEK_LLM_LETTERS, DEEPSEEK_LLM_PUNCTUATION, r"\s+$", CJK, r"\p{N}+")),
    "deepseek-coder": Split((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}")),
    "deepseek-v3": DEEPSEEK_V3,
    # Also the tokenizer model gemma4's. llama.cpp cuts the text at newlines, which changes no ids where no token
    # mixes a newline with other characters (Gemma 4 has none): the text goes to the merges whole.
    "gemma4": Split((), add_bos=True, byte_level=False),
}


def _pre_tokenizer(split: Split) -> pre_tokenizers.PreTokenizer:
    steps = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in split.regexes]
    if split.byte_level:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    else:  # Gemma's own: no space is left after the normalizer, but onnxruntime-genai needs it to apply the merges
        steps.append(pre_tokenizers.Split(" ", behavior="merged_with_previous"))
    return pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]


def _split(meta: Mapping[str, Any]) -> Split:
    if meta.get("tokenizer.ggml.model") == "gemma4":  # llama.cpp ignores the label for this model
        return PRE_TOKENIZERS["gemma4"]
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unknown BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre); known: {sorted(PRE_TOKENIZERS)}")
    return PRE_TOKENIZERS[pre]


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError(f"a {meta.get('tokenizer.ggml.model')}-style tokenizer needs tokenizer.ggml.merges")
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    return pairs


def _bpe(meta: Mapping[str, Any], tokens: list[str], split: Split) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _merges(meta)
    if split.byte_level:
        model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=split.ignore_merges)
    else:
        unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]
        model = models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
            ignore_merges=split.ignore_merges,
        )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = _pre_tokenizer(split)
    if split.byte_level:  # no normalizer: llama.cpp does not NFC-normalize, whatever the model's tokenizer.json
        tokenizer.decoder = decoders.ByteLevel()
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    return tokenizer


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("a llama-style (SentencePiece) tokenizer needs one tokenizer.ggml.scores entry per token")
    for index, score in enumerate(scores):  # the merge ranks: a NaN compares false with every other score
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ValueError(f"tokenizer.ggml.scores[{index}] is {score!r:.60}, not a finite number")
    vocab = {token: index for index, token in enumerate(tokens)}
    # llama.cpp (llm_tokenizer_spm_session) merges two adjacent pieces whenever their text is a token of any type
    # (a control token's text too), scored by that token. A user-defined token never gets there: its text is cut
    # out of the raw text first.
    ranked = []
    for index, (token, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        if kind == USER_DEFINED or len(token) < 2:
            continue
        if len(token) > MAX_MERGED_LENGTH:  # every cut slices the token: quadratic in its length
            if kind != 1:
                continue  # a long control token is reached only as a special token, never by merges
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


def _post_processor(
    meta: Mapping[str, Any], tokens: list[str], *, default_bos: bool, byte_level: bool
) -> processors.PostProcessor | None:
    """BOS/EOS added around every encoding when the file says so (add_bos_token, add_eos_token); without the
    keys, llama.cpp's defaults for the tokenizer (`default_bos`) and no EOS."""
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


def _llamacpp_kinds(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> list[int]:
    """The token types as llama.cpp tokenizes with them: the file's, with the unknown token and the
    end-of-generation texts (LLAMACPP_END_OF_GENERATION) made control tokens."""
    ordinary_end = any(token in ORDINARY_END_OF_SENTENCE for token in tokens)
    kinds = [CONTROL if kind == UNKNOWN else kind for kind in types]  # "<unk>" is parsed as control tokens are
    for index, token in enumerate(tokens):
        if token == "</s>" and ordinary_end:
            kinds[index] = 1
        elif token in LLAMACPP_END_OF_GENERATION:
            kinds[index] = CONTROL
    return kinds


def end_of_generation_ids(meta: Mapping[str, Any]) -> list[int]:
    """The ids llama.cpp ends generation at by their text (LLAMACPP_END_OF_GENERATION, "</s>" but beside an
    ORDINARY_END_OF_SENTENCE token), whatever tokenizer.ggml.eos/eot_token_id say: a chat model's end of turn,
    which many files leave out of the metadata."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ordinary_end = any(token in ORDINARY_END_OF_SENTENCE for token in tokens)
    ends = LLAMACPP_END_OF_GENERATION - ({"</s>"} if ordinary_end else set())
    return [i for i, token in enumerate(tokens) if token in ends]


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
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{len(types)} token types for {len(tokens)} tokens")
    kinds = _llamacpp_kinds(meta, tokens, types)
    if kind in ("gpt2", "gemma4"):
        split = _split(meta)
        tokenizer = _bpe(meta, tokens, split)
        default_bos, byte_level = split.add_bos, split.byte_level
    elif kind == "llama":
        tokenizer = _sentencepiece(meta, tokens, kinds)
        default_bos, byte_level = True, False  # llama.cpp adds BOS to a SentencePiece vocabulary by default
    else:
        raise ValueError(
            f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; 'gpt2', 'gemma4' and 'llama' are"
        )
    name = str(meta.get("general.name", "")).lower()
    phi3 = "phi-3" in name or "phi3" in name

    def added(token: str, special: bool) -> AddedToken:
        rstrip = phi3 and token not in PHI3_NO_RSTRIP
        return AddedToken(token, special=special, normalized=False, rstrip=rstrip)

    tokenizer.add_special_tokens([added(t, True) for t, k in zip(tokens, kinds, strict=True) if k == CONTROL])
    tokenizer.add_tokens([added(t, False) for t, k in zip(tokens, kinds, strict=True) if k == USER_DEFINED])
    # An added token whose text is not in the model's vocabulary would get a new id past the file's last one.
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != len(tokens):
        raise ValueError(f"the tokenizer built from the file has {size} tokens, the file {len(tokens)}")
    post = _post_processor(meta, tokens, default_bos=default_bos, byte_level=byte_level)
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer.to_str()
