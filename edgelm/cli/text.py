"""What the commands print: text from files made safe for a terminal, and JSON that is always valid."""

from __future__ import annotations

import json
import math
import unicodedata

_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(text: object) -> str:
    """Text taken from a file (a model or template name, manifest strings, an error quoting them) made safe for
    a terminal: control characters (escape sequences recolour, retitle or rewrite the screen) and bidirectional
    overrides become visible \\x.. escapes. Generated text is the model's output and is printed as it is."""
    return "".join(
        (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        if unicodedata.category(c) == "Cc" or c in _BIDI_CONTROLS
        else c
        for c in str(text)
    )


def to_json(value: object, **options) -> str:
    """Valid JSON whatever a file held: NaN and infinities (json.dumps would write the invalid NaN) become null."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False, **options)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
