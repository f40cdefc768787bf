"""`edgelm generate` and `edgelm chat` with structured output, tools and template variables (edgelm/cli/apps.py),
run as a user runs them, on a tiny random package (tests/chat_package.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from chat_package import make_chat_package

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return make_chat_package(tmp_path_factory.mktemp("apps-cli") / "fused", template="think")


def edgelm(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "edgelm", *args]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120)


def test_generate_with_a_regex_and_a_schema(package, tmp_path) -> None:
    done = edgelm("generate", str(package), "x", "--regex", "[0-9]{3}-[0-9]{2}", "--json", "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", json.loads(done.stdout)["text"])
    schema = tmp_path / "schema.json"
    ok = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    ok["additionalProperties"] = False
    schema.write_text(json.dumps(ok))
    done = edgelm("generate", str(package), "x", "--schema", str(schema), "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) in ({"ok": True}, {"ok": False})


def test_chat_with_tools_template_variables_and_a_regex(package, tmp_path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]))
    args = ["chat", str(package), "--tools", str(tools), "--template-var", "enable_thinking=false"]
    done = edgelm(*args, "--regex", "(yes|no)", "--max-new-tokens", "16", "--threads", "1", stdin="Is it?\n")
    assert done.returncode == 0, done.stderr
    assert re.match(r"> (yes|no)\n", done.stdout), done.stdout


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["--tools", "missing.json"], "missing.json does not exist"),
        (["--template-var", "novalue"], "KEY=VALUE"),
        (["--template-var", "x=" + "[" * 100_000], "edgelm chat: error: argument --template-var: the value of 'x'"),
        (["--regex", "[a-"], "regex"),
        (["--regex", "a", "--json-object"], "not allowed with"),
    ],
)
def test_bad_options_are_one_line(package, args, mentions) -> None:
    done = edgelm("chat", str(package), *args, "--max-new-tokens", "16", "--threads", "1", stdin="hi\n")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and mentions in lines[0] and "Traceback" not in done.stderr, done.stderr
