"""Constrained decoding: output that matches a JSON Schema, a regular expression or a Lark grammar.

Built on llguidance (the library onnxruntime-genai and llama.cpp use; `pip install edgelm[structured]`): a
grammar is compiled once per call, and for every position a row's LLMatcher gives the set of tokens that keep
the output inside the language; GrammarMask is the call's token mask (runtime/sampling.py's TokenMask), which the
one TokenPicker applies before every choice, so the others' logits are -inf. When the grammar is complete only the
package's EOS ids remain.

    constraint_from(response_format={"type": "json_schema", "json_schema": {"schema": {...}}})
    constraint_from(regex=r"\\d{3}")
    constraint_from(grammar='start: "yes" | "no"')   # llguidance's Lark dialect, %json{...} for a schema

The mask is given a row's ids so far (speculative decoding: with the guesses before the position) and keeps
its matcher in step with them, rolling back what a rejected guess added, so a constrained speculative round
gives exactly the tokens plain constrained decoding gives.
`tool_choice_grammar` forces tool calls: the convention's markup (runtime/tool_calls.py) around JSON that
matches one of the tools' schemas.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import untrusted
from .errors import InvalidParameterError
from .tools import tool_name, tool_parameters

if TYPE_CHECKING:
    from .tool_calls import Convention

CONSTRAINT_OPTIONS = ("response_format", "grammar", "regex")
# JSON as json.dumps writes it, with no free whitespace (a model could otherwise write newlines until the budget
# ends); a schema's own "x-guidance" settings win over these
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InvalidParameterError(
            "response_format, regex, grammar and a forced tool_choice need llguidance: pip install edgelm[structured]"
        ) from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """One call's constraint: llguidance's grammar (JSON text) and what it was made from, for messages."""

    grammar: str
    what: str  # "a JSON schema", "the regex ...", ...


def constraint_from(*, response_format: Any = None, grammar: Any = None, regex: Any = None) -> Constraint | None:
    """The constraint of one row's options (at most one given); InvalidParameterError when it is malformed or does
    not compile, with llguidance's message."""
    values = (response_format, grammar, regex)
    given = [name for name, value in zip(CONSTRAINT_OPTIONS, values, strict=True) if value is not None]
    if len(given) > 1:
        raise InvalidParameterError(f"give at most one of response_format, grammar and regex, got {', '.join(given)}")
    if response_format is not None:
        schema = _response_schema(response_format)
        if schema is None:
            return None
        made, what = ("json", schema), "the response_format's JSON schema"
    elif grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidParameterError(f"grammar must be Lark source text, got {grammar!r:.60}")
        made, what = ("lark", grammar), "the grammar"
    elif regex is not None:
        if not isinstance(regex, str) or not regex:
            raise InvalidParameterError(f"regex must be a non-empty string, got {regex!r:.60}")
        made, what = ("regex", regex), "the regex"
    else:
        return None
    llg = _llguidance()
    kind, source = made
    if kind == "json":
        _bounded(source, what)
    try:
        if kind == "json":
            compiled = llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_STYLE)
        elif kind == "lark":
            compiled = llg.LLMatcher.grammar_from_lark(source)
        else:
            compiled = llg.LLMatcher.grammar_from_regex(source)
    except (ValueError, TypeError) as e:
        raise InvalidParameterError(f"{what} is not valid: {e}") from None
    error = llg.LLMatcher.validate_grammar(compiled)
    if error:
        lines = [line.strip() for line in error.strip().splitlines()]  # a regex's reason is on its own line
        reason = next((line.removeprefix("error:").strip() for line in lines if line.startswith("error:")), "")
        raise InvalidParameterError(f"{what} does not compile: {' '.join(filter(None, (lines[0], reason)))}")
    return Constraint(compiled, what)


def _bounded(schema: Any, what: str) -> None:
    """InvalidParameterError for a schema past runtime/untrusted.py's bounds, before llguidance sees it: it converts
    a Python dict recursively, and a dict nested some thousands deep overflows the C stack (a segfault)."""
    try:
        untrusted.check(schema)
    except untrusted.Unbounded as e:
        raise InvalidParameterError(f"{what} is not valid: {e}") from None


def _response_schema(response_format: Any) -> dict | None:
    """The JSON schema a response_format asks for ({} for any JSON object); None for {"type": "text"}."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if isinstance(schema, bool):
            schema = {} if schema else None
        if not isinstance(schema, dict):
            raise InvalidParameterError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        return schema
    raise InvalidParameterError(
        f'response_format must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": "json_schema", '
        f'"json_schema": {{"schema": ...}}}}, got {response_format!r:.80}'
    )


def constraints_from(options: dict[str, Any], rows: int | None) -> Constraint | list[Constraint | None] | None:
    """The constraint option of a call, taken out of options: one Constraint for every row, or with `rows` (a
    batch) lists with one entry per row accepted too."""
    values = {name: options.pop(name) for name in CONSTRAINT_OPTIONS if name in options}
    if not any(value is not None for value in values.values()):
        return None
    lists = {name: value for name, value in values.items() if isinstance(value, (list, tuple))}
    if not lists:
        return constraint_from(**values)
    if rows is None:
        raise InvalidParameterError(f"{', '.join(lists)}: a list of constraints is for generate_batch, one per prompt")
    for name, value in lists.items():
        if len(value) != rows:
            raise InvalidParameterError(f"{name} has {len(value)} entries for {rows} prompts")
    return [
        constraint_from(**{name: value[row] if name in lists else value for name, value in values.items()})
        for row in range(rows)
    ]


# ---- matching ------------------------------------------------------------------------------------------------

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> {(vocab, eos): LLTokenizer}


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of a package tokenizer (built once: it walks the whole vocabulary)."""
    llg = _llguidance()
    known = _tokenizers.setdefault(tokenizer, {})
    key = (vocab_size, eos_ids)
    if key not in known:
        known[key] = llg.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
    return known[key]


class Matcher:
    """One row's grammar state: the mask of allowed tokens at the next position, and the tokens taken."""

    def __init__(self, constraint: Constraint, ll_tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        llg = _llguidance()
        self.constraint, self.vocab_size, self.eos = constraint, vocab_size, np.array(eos_ids, dtype=np.int64)
        # short errors (verbose ones print the whole grammar and parser state), and nothing on stderr
        limits = llg.LLParserLimits(verbose_errors=False)
        self.matcher = llg.LLMatcher(ll_tokenizer, constraint.grammar, log_level=0, limits=limits)
        self._check()
        self.words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # the mask, one bit per token
        self.taken: list[int] = []  # the tokens the matcher has consumed, in order
        self._try_a_first_token()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise InvalidParameterError(f"{self.constraint.what}: {self._reason()}")

    def _reason(self) -> str:
        lines = [line.strip() for line in self.matcher.get_error().strip().splitlines() if line.strip()]
        return lines[0] if lines else "the grammar failed"

    def _try_a_first_token(self) -> None:
        """Consume one allowed first token and roll it back: llguidance builds a grammar's parser rows and lexer
        states as tokens come, so a grammar past its limits (20,000 alternatives in one rule, a regex such as
        (a{1000}){1000}) fails here, before generation starts, rather than at the first token."""
        allowed = self.allowed()
        allowed[self.eos] = False
        first = np.flatnonzero(allowed)
        if first.size == 0:
            return
        if not self.matcher.consume_token(int(first[0])) or self.matcher.is_error():
            raise InvalidParameterError(
                f"{self.constraint.what} is past what constrained decoding can follow: {self._reason()}"
            )
        self.matcher.rollback(1)

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens that keep the output in the language (the EOS ids once it is complete)."""
        words = self.words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        self._check()
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
        if self.matcher.is_accepting() or self.matcher.is_stopped():
            allowed[self.eos] = True  # every EOS id of the package ends a complete output
        return allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one position's logits (V,) with the disallowed tokens at -inf."""
        return np.where(self.allowed(), logits, -np.inf).astype(logits.dtype, copy=False)

    def follow(self, ids: list[int]) -> bool:
        """Bring the matcher to the state after ids (the row's tokens so far, EOS ids left out): roll back what it
        took beyond their common prefix, take the rest. False when the grammar refuses one of them (a position
        after a guess that speculative decoding will reject: it is never chosen from)."""
        taken, kept = self.taken, 0
        for a, b in zip(taken, ids, strict=False):
            if a != b:
                break
            kept += 1
        if len(taken) > kept:
            self.matcher.rollback(len(taken) - kept)
            del taken[kept:]
        for token in ids[kept:]:
            if self.matcher.validate_tokens([token]) != 1:
                return False
            if not self.matcher.consume_token(token):  # validated, so only a limit reached mid-way refuses it
                raise InvalidParameterError(
                    f"{self.constraint.what} went past what constrained decoding can follow: {self._reason()}"
                )
            taken.append(token)
        return True


class GrammarMask:
    """A call's constraint as runtime/sampling.py's token mask: (row, the row's ids so far, logits) -> logits with
    the tokens the grammar refuses at -inf. One Matcher per row, kept in step with the ids it is given (so
    speculative decoding's guesses, and their rejection, need nothing else)."""

    def __init__(self, runner, constraint: Constraint | list[Constraint | None]):
        tokenizer = getattr(runner, "tokenizer", None)  # a Model or an adapter's runner has one
        if tokenizer is None:
            raise InvalidParameterError("constrained decoding needs a tokenizer, and this package has none")
        self.vocab, self.eos = runner.spec.arch.vocab_size, tuple(runner.spec.tokens.eos_token_ids)
        self.ll_tokenizer = _ll_tokenizer(tokenizer, self.vocab, self.eos)
        self.constraint = constraint
        self.matchers: dict[int, Matcher] = {}
        self._lock = threading.Lock()  # rows of one batch are masked by one thread, but be safe if not
        # each row's matcher made now, so a grammar past llguidance's limits fails before generation starts
        rows = range(len(constraint)) if isinstance(constraint, list) else range(1)
        made: dict[int, Matcher] = {}  # one first matcher per distinct constraint: rows sharing one pass together
        for row in rows:
            one = constraint[row] if isinstance(constraint, list) else constraint
            if one is not None and id(one) not in made:
                made[id(one)] = self.matchers[row] = Matcher(one, self.ll_tokenizer, self.vocab, self.eos)

    def __call__(self, row: int, ids, logits: np.ndarray) -> np.ndarray:
        constraint = self.constraint[row] if isinstance(self.constraint, list) else self.constraint
        if constraint is None:
            return logits
        with self._lock:
            matcher = self.matchers.get(row)
            if matcher is None:
                matcher = self.matchers[row] = Matcher(constraint, self.ll_tokenizer, self.vocab, self.eos)
            if not matcher.follow([token for token in ids if token not in self.eos]):
                return logits
            return matcher.mask(logits)


# ---- forced tool calls -------------------------------------------------------------------------------------------


def tool_choice_grammar(convention: Convention, tools: list[dict] | None, choice: Any, tokenizer) -> str:
    """Lark source for tool_choice "required" (one or more calls of any tool) or {"type": "function", "function":
    {"name": NAME}} (one call of that tool), in the template's tool-call markup."""
    if not tools:
        raise InvalidParameterError(f"tool_choice {choice!r} needs tools")
    names = [tool_name(spec) if isinstance(spec, dict) else None for spec in tools]
    if None in names:
        raise InvalidParameterError(f"tool {names.index(None)} has no function name to force a call of")
    if choice == "required":
        chosen, many = tools, True
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        wanted = choice["function"].get("name")
        if wanted not in names:
            raise InvalidParameterError(f"tool_choice names {wanted!r}, which is not among the tools {names}")
        chosen, many = [tools[names.index(wanted)]], False
    else:
        raise InvalidParameterError(
            f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
            f"got {choice!r:.80}"
        )
    for spec in chosen:
        _bounded(tool_parameters(spec), f"the tool {tool_name(spec)}'s parameters")
    arguments_key = "parameters" if convention.name == "llama3" else "arguments"

    def call_schema(spec: dict) -> dict:
        return {
            "type": "object",
            "properties": {"name": {"const": tool_name(spec)}, arguments_key: tool_parameters(spec)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }

    one = {"anyOf": [call_schema(spec) for spec in chosen]} if len(chosen) > 1 else call_schema(chosen[0])
    style = {"x-guidance": JSON_STYLE | {"lenient": True}}  # lenient: tool specs hold keys such as "nullable"
    specials = {tokenizer.token_text(i): i for i in tokenizer.special_ids}

    def literal(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else json.dumps(text)

    call = f"%json {json.dumps(style | one)}"
    if convention.name == "hermes":
        block = f'{literal(convention.open)} "\\n" {call} "\\n" {literal(convention.close)}'
        return f'start: block ("\\n" block)*\nblock: {block}' if many else f"start: {block}"
    if convention.name in ("mistral", "phi4"):
        items = style | {"type": "array", "items": one, "minItems": 1} | ({} if many else {"maxItems": 1})
        close = f" {literal(convention.close)}" if convention.close else ""
        return f"start: {literal(convention.open)} %json {json.dumps(items)}{close}"
    if convention.name == "harmony":  # one call per message: the recipient in the header, the arguments after
        calls = [
            " ".join(
                [
                    literal("<|channel|>"),
                    literal(f"commentary to=functions.{tool_name(spec)} "),
                    literal("<|constrain|>"),
                    literal("json"),
                    literal("<|message|>"),
                    f"%json {json.dumps(style | tool_parameters(spec))}",
                ]
            )
            for spec in chosen
        ]
        return "start: " + " | ".join(calls)
    if convention.name == "llama3":
        return f'start: {call} ("; " {call})*' if many else f"start: {call}"
    raise InvalidParameterError(f"tool_choice {choice!r} is not supported for this template's tool calls")
