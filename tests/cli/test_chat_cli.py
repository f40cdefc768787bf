"""`edgelm chat` in a real terminal (a pseudo-terminal driven by pexpect): streamed replies equal the
library's, /stats, /undo, /reset, Ctrl-C stops a reply and the chat goes on, Ctrl-C at the prompt and
Ctrl-D exit; a package without a chat template is one line on stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest
from chat_package import make_chat_package

from edgelm.runtime import load

pexpect = pytest.importorskip("pexpect", reason="pexpect is in the dev extra")
SYSTEM = "You are a terse assistant."
# The tiny model replies in milliseconds, before a Ctrl-C could land: this makes every model run take 20 ms.
SLOW = (
    "import sys, time; from edgelm.runtime.model import Model; run = Model.run; "
    "Model.run = lambda self, binding: (time.sleep(0.02), run(self, binding))[1]; "
    "from edgelm.cli import main; sys.exit(main(sys.argv[1:]))"
)
PROMPT = "\r\n> "


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return make_chat_package(tmp_path_factory.mktemp("chat-cli") / "fused")


def spawn(package, *args: str, slow: bool = False):
    code = ["-c", SLOW] if slow else ["-m", "edgelm"]
    argv = [*code, "chat", str(package), "--provider", "cpu", "--threads", "1", "--system", SYSTEM, *args]
    child = pexpect.spawn(sys.executable, argv, encoding="utf-8", timeout=60, dimensions=(50, 200))
    child.expect("Ctrl-C stops a reply")
    child.expect("> ")
    return child


def reply_of(child) -> str:
    """What the terminal showed between the echoed message and the next prompt, newlines as "\\n"."""
    child.expect(PROMPT)
    return child.before.replace("\r\n", "\n")


def test_a_three_turn_chat_with_commands(package) -> None:
    conv = load(package, provider="cpu", threads=1).conversation(system=SYSTEM)
    child = spawn(package, "--max-new-tokens", "16", "--greedy")  # the library's default: greedy
    expected = []
    for question in ["Hello there", "What is your name?", "Goodbye"]:
        child.sendline(question)
        expected.append(conv.send(question, 16).text.replace("\r\n", "\n"))
        shown = reply_of(child)
        assert shown.endswith("\n" + expected[-1]) and question in shown, (shown, expected[-1])

    child.sendline("/stats")
    child.expect(r"\[stats on\]")
    child.sendline("One more")
    child.expect(r"\[16 tokens, [0-9.]+ tokens/s, first token \d+ ms, prefilled (\d+) of (\d+) prompt tokens \((\w+)\)")
    prefilled, prompt, path = int(child.match.group(1)), int(child.match.group(2)), child.match.group(3)
    assert path in ("prefix", "rewind") and prefilled < prompt / 2, "a follow-up turn reuses the cache"
    child.expect("> ")

    for command, answer in [
        ("/undo", r"\[removed the last exchange\]"),
        ("/reset", r"\[new conversation\]"),
        ("/undo", r"\[there is no exchange to undo\]"),
        ("/frobnicate", r"\[unknown command /frobnicate"),
    ]:
        child.sendline(command)
        child.expect(answer)
        child.expect(PROMPT)
    child.sendline("Hello there")  # after /reset the first question gets the first answer again
    shown = reply_of(child)  # stats are still on: the cache held this very prompt, only its last id is fed
    assert f"\n{expected[0]}\n[16 tokens" in shown
    assert "(rewind)" in shown
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_reply_not_the_chat(package) -> None:
    child = spawn(package, "--max-new-tokens", "200", "--temperature", "1.0", "--seed", "1", "--stats", slow=True)
    child.sendline("Tell me a long story")
    child.expect("Tell me a long story\r\n")
    child.expect(r"\S{3}")  # some of the reply has streamed
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect(r"\[(\d+) tokens, ")
    assert 0 < int(child.match.group(1)) < 200
    child.expect("> ")
    child.sendline("/stats")
    child.expect(r"\[stats off\]")
    child.expect("> ")
    child.sendline("Short answer now")  # the chat goes on after a stopped reply
    child.expect("Short answer now\r\n")
    child.expect(r"\S{3}")  # the echo comes from the terminal: wait for the reply itself
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect("> ")
    child.sendintr()  # Ctrl-C at the prompt exits
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130


def test_ctrl_d_exits(package) -> None:
    child = spawn(package, "--max-new-tokens", "4")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_errors_are_one_line(package, tmp_path) -> None:
    child = spawn(package, "--max-new-tokens", "250")
    child.sendline("word " * 100)  # too long for the context with 250 new tokens: the chat goes on
    child.expect(r"edgelm chat: error: the message alone is \d+ tokens, which with --max-new-tokens \(250\) exceeds")
    child.expect("> ")  # the chat goes on
    child.sendline("/exit")
    child.expect(pexpect.EOF)

    plain = make_chat_package(tmp_path / "plain", template="")
    done = subprocess.run(
        [sys.executable, "-m", "edgelm", "chat", str(plain), "--provider", "cpu"],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("edgelm chat: error: the package plain has no chat template")
    done = subprocess.run(
        [sys.executable, "-m", "edgelm", "chat", str(package), "--temperature", "-1", "--provider", "cpu"],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stderr.startswith("edgelm chat: error: argument --temperature"), done.stderr


def test_a_template_that_fails_on_any_message_exits_at_start(tmp_path) -> None:
    """A hostile or broken template is one line on stderr and exit 1 before the first prompt, not an error on every
    turn of a chat that then exits 0."""
    bomb = make_chat_package(tmp_path / "bomb")
    (bomb / "chat_template.jinja").write_text('{{ "%999999999s" % "x" }}')  # SmolLM2's template, replaced
    done = subprocess.run(
        [sys.executable, "-m", "edgelm", "chat", str(bomb), "--provider", "cpu", "--no-verify"],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("edgelm chat: error: chat template failed"), done.stderr
