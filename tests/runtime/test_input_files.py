"""Input files as users get them wrong (runtime/files.py): text that is not UTF-8 and a FIFO, folder or device
where a file belongs are one-line errors that name the file and say what it is, through the CLI and the API."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import copy_package, quiet

from edgelm.cli import main
from edgelm.runtime import PackageError, load

REPO = Path(__file__).resolve().parents[2]

LATIN1 = "Café, naïve façade.\n".encode("latin-1")
UTF16 = "Hello, world.\n".encode("utf-16")  # with a byte-order mark, as Python and Windows editors write it
UTF16_NO_BOM = "Hello, world.\n".encode("utf-16-le")  # valid UTF-8, but full of NUL bytes
ENCODINGS = {"latin-1": (LATIN1, "not UTF-8 text: byte 0xe9"), "utf-16": (UTF16, "UTF-16 text")}
ENCODINGS["utf-16 without a BOM"] = (UTF16_NO_BOM, "holds NUL bytes")


def cli_error(capsys, *argv: str) -> str:
    """Run the CLI in this process; it must fail with one line on stderr, which is returned."""
    try:
        status = main(list(argv))
    except SystemExit as e:  # argparse's errors (a bad option value) exit from inside parse_args
        status = e.code
    assert status == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "codec can't decode" not in err, err
    return err


@pytest.fixture
def fifo(tmp_path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs FIFOs")
    path = tmp_path / "pipe.txt"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_text_files_that_are_not_utf8_name_the_file(package, tmp_path, capsys, encoding):
    data, says = ENCODINGS[encoding]
    text = tmp_path / "notes.txt"
    text.write_bytes(data)
    out = tmp_path / "out"
    err = cli_error(capsys, "quantize", str(package), str(out), "--mode", "static", "--calibration-text", str(text))
    assert f"calibration text {text}" in err and says in err
    err = cli_error(capsys, "quantize", str(package), str(out), "--mode", "dynamic", "--eval-text", str(text))
    assert f"eval text {text}" in err and says in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    err = cli_error(capsys, "eval", str(package), "--text", str(text))
    assert f"text file {text}" in err and says in err


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json", "merges.txt"])
def test_export_names_the_checkpoint_file_that_is_not_utf8(hf_checkpoint, tmp_path, capsys, name):
    folder = Path(shutil.copytree(hf_checkpoint, tmp_path / "ckpt"))
    (folder / name).write_bytes(UTF16 if name != "merges.txt" else LATIN1)
    err = cli_error(capsys, "export", str(folder), str(tmp_path / "out"))
    assert f"{folder / name} is" in err and ("UTF-16 text" in err or "not UTF-8" in err), err
    assert not (tmp_path / "out").exists()


def test_a_fifo_given_as_a_text_file_is_said_to_be_one_and_never_opened(package, fifo, tmp_path, capsys):
    from edgelm.quantize.evaluate import evaluate_package
    from edgelm.quantize.quantize import quantize_package

    err = cli_error(
        capsys, "quantize", str(package), str(tmp_path / "o"), "--mode", "static", "--calibration-text", str(fifo)
    )
    assert f"{fifo} is a FIFO (named pipe), not a regular file" in err
    err = cli_error(capsys, "eval", str(package), "--text", "/dev/null")
    assert "/dev/null is a character device, not a regular file" in err
    with pytest.raises(ValueError, match="calibration text .* is a FIFO"):
        quantize_package(package, tmp_path / "o", mode="static", calibration_text=fifo, progress=quiet)
    with pytest.raises(ValueError, match="eval text .* is a folder, not a regular file"):
        quantize_package(package, tmp_path / "o", mode="dynamic", eval_text=REPO / "data", progress=quiet)
    with pytest.raises(ValueError, match="text file .* is a FIFO"):
        evaluate_package(package, fifo)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        evaluate_package(package, tmp_path / "missing.txt")


def test_export_says_what_a_fifo_or_device_checkpoint_is(hf_checkpoint, fifo, tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    os.mkfifo(gguf)
    for given, says in ((gguf, "is a FIFO"), (fifo, "is a FIFO"), (Path("/dev/null"), "is a character device")):
        err = cli_error(capsys, "export", str(given), str(tmp_path / "out"))
        assert f"{given} {says}" in err, err
    err = cli_error(capsys, "export", str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    assert "does not exist" in err
    folder = Path(shutil.copytree(hf_checkpoint, tmp_path / "ckpt"))
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        moved = folder / name
        moved.rename(tmp_path / "aside")
        os.mkfifo(moved)
        err = cli_error(capsys, "export", str(folder), str(tmp_path / "out"))
        assert f"{moved} is a FIFO (named pipe), not a regular file" in err, err
        moved.unlink()
        (tmp_path / "aside").rename(moved)


def test_a_fifo_in_a_package_is_said_to_be_one(package, fifo, tmp_path):
    folder = copy_package(package, tmp_path, "pkg")
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")
    with pytest.raises(PackageError, match="tokenizer.json is a FIFO"):
        load(folder)


def test_package_messages_name_keys_the_file_has_and_where(package, tmp_path):
    import json

    folder = copy_package(package, tmp_path, "pkg")
    manifest = json.loads((folder / "edgelm.json").read_text())
    manifest["architecture"]["n_head"] = "four"
    (folder / "edgelm.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="edgelm.json architecture: n_head must be an integer"):
        load(folder)
    (folder / "edgelm.json").unlink()  # now a genai folder: its decoder has no head_size, a hidden_size too small
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"].pop("head_size", None)
    config["model"]["decoder"]["hidden_size"] = 2
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(
        PackageError, match=r"genai_config.json model.decoder: hidden_size must be an integer >= 4, got 2"
    ):
        load(folder, verify=False)
    config["model"]["decoder"]["num_attention_heads"] = 0
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(PackageError, match="genai_config.json model.decoder: num_attention_heads"):
        load(folder, verify=False)


def test_a_graph_that_disagrees_names_the_json_file_that_says_otherwise(package, tmp_path):
    import json

    folder = copy_package(package, tmp_path, "pkg")
    manifest = json.loads((folder / "edgelm.json").read_text())
    manifest["architecture"]["head_dim"] *= 2
    (folder / "edgelm.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=r"in model.onnx has shape .*; edgelm.json says \(batch, "):
        load(folder)
    (folder / "edgelm.json").unlink()
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["num_hidden_layers"] = 1000
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(PackageError, match="genai_config.json says 1000 layers, but model.onnx has only"):
        load(folder, verify=False)
