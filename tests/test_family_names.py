"""No library file outside a family's own modules names a family: a family is its module under export/families/
and its reference model under export/models/ (and its test cases), so adding one touches those and the mechanisms
it brings, never `if family == "gemma4"` in graph.py. Comments and docstrings may name families (they say which
model a mechanism came from); identifiers and strings may not, except the few below, each with its reason: names
that are another format's vocabulary (a GGUF tokenizer model or pre-tokenizer label, PEFT's table, a tool-call
syntax), not a choice the code makes by family.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("edgelm", "export", "quantize", "runtime")
FAMILY_HOMES = ("export/families", "export/models")  # a family's module and its reference model, and their tables
# A family's name in an identifier or a string (llama.cpp, the tool, is not the Llama family).
FAMILY = re.compile(r"gpt-?2|llama(?!\.?cpp)|mistral|qwen|gemma|smollm|granite|phi-?[34]|lfm", re.IGNORECASE)

# file -> (the family words it may use, why)
ALLOWED: dict[str, tuple[set[str], str]] = {
    "export/gguf_tokenizer.py": (
        {"gpt2", "llama", "qwen", "gemma", "smollm", "granite", "lfm", "phi3"},
        "a GGUF file's own vocabulary: tokenizer.ggml.model ('gpt2', 'llama', 'gemma4') and tokenizer.ggml.pre "
        "labels (llama.cpp's names for pre-tokenizers), and llama.cpp's RSTRIP rule, which it keys on general.name "
        "containing 'phi3' (mirrored as llama.cpp does it; a candidate for the Phi-3 row's GGUFLayout)",
    ),
    "export/peft_adapter.py": (
        {"gpt2", "llama", "mistral", "qwen", "gemma"},
        "PEFT's default target modules, its own table keyed by model_type (TRANSFORMERS_MODELS_TO_LORA_TARGET_"
        "MODULES_MAPPING), copied as PEFT has it",
    ),
    "export/onnx_export.py": ({"gemma"}, "an error message that cites a measurement on Gemma 3 270M"),
    "runtime/foreign.py": (
        {"gpt2"},
        "Optimum's GPT-2 export, a foreign folder format whose config.json says model_type 'gpt2' (the one foreign "
        "model type it reads; the packages edgelm writes carry everything in edgelm.json)",
    ),
    "runtime/constraints.py": ({"llama", "mistral", "phi4"}, "tool-call syntaxes, named as their chat templates are"),
    "runtime/tool_calls.py": ({"llama", "mistral", "phi4"}, "tool-call syntaxes, named as their chat templates are"),
    "edgelm/cli/__init__.py": ({"smollm"}, "help text examples: a real GGUF file's name"),
    "edgelm/cli/cache.py": ({"smollm"}, "help text examples: a real GGUF file's name"),
    "edgelm/cli/export.py": ({"smollm"}, "help text examples: a model folder's name"),
}


def _word(match: str) -> str:
    """The family word a match stands for, as ALLOWED spells them ("GPT-2" -> "gpt2", "Qwen3" -> "qwen")."""
    word = match.lower().replace("-", "")
    return word if word.startswith(("phi", "gpt")) else re.sub(r"\d", "", word)


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.add(first.lineno)
    return lines


def family_names(source: str) -> list[tuple[int, str, str]]:
    """(line, token, family word) for every identifier or string of `source` that names a family; comments and
    docstrings do not count."""
    docstrings = _docstring_lines(ast.parse(source))
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)):
            continue
        if token.type != tokenize.NAME and token.start[0] in docstrings:
            continue
        found += [(token.start[0], token.string, _word(m.group())) for m in FAMILY.finditer(token.string)]
    return found


def library_files() -> list[Path]:
    return sorted(path for folder in LIBRARY for path in (ROOT / folder).rglob("*.py"))


def test_the_checker_sees_identifiers_and_strings_not_comments():
    source = '"""Gemma 4\'s parts."""\n# Qwen3.5 too\nif family == "gemma4":\n    use_llama_rope = 1\n'
    assert [(line, word) for line, _, word in family_names(source)] == [(3, "gemma"), (4, "llama")]
    assert family_names("LLAMACPP_END = 1  # llama.cpp's\nx = 'llama.cpp'\n") == []


def test_no_library_file_outside_a_family_names_one():
    problems = []
    for path in library_files():
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(FAMILY_HOMES):
            continue
        allowed = ALLOWED.get(relative, (set(), ""))[0]
        problems += [
            f"{relative}:{line}: {token[:60]!r} names {word!r}"
            for line, token, word in family_names(path.read_text())
            if word not in allowed
        ]
    assert not problems, "a family named outside its modules (make it a field of its row, or data):\n" + "\n".join(
        problems
    )


def test_every_allowance_is_still_needed():
    for relative, (words, reason) in ALLOWED.items():
        assert reason, f"{relative}: an allowance says why"
        used = {word for _, _, word in family_names((ROOT / relative).read_text())}
        assert words <= used, f"{relative}: {sorted(words - used)} no longer named: drop them from ALLOWED"
