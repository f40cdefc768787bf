"""The command line's words for the library's messages, and close-match hints for mistyped flags and commands.

The runtime and export raise their documented errors in the words of the Python API (`truncate_prompt=True`,
`max_new_tokens`, `verify=False`), which is right for a caller of `Model.generate` and wrong on a terminal, where
the same advice is a flag. Every message the CLI prints goes through `in_flags`, which rewrites the API's names
into the flags that do the same; this table is the one place that pairs them.
"""

from __future__ import annotations

import difflib
import re

# (pattern, replacement), applied in order: whole phrases first, then the bare parameter names
FLAG_WORDS = (
    (r"\bpass truncate_prompt=True\b", "pass --truncate-prompt"),
    (r"\btruncate_prompt=True\b", "--truncate-prompt"),
    (r"\bload it with verify=False \(CLI: --no-verify\)", "run it with --no-verify"),
    (r"\bload it with verify=False\b", "run it with --no-verify"),
    (r"\bpass verify=False\b", "give --no-verify"),
    (r"\(use --overwrite / overwrite=True to replace it\)", "(give --overwrite to replace it)"),
    (r"\bspeculative must be 'lookup', a draft Model, a package folder or None\b",
     "--speculative must be 'lookup', a package folder, a GGUF file or a model folder"),
    (r"\blast_token_logits is for the standard graph; the fused graph takes num_logits_to_keep\b",
     "--last-token-logits is for --attention standard (the fused graph picks per call)"),
    (r"\bkeep_gguf_quantization and dequantize contradict each other\b",
     "--keep-gguf-quantization and --dequantize contradict each other"),
    (r"\bthis package has no tokenizer.json: pass token ids instead of text\b",
     "this package has no tokenizer.json, so it takes no text prompt (the Python API takes token ids)"),
    (r"\bstop strings need a tokenizer\b", "--stop needs a tokenizer"),
    (r"\bload it with edgelm\.load, which exports it once into a cache of packages\b",  # runtime/package.py
     "`edgelm chat`, `generate`, `info` and `bench` run it directly (exported once into a cache)"),
    (r"\bexport_package\(accuracy_level=0\)", "`edgelm export --accuracy-level 0`"),  # export/onnx_export.py
    (r"\bquantize\(mode='int8-weight-only'\)", "`edgelm quantize --mode int8-weight-only`"),
    (r"\bexport_package\(tolerance=([^)]+)\)", r"`edgelm export --tolerance \1`"),
    (r"\b(temperature|seed|stop) must be\b", r"--\1 must be"),
    (r"\buse at most (\d+) new tokens\b", r"give --new-tokens \1 or less"),  # bench
    (r"\buse fewer prompt tokens\b", "lower --prompt-tokens"),
)  # fmt: skip
# parameters whose names are no English words, wherever a message names one
PARAMETERS = ("max_new_tokens", "repetition_penalty", "top_k", "top_p", "min_p")
_PARAMETER = re.compile(r"(?<![\w-])(" + "|".join(PARAMETERS) + r")(?![\w=-])")


def in_flags(message: str) -> str:
    """A library message in the command line's words: API phrases and parameter names become flags."""
    for pattern, replacement in FLAG_WORDS:
        message = re.sub(pattern, replacement, message)
    return _PARAMETER.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


def close_match(word: str, choices: list[str]) -> str:
    """ "; did you mean X?" for the closest of choices, or ""."""
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not found and word.startswith("--"):  # --max-tokens: a flag whose words are a subset of one flag's
        parts = set(word[2:].split("-"))
        found = [c for c in choices if c.startswith("--") and parts <= set(c[2:].split("-"))][:1]
    return f"; did you mean {found[0]}?" if found else ""


def unrecognized(extras: list[str], options: list[str]) -> str:
    """argparse's "unrecognized arguments" with a hint for the first mistyped flag."""
    hint = next((close_match(w.split("=")[0], options) for w in extras if w.startswith("--")), "")
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def invalid_choice(message: str) -> str:
    """argparse's "invalid choice: 'cht' (choose from ...)" with a hint, where one choice is close."""
    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if not found:
        return message
    choices = re.findall(r"'([^']*)'", found.group(2)) or [c.strip() for c in found.group(2).split(",")]
    return message + close_match(found.group(1), choices)
