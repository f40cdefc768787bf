"""Every CLI message in CLI words: the library's errors name flags, not keyword arguments (edgelm/cli/words.py); each
wrong input points at what fixes it; a mistyped flag or command gets a close match."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from chat_package import make_chat_package

from edgelm.cli import main
from edgelm.cli.words import in_flags

PYTHON_WORDS = re.compile(r"\w=(True|False)|\w\(\)|\b(max_new_tokens|truncate_prompt|top_p|top_k|min_p|verify)\b")


@pytest.fixture(scope="module")
def chat_package(tmp_path_factory):
    return make_chat_package(tmp_path_factory.mktemp("words") / "chat")


def error_line(capsys, argv: list[str]) -> str:
    """The one stderr line of a failing command (argparse's errors exit with SystemExit), checked to be in CLI
    words."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    lines = capsys.readouterr().err.splitlines()
    assert code == 1 and len(lines) == 1, lines
    assert not PYTHON_WORDS.search(lines[0]), lines[0]
    return lines[0]


def test_context_overflow_names_the_flags(package, capsys):
    line = error_line(capsys, ["generate", str(package), "ROMEO: " * 40, "--max-new-tokens", "8"])
    assert line.startswith("edgelm generate: error: prompt (")
    assert "lower --max-new-tokens, or pass --truncate-prompt to drop the oldest prompt tokens" in line


def test_a_mistyped_flag_or_command_gets_a_close_match(package, capsys):
    line = error_line(capsys, ["generate", str(package), "ROMEO:", "--max-tokens", "8"])
    assert line.startswith(
        "edgelm generate: error: unrecognized arguments: --max-tokens 8; did you mean --max-new-tokens?"
    )
    line = error_line(capsys, ["cht", str(package)])
    assert "invalid choice: 'cht'" in line and "did you mean chat?" in line


def test_chat_without_a_template_points_at_generate(package, capsys):
    line = error_line(capsys, ["chat", str(package)])
    assert line.startswith(f"edgelm chat: error: the package {package.name} has no chat template")
    assert f'`edgelm generate {package} "PROMPT"`' in line


def test_bench_and_export_and_speculative_name_their_flags(package, tmp_path, capsys):
    line = error_line(capsys, ["bench", str(package), "--prompt-tokens", "60", "--new-tokens", "8"])
    assert line.endswith("give --new-tokens 4 or less")
    line = error_line(capsys, ["export", str(tmp_path), str(package)])
    assert line.endswith("already exists (give --overwrite to replace it)")
    line = error_line(capsys, ["generate", str(package), "x", "--speculative", str(tmp_path / "nowhere")])
    assert "--speculative" in line and "'lookup'" in line


def test_quantize_of_a_gguf_file_points_at_the_commands_that_run_it(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    line = error_line(capsys, ["quantize", str(gguf), str(tmp_path / "out"), "--mode", "int4"])
    assert line.endswith(
        f"is a GGUF file, not a package: `edgelm chat`, `generate`, `info` and `bench` run it directly (exported "
        f"once into a cache), or write a package with `edgelm export {gguf} OUT`"
    )
    assert "edgelm.load" not in line


def test_chat_errors_during_a_chat_name_the_flags(chat_package):
    command = [sys.executable, "-m", "edgelm", "chat", str(chat_package), "--max-new-tokens", "100", "--greedy"]
    done = subprocess.run(command, input="ROMEO: " * 300 + "\n", capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0 and len(errors) == 1, done.stderr
    assert "with --max-new-tokens (100) exceeds the context length 256" in errors[0]
    assert not PYTHON_WORDS.search(errors[0])


@pytest.mark.parametrize(
    ("message", "said"),
    [
        (
            "prompt (6 tokens) + max_new_tokens (64) = 70 exceeds the context length 64; shorten the prompt, lower "
            "max_new_tokens, or pass truncate_prompt=True to drop the oldest prompt tokens",
            "prompt (6 tokens) + --max-new-tokens (64) = 70 exceeds the context length 64; shorten the prompt, lower "
            "--max-new-tokens, or pass --truncate-prompt to drop the oldest prompt tokens",
        ),
        ("top_p must be in (0, 1], got 2", "--top-p must be in (0, 1], got 2"),
        ("temperature must be a finite number >= 0", "--temperature must be a finite number >= 0"),
        ("a has no a.json beside it; pass verify=False to load it unchecked", "a has no a.json beside it; give "
         "--no-verify to load it unchecked"),
        ("X cannot be verified: load it with verify=False (CLI: --no-verify)", "X cannot be verified: run it with "
         "--no-verify"),
        ("stop at a high temperature; top_k_filter and --top-p stay", None),  # English words and other names stay
    ],
)  # fmt: skip
def test_in_flags(message, said):
    assert in_flags(message) == (message if said is None else said)
