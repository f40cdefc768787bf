"""Every command's --help: it exits 0, says what the command takes today, shows an example, states the defaults
the code uses, carries no measurements, and the option groups commands share read the same in each."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from edgelm.cli import export as export_command
from edgelm.cli import main
from edgelm.export import defaults

COMMANDS = ("export", "quantize", "eval", "generate", "chat", "info", "bench", "serve")


def help_text(capsys, *argv: str) -> str:
    """What `edgelm *argv --help` prints to stdout, after checking it exits 0 and prints nothing to stderr."""
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--help"])
    assert exit.value.code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def flat(text: str) -> str:
    """Whitespace made single spaces: argparse wraps lines where it likes."""
    return " ".join(text.split())


def option_help(text: str, option: str) -> str:
    """The lines of one option's entry in a help text: from its line to the next option's."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(option))
    end = next(
        (i for i in range(start + 1, len(lines)) if re.match(r"\s{2}-", lines[i]) or not lines[i].strip()),
        len(lines),
    )
    return "\n".join(lines[start:end])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command, capsys):
    text = help_text(capsys, command)
    assert f"usage: edgelm {command}" in text
    example = text.split("example:", 1)[1]
    assert f"edgelm {command} " in example


def test_top_level_help_lists_every_command(capsys):
    text = help_text(capsys)
    for command in COMMANDS:
        assert re.search(rf"^ +{command} +\S", text, re.MULTILINE), command


def test_export_help_names_what_export_takes(capsys):
    text = flat(help_text(capsys, "export"))
    assert "GPT-2-layout" not in text and "GPT-2 layout" not in text
    for source in ("GGUF", "GPT-2", "Llama", "SmolLM2", "Mistral", "Qwen2", "Qwen3", "Gemma 3", "--dequantize"):
        assert source in text, source
    assert "keeps its own blocks" in text


def test_export_tolerance_help_states_the_defaults_export_uses(capsys, monkeypatch):
    onnx_export = pytest.importorskip("edgelm.export.onnx_export")  # needs torch: edgelm[export]
    # the help is built from the one definition (export/defaults.py), which export_package reads too
    monkeypatch.setattr(defaults, "KEPT_FLOAT_TOLERANCE", 0.25)
    monkeypatch.setattr(onnx_export, "KEPT_FLOAT_TOLERANCE", 0.25)
    text = flat(option_help(help_text(capsys, "export"), "--tolerance"))
    assert f"default {onnx_export.PARITY_TOLERANCE:g};" in text
    assert "0.25 for GGUF blocks or int4/int8 weights" in text
    assert f"mean {onnx_export.INT8_MEAN_KL:g} and max {onnx_export.INT8_MAX_KL:g} nats" in text
    assert not hasattr(export_command, "PARITY_TOLERANCE"), "the CLI keeps no copy of the tolerances"


def test_export_help_lists_every_family_and_kept_block_type_from_their_tables(capsys):
    families = pytest.importorskip("edgelm.export.families")  # needs torch: edgelm[export]
    from edgelm.export.gguf_blocks import BLOCK_TYPES

    text = flat(help_text(capsys, "export"))
    for row in families.FAMILIES.values():
        assert row.label in text and row.model_type in text, row.model_type
        assert row.gguf is None or row.gguf.architecture in text, row.model_type
    for kind in BLOCK_TYPES:
        assert kind.name in text, kind.name


@pytest.mark.parametrize("command", COMMANDS)
def test_help_texts_hold_no_measurements(command, capsys):
    """Measured numbers (a percentage, an `x1.19`) belong in docs/results.md, not in --help."""
    text = help_text(capsys, command)
    assert not re.search(r"\d%|\bx\d|\d\.\d+x\b", text), text


def test_int4_lm_head_help_points_to_the_results(capsys):
    text = flat(option_help(help_text(capsys, "quantize"), "--int4-lm-head"))
    assert "docs/results.md" in text


SAMPLING = ("--temperature", "--top-k", "--top-p", "--min-p", "--repetition-penalty", "--seed", "--stop")
RUNTIME = ("--provider", "--threads", "--no-verify")


@pytest.mark.parametrize("option", RUNTIME)
def test_runtime_options_read_the_same_in_every_command(option, capsys):
    texts = {
        command: option_help(help_text(capsys, command), option) for command in ("eval", "generate", "chat", "bench")
    }
    assert len(set(texts.values())) == 1, texts


@pytest.mark.parametrize("option", SAMPLING)
def test_sampling_options_read_the_same_in_generate_and_chat(option, capsys):
    texts = {command: option_help(help_text(capsys, command), option) for command in ("generate", "chat")}
    assert len(set(texts.values())) == 1, texts


def test_overwrite_reads_the_same_in_export_and_quantize(capsys):
    texts = {command: option_help(help_text(capsys, command), "--overwrite") for command in ("export", "quantize")}
    assert len(set(texts.values())) == 1, texts


@pytest.mark.parametrize(("command", "default"), [("generate", 64), ("chat", 256)])
def test_max_new_tokens_help_states_each_commands_default(command, default, capsys):
    text = flat(option_help(help_text(capsys, command), "--max-new-tokens"))
    assert f"(default {default})" in text


def test_serve_help_says_what_the_server_does_with_tools_today(capsys):
    text = flat(help_text(capsys, "serve"))
    assert "refused (400) by this build" not in text  # round 4's servers answer tools and response_format
    assert "Tools, tool_choice and response_format" in text


def test_quantize_help_reads_the_modes_without_numpy_onnx_or_torch():
    # the modes' names and help come from quantize/modes.py, which imports nothing
    code = (
        "import sys\n"
        "from edgelm.cli import main\n"
        "try:\n    main(['quantize', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "loaded = [m for m in ('numpy', 'onnx', 'onnxruntime', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "int8-weight-only: 8-bit blocks, batch-invariant" in " ".join(run.stdout.split())
