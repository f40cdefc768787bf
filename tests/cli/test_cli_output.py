"""What the CLI prints from files it did not write: valid JSON whatever a manifest holds (NaN included), no
terminal escape sequences from file content (model metadata, names quoted in errors), and `bench` refusing
token counts over the context instead of shrinking them behind the user's back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import copy_package, edit_manifest

from edgelm.cli import main
from edgelm.runtime import ContextLengthError

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x9b31m\u202e"  # retitle the terminal, clear it, C1 CSI, right-to-left override


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def edited_copy(package: Path, tmp_path: Path, change) -> Path:
    folder = copy_package(package, tmp_path, "pkg")
    edit_manifest(folder, change)
    return folder


def strict_json(text: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_info_json_is_valid_json_when_the_manifest_holds_nan(package, tmp_path, capsys):
    def nan_report(manifest):
        manifest["evaluation"] = {"perplexity": float("nan"), "kl": float("inf"), "top1": [float("-inf"), 0.5]}

    folder = edited_copy(package, tmp_path, nan_report)
    assert "NaN" in (folder / "edgelm.json").read_text()  # json.dumps writes it, json.loads reads it back
    status, out, _ = run(capsys, "info", str(folder), "--json")
    assert status == 0
    info = strict_json(out)
    assert info["evaluation"] == {"perplexity": None, "kl": None, "top1": [None, 0.5]}
    status, out, _ = run(capsys, "info", str(folder))
    assert status == 0 and "NaN" not in out and '"top1": [null, 0.5]' in out


def test_info_prints_no_escape_sequences_from_the_manifest(package, tmp_path, capsys):
    def hostile(manifest):
        manifest["architecture"]["type"] = "gpt2" + ESCAPES
        manifest["precision"] = "fp32" + ESCAPES

    folder = edited_copy(package, tmp_path, hostile)
    status, out, _ = run(capsys, "info", str(folder))
    assert status == 0
    assert not any(c in out for c in "\x1b\x07\x9b\u202e"), repr(out)
    assert "gpt2\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202e" in out
    status, out, _ = run(capsys, "info", str(folder), "--json")
    assert strict_json(out)["architecture"] == "gpt2" + ESCAPES  # JSON carries it exactly, escaped
    assert "\x1b" not in out and "\x07" not in out


def test_an_error_quoting_file_content_prints_no_escape_sequences(package, tmp_path, capsys):
    def listed(manifest):
        manifest["files"]["\x1b[2Jevil\x1b]0;owned\x07"] = {"sha256": "0" * 64, "bytes": 1}

    folder = edited_copy(package, tmp_path, listed)
    status, out, err = run(capsys, "info", str(folder))
    assert status == 1 and out == ""
    assert "\x1b" not in err and "\x07" not in err, repr(err)
    assert "\\x1b[2Jevil\\x1b]0;owned\\x07" in err and len(err.splitlines()) == 1


def test_bench_refuses_new_tokens_over_the_context(package, model, capsys):
    from edgelm.runtime.bench import bench

    context = model.context_length
    with pytest.raises(ContextLengthError, match=f"use at most {context - 32} new tokens"):
        bench(str(package), prompt_tokens=32, new_tokens=context, repeats=1, model=model)
    with pytest.raises(ContextLengthError, match="use fewer prompt tokens"):
        bench(str(package), prompt_tokens=context, new_tokens=2, repeats=1, model=model)
    argv = ["bench", str(package), "--prompt-tokens", "32", "--new-tokens", str(context), "--repeats", "1"]
    status, out, err = run(capsys, *argv)
    assert status == 1 and out == "" and "context length" in err
    argv[5] = str(context - 32)  # exactly the context: measured, and the report says the count asked for
    status, out, _ = run(capsys, *argv, "--json")
    assert status == 0 and strict_json(out)["new_tokens"] == context - 32
