"""The runtime's commands as a user runs them: `python -m edgelm generate | info | bench` in a subprocess,
checked against the library's own output, and bad input as one line on stderr with exit status 1."""

from __future__ import annotations

import json
import subprocess
import sys

import onnxruntime as ort
import pytest
from helpers import copy_package, edgelm, edit_manifest

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def test_generate_streams_text_and_reports_speed(package, model):
    done = edgelm("generate", str(package), "ROMEO:", "--max-new-tokens", "8", "--provider", "cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout == model.generate("ROMEO:", 8).text + "\n"
    assert done.stdout.strip()
    assert "tokens/s" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr


def test_generate_json_matches_the_library(package, model):
    args = ["--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "40", "--seed", "3"]
    done = edgelm("generate", str(package), "ROMEO:", *args, "--json")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().splitlines()) == 1, "one JSON object on one line"
    data = json.loads(done.stdout)
    assert {"text", "token_ids", "finish_reason", "timings"} <= set(data)
    expected = model.generate("ROMEO:", 8, temperature=0.8, top_k=40, seed=3)
    assert data["token_ids"] == expected.token_ids
    assert data["text"] == expected.text
    assert data["finish_reason"] == expected.finish_reason
    assert data["timings"]["new_tokens"] == len(expected.token_ids)


def test_generate_stop_string(package, model):
    full = model.generate("ROMEO:", 20).text
    stop = next(full[i : i + 2] for i in range(1, len(full) - 1) if full.find(full[i : i + 2]) > 0)  # not at 0
    done = edgelm("generate", str(package), "ROMEO:", "--max-new-tokens", "20", "--stop", stop, "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["finish_reason"] == "stop"
    assert data["text"] == full[: full.find(stop)] and data["text"]


def test_info(package):
    done = edgelm("info", str(package))
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert lines["context_length"] == "64" and lines["vocab_size"] == "320" and lines["kind"] == "edgelm"
    done = edgelm("info", str(package), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["layers"] == 2


def test_bench_json(package):
    options = "--new-tokens 8 --prompt-tokens 8 --repeats 1 --json --provider cpu --threads 1"
    done = edgelm("bench", str(package), *options.split())
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["decode_tokens_per_s"] > 0
    assert report["new_tokens"] == 8 and report["prompt_tokens"] == 8


def assert_one_error_line(done: subprocess.CompletedProcess, mentions: str) -> None:
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("edgelm generate: error:")
    assert mentions in lines[0]
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "2"], "--top-p"),
        (["--top-k", "-3"], "--top-k"),
        (["--max-new-tokens", "100"], "context length 64"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        pytest.param(
            ["--provider", "cuda"],
            "CPUExecutionProvider",
            marks=pytest.mark.skipif(HAS_CUDA, reason="onnxruntime here has the CUDA provider"),
        ),
    ],
    ids=["temperature", "top-p", "top-k", "context", "penalty", "cuda-on-cpu"],
)
def test_bad_input_is_one_line_on_stderr(package, args, mentions):
    assert_one_error_line(edgelm("generate", str(package), "ROMEO:", *args), mentions)


def test_missing_package_is_one_line_on_stderr(tmp_path):
    assert_one_error_line(edgelm("generate", str(tmp_path / "no-such-package"), "ROMEO:"), "does not exist")


# ---- round 2: every option validated, one exit-code convention, no traceback from any command ---------


def assert_error(done: subprocess.CompletedProcess, command: str, mentions: str) -> None:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    prefix = "edgelm: error:" if command == "edgelm" else f"edgelm {command}: error:"
    assert len(lines) == 1 and lines[0].startswith(prefix) and mentions in lines[0], done.stderr


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["bench", "PKG", "--repeats", "0"], "--repeats"),
        (["bench", "PKG", "--batch", "-1"], "--batch"),
        (["bench", "PKG", "--new-tokens", "1"], "--new-tokens"),
        (["bench", "PKG", "--prompt-tokens", "zero"], "--prompt-tokens"),
        (["export", "PKG", "OUT", "--opset", "3"], "--opset"),
        (["export", "PKG", "OUT", "--tolerance", "nan"], "--tolerance"),
        (["generate", "PKG", "x", "--threads", "0"], "--threads"),
        (["generate", "PKG", "x", "--threads", "99999"], "--threads"),
        (["quantize", "PKG", "OUT", "--mode", "int2"], "--mode"),
        (["quantize", "PKG", "OUT", "--mode", "int4", "--block-size", "48"], "--block-size"),
        (["quantize", "PKG", "OUT", "--mode", "static", "--calibration-method", "max"], "--calibration-method"),
        (["quantize", "PKG", "OUT", "--mode", "static", "--calibration-samples", "0"], "--calibration-samples"),
        (["quantize", "PKG", "OUT", "--mode", "static"], "--calibration-text"),
        (["quantize", "PKG", "OUT", "--mode", "dynamic", "--eval-text", "/nonexistent"], "does not exist"),
        (["eval", "PKG", "--text", "/dev/null"], "not a regular file"),
        (["eval", "PKG", "--text", "PKG/tokenizer.json", "--max-tokens", "1"], "--max-tokens"),
        (["generate", "PKG", "x", "--max-new-tokens", "-1"], "--max-new-tokens"),
        (["generate", "PKG", "x", "--seed", "-5"], "--seed"),
        (["generate", "PKG", "x", "--bogus"], "unrecognized"),
        (["generate"], "required"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_every_bad_option_is_one_line_and_exit_1(package, tmp_path, args, mentions):
    named = {"OUT": str(tmp_path / "out")}
    args = [named.get(a, a.replace("PKG", str(package))) for a in args]
    command = args[0]  # the command's parser says it, unrecognized flags included
    assert_error(edgelm(*args), command, mentions)
    assert not (tmp_path / "out").exists()


def test_unsigned_folder_needs_no_verify(package, tmp_path):
    folder = copy_package(package, tmp_path, "genai")
    (folder / "edgelm.json").unlink()
    assert_error(edgelm("info", str(folder)), "info", "--no-verify")
    done = edgelm("info", str(folder), "--no-verify", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verified"] is False
    assert json.loads(edgelm("info", str(package), "--json").stdout)["verified"] is True


def shell(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)


def test_closed_stdout_prints_no_traceback(package):
    run = f"{sys.executable} -m edgelm generate {package} 'ROMEO:' --max-new-tokens 30 --provider cpu"
    done = shell(f"set -o pipefail; {run} | head -c1; echo; echo rc=${{PIPESTATUS[0]}}")
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert "rc=0" in done.stdout or "rc=141" in done.stdout, done.stdout
    done = shell(f"{run} >&-; echo rc=$?")
    assert "Traceback" not in done.stderr and "rc=1" in done.stdout, (done.stdout, done.stderr)
    assert "standard output is closed" in done.stderr


@pytest.mark.parametrize("delay", [0.3, 0.6, 1.0, 1.5])
def test_an_early_ctrl_c_prints_no_traceback(package, delay):
    """Ctrl-C while edgelm imports, parses or loads. (One in the interpreter's own start, before any
    edgelm code runs, is Python's: "Fatal Python error: init_import_site"; such a run is not counted.)"""
    import signal
    import time

    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgelm",
            "generate",
            str(package),
            "ROMEO:",
            "--max-new-tokens",
            "50",
            "--provider",
            "cpu",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)  # during interpreter start, imports or load
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    if "init_import_site" in stderr:
        pytest.skip("the signal came during the interpreter's own start, before edgelm's code")
    assert "Traceback" not in stderr, stderr
    assert process.returncode in (0, 130, -signal.SIGINT), (process.returncode, stderr)


def test_out_of_memory_is_one_line(package, tmp_path):
    folder = copy_package(package, tmp_path, "liar")
    edit_manifest(folder, lambda m: m["architecture"].update(context_length=10**9))
    done = edgelm("generate", str(folder), "ROMEO:", "--max-new-tokens", "100000000", "--no-verify")
    assert_error(done, "generate", "out of memory")
