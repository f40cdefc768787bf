"""Tokenizer wrapper and incremental detokenization for streaming.

Byte-level BPE splits multi-byte characters across tokens: decoding a prefix of the ids can end in
half a character, which `tokenizers` renders as U+FFFD. TextAssembler holds such a tail back until
the character completes, and holds back any tail that could be the start of a stop string, so every
piece it emits is final: the concatenated stream equals the non-streamed text.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .errors import PackageError

REPLACEMENT = "\ufffd"


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise PackageError(f"{Path(path).name} is not a valid tokenizers file: {str(e).splitlines()[0]}") from None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """text -> ids. add_special_tokens: what tokenizer.json's post-processor adds around them (BOS, for
        tokenizers whose add_bos_token is true), as transformers' tokenizer.encode(text) and llama.cpp do for a
        text prompt; a chat template writes its own."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """encode(text), with each id's (start, end) character span in text."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special: the control tokens (<|im_start|>, <|eot_id|>, BOS, ...)."""
        return frozenset(i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special)

    @functools.cached_property
    def added_tokens(self) -> tuple[tuple[int, str], ...]:
        """Every added token, special or not, as (id, text): DeepSeek-R1's <｜User｜> is one not marked special."""
        return tuple((i, token.content) for i, token in sorted(self._tokenizer.get_added_tokens_decoder().items()))

    def encode_text(self, text: str, *, at_start: bool, also: frozenset[int] = frozenset()) -> list[int]:
        """text tokenized as plain text: special-token text in it becomes ordinary tokens ('<', '|', 'im', ...),
        and so does the text of the added tokens in `also`. at_start: whether text begins the whole input; a
        Metaspace pre-tokenizer that marks only the first word ("prepend_scheme": "first") does not mark a
        piece that follows a special token."""
        also = frozenset(also & {i for i, _ in self.added_tokens} - self.special_ids)
        copies = self._text_copies.get(also)
        if copies is None:
            copies = self._text_copies[also] = self._text_tokenizers(also)
        first, rest = copies
        return (first if at_start else rest).encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _text_copies(self) -> dict[frozenset[int], tuple]:
        return {}

    def _text_tokenizers(self, also: frozenset[int]) -> tuple:
        """Two copies that encode special tokens, and the added tokens in also (marked special here), as text
        (tokenizers' encode_special_tokens), for the start of the input and for the rest; separate instances,
        since the flag is shared state of a tokenizer."""
        import json

        from tokenizers import Tokenizer as HFTokenizer

        source = self._tokenizer.to_str()  # compact JSON: inside a token's text a quote is escaped, so only
        if also:  # the pre-tokenizer's own setting can read '"prepend_scheme":"first"'
            document = json.loads(source)
            for token in document["added_tokens"]:
                token["special"] = token["special"] or token["id"] in also
            source = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
        copies = []
        for text in (source, source.replace('"prepend_scheme":"first"', '"prepend_scheme":"never"')):
            copy = HFTokenizer.from_str(text)
            copy.encode_special_tokens = True
            copies.append(copy)
        return tuple(copies)

    def to_str(self) -> str:
        """The tokenizer as tokenizers' JSON text (for llguidance: runtime/constraints.py)."""
        return self._tokenizer.to_str()

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (e.g. "<|im_end|>"), None if there is none."""
        return self._tokenizer.id_to_token(token_id)

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        """The text of ids; control tokens dropped unless skip_special=False (a reply's tool-call markup)."""
        raw = self._raw_added
        if not raw or raw.keys().isdisjoint(ids):
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special)
        pieces, run = [], []
        for token_id in ids:
            if token_id in raw:  # the ids before it decoded on their own, then its text as it is
                pieces += [self._tokenizer.decode(run, skip_special_tokens=skip_special), raw[token_id]]
                run = []
            else:
                run.append(token_id)
        return "".join(pieces) + self._tokenizer.decode(run, skip_special_tokens=skip_special)

    @functools.cached_property
    def _raw_added(self) -> dict[int, str]:
        """The added tokens, not special, that the decoder does not give back as their text: DeepSeek's "ö", also
        a byte-level character, which the ByteLevel decoder reads as the byte 0xF6. llama.cpp writes such a
        (user-defined) token's text as it is, and so does decode. Empty for nearly every tokenizer."""
        decode = self._tokenizer.decode
        return {
            token_id: text
            for token_id, text in self.added_tokens
            if token_id not in self.special_ids and decode([token_id], skip_special_tokens=False) != text
        }


class TextAssembler:
    """Turns a growing list of generated ids into final text pieces, cutting at stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out
        self.text = ""
        self.stopped = False
        # decode(ids[:anchor]) == anchor_text, and ids[:anchor] ends on a whole character; context is
        # the decoded OVERLAP ids before the anchor
        self.anchor, self.anchor_text, self.context = 0, "", ""

    def add(self, token_id: int) -> str:
        """Append one id; return the text that is now final (maybe ""). Sets .stopped at a stop string."""
        self.ids.append(token_id)
        self.text = self._decode()
        search_from = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        cut = min((i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            return self._emit(len(self.text))
        safe = len(self.text)
        if self.text.endswith(REPLACEMENT):
            safe = len(self.text.rstrip(REPLACEMENT))  # an incomplete UTF-8 sequence: wait for its rest
        # a tail that may still grow into a stop string is not final yet
        head = self.text[:safe]
        hold = max(
            (n for s in self.stop for n in range(1, min(len(s) - 1, safe) + 1) if head.endswith(s[:n])), default=0
        )
        return self._emit(max(safe - hold, self.emitted))

    def _decode(self) -> str:
        """decode(self.ids), without decoding them all every step (that cost grows with the generation's
        length: docs/results.md). Decodes from a few ids before the anchor instead: ids[:anchor] end on
        a character boundary, so the bytes after it decode on their own; the overlap gives tokenizers
        whose decode treats the first token specially (a leading space) the same context as in full."""
        start = max(0, self.anchor - self.OVERLAP)
        window = self.tokenizer.decode(self.ids[start:])
        if not window.startswith(self.context):  # a decoder that is not separable here: decode it all
            text = self.tokenizer.decode(self.ids)
        else:
            text = self.anchor_text + window[len(self.context) :]
        if len(self.ids) - self.anchor >= self.ANCHOR_EVERY and not text.endswith(REPLACEMENT):
            self.anchor, self.anchor_text = len(self.ids), text
            self.context = self.tokenizer.decode(self.ids[self.anchor - self.OVERLAP : self.anchor])
        return text

    OVERLAP = 4  # ids decoded again before the anchor
    ANCHOR_EVERY = 16  # ids between anchors: a window never grows past OVERLAP + ANCHOR_EVERY + held ids

    def flush(self) -> str:
        """At the end of generation everything left is final."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        piece = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return piece
