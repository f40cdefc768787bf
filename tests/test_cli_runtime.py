"""The runtime's commands as a user runs them: `python -m edgelm generate | info | bench` in a subprocess,
checked against the library's own output, and bad input as one line on stderr with exit status 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import onnxruntime as ort
import pytest

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def edgelm(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "edgelm", *args], capture_output=True, text=True, encoding="utf-8", env=env, timeout=120
    )


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
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--max-new-tokens", "100"], "context length 64"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
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
