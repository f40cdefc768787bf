"""Writing packages never loses anything (writers/package_writer.py): random layouts of an input, an output and
bystander files, with and without overwrite, and failures at any point, checked with hypothesis; then
export and quantize refusing unsafe outputs before any work, and SIGTERM in the middle of both."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from helpers import quiet
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgelm.runtime.contract import MANIFEST_FILE, MANIFEST_FORMAT
from edgelm.runtime.package import read_package
from edgelm.writers.package_writer import STAGING_PREFIX, StagedOutput, check_output, list_files, write_json

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "data" / "shakespeare-heldout.txt"


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root: a file's sha256, 'dir', or 'link -> target'."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                out[key] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                out[key] = "dir"
            else:
                out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def under(snap: dict[str, str], prefix: str) -> dict[str, str]:
    return {k: v for k, v in snap.items() if k == prefix or k.startswith(prefix + "/")}


def write_fake_package(folder: Path, payload: bytes, *, extra: bool = False) -> None:
    """A folder that is an edgelm package by its manifest (model bytes + a manifest listing them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(payload)
    (folder / "tokenizer.json").write_text('{"fake": true}')
    listed = {k: v for k, v in list_files(folder).items() if k in ("model.onnx", "tokenizer.json")}  # not a user's
    write_json(folder / MANIFEST_FILE, {"format": MANIFEST_FORMAT, "files": listed})
    if extra:
        (folder / "notes.txt").write_text("the user's own notes")


def is_complete_package(folder: Path, payload: bytes) -> bool:
    import json

    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    present = list_files(folder)
    listed_intact = all(present.get(name) == entry for name, entry in manifest["files"].items())
    return (folder / "model.onnx").read_bytes() == payload and listed_intact


@contextmanager
def working_directory(path: Path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


OUTPUTS = [
    "new",  # a path that does not exist
    "new-nested",  # inside folders that do not exist yet
    "input",  # the input itself
    "input-parent",  # contains the input
    "inside-input",  # a folder inside the input
    "cwd",
    "cwd-parent",
    "file",
    "symlink-to-package",
    "dangling-symlink",
    "empty-folder",
    "foreign-folder",  # a folder of the user's files
    "old-package",
    "old-package-with-extra",  # a package the user added a file to
]


@settings(
    max_examples=150,
    deadline=timedelta(seconds=5),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    output=st.sampled_from(OUTPUTS),
    overwrite=st.booleans(),
    fail_at=st.sampled_from([None, "during", "after-files"]),
    bystanders=st.lists(st.sampled_from(["", "a", "a/b", "in", "in/sub", "pkg"]), max_size=4),
    payload=st.binary(min_size=1, max_size=64),
)
@example(output="old-package", overwrite=True, fail_at=None, bystanders=["pkg"], payload=b"x")  # a user's file in it
def test_writing_an_output_never_loses_anything(output, overwrite, fail_at, bystanders, payload):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = root / "in"
        (source / "sub").mkdir(parents=True)
        (source / "config.json").write_text('{"model_type": "gpt2"}')
        (source / "sub" / "weights.bin").write_bytes(b"\x00weights")
        (root / "a" / "b").mkdir(parents=True)
        old_payload = b"old package"
        for i, where in enumerate(bystanders):
            if where == "pkg" and output not in ("old-package", "old-package-with-extra"):
                continue
            folder = root / where
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"bystander-{i}.txt").write_bytes(f"keep me {i}".encode())
        cwd = root / "a" / "b"
        out = {
            "new": root / "pkg",
            "new-nested": root / "x" / "y" / "pkg",
            "input": source,
            "input-parent": root,
            "inside-input": source / "sub",
            "cwd": cwd,
            "cwd-parent": root / "a",
            "file": root / "pkg",
            "symlink-to-package": root / "pkg",
            "dangling-symlink": root / "pkg",
            "empty-folder": root / "pkg",
            "foreign-folder": root / "a",
            "old-package": root / "pkg",
            "old-package-with-extra": root / "pkg",
        }[output]
        if output == "file":
            out.write_text("a file the user owns")
        elif output == "symlink-to-package":
            write_fake_package(root / "real", old_payload)
            out.symlink_to(root / "real")
        elif output == "dangling-symlink":
            out.symlink_to(root / "nowhere")
        elif output == "empty-folder":
            out.mkdir()
        elif output.startswith("old-package"):
            write_fake_package(out, old_payload, extra=output.endswith("extra"))
        before = snapshot(root)
        package_before = out.is_dir() and not out.is_symlink() and (out / MANIFEST_FILE).is_file()

        outcome = "written"
        with working_directory(cwd):
            try:
                with StagedOutput(out, inputs=[source], overwrite=overwrite) as staging:
                    if fail_at == "during":
                        raise RuntimeError("failed half-way")
                    write_fake_package(staging, payload)
                    if fail_at == "after-files":
                        raise RuntimeError("failed after writing")
            except (ValueError, FileExistsError):
                outcome = "refused"
            except RuntimeError:
                outcome = "failed"
        after = snapshot(root)

        # nothing hidden is left behind, whatever happened
        assert not [k for k in after if STAGING_PREFIX in k], after
        # the input and every bystander file are byte-identical
        for key, value in before.items():
            if key.startswith("in") or "bystander" in key or key.startswith("real"):
                assert after.get(key) == value, (key, outcome)
        # a user's file inside the old package (one its manifest does not list) makes it unsafe to replace
        safe = output in ("new", "new-nested", "empty-folder", "old-package") and not (
            output == "old-package" and "pkg" in bystanders
        )
        if outcome == "refused":
            assert after == before
            assert not safe or not overwrite and output in ("empty-folder", "old-package"), (output, overwrite)
        elif outcome == "failed":
            assert safe and (overwrite or output.startswith("new"))
            assert after == before  # the old package (or nothing) is still there, untouched
        else:
            assert safe and (overwrite or output.startswith("new")), (output, overwrite)
            assert is_complete_package(out, payload)
            assert sorted(p.name for p in out.iterdir()) == ["edgelm.json", "model.onnx", "tokenizer.json"]
            written = out.relative_to(root).as_posix()
            unchanged = {k: v for k, v in before.items() if not (k == written or k.startswith(written + "/"))}
            assert {k: after.get(k) for k in unchanged} == unchanged
        if package_before and outcome != "written":
            assert is_complete_package(out, old_payload)


def test_the_checks_name_the_problem(tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    cases = {
        source: "must differ",
        tmp_path: "contains the input",
        source / "x": "lies inside the input",
        Path.cwd(): "current directory",
        Path.cwd().parent: "current directory or a parent",
    }
    for out, says in cases.items():
        with pytest.raises(ValueError, match=says):
            check_output(out, inputs=[source], overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        check_output(tmp_path / "file", overwrite=True)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="symlink"):
        check_output(tmp_path / "link", overwrite=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match="not an edgelm package"):
        check_output(tmp_path / "mine", overwrite=True)


# ---- export and quantize: refused before any work, and SIGTERM half-way -----------------------------


def test_quantize_into_the_folder_holding_its_input_is_refused_before_any_work(package, tmp_path, monkeypatch):
    """The issue's data loss: `edgelm quantize fp32 . --mode dynamic --overwrite` emptied the folder."""
    from edgelm.quantize import quantize as quantize_module

    folder = tmp_path / "work"
    folder.mkdir()
    fp32 = Path(__import__("shutil").copytree(package, folder / "fp32"))
    (folder / "notes.txt").write_text("mine")
    before = snapshot(folder)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(quantize_module, "read_package", lambda *a, **k: pytest.fail("work started"))
    for out in (".", folder, fp32, fp32 / "int8", folder / "notes.txt"):
        with pytest.raises(ValueError):
            quantize_module.quantize_package(fp32, out, mode="dynamic", overwrite=True, progress=quiet)
    assert snapshot(folder) == before


def test_export_over_its_own_checkpoint_parent_is_refused(hf_checkpoint, tmp_path, monkeypatch):
    from edgelm.export import onnx_export

    monkeypatch.setattr(onnx_export, "open_source", lambda *a, **k: pytest.fail("work started"))
    for out in (hf_checkpoint, hf_checkpoint.parent, hf_checkpoint / "pkg"):
        with pytest.raises(ValueError):
            onnx_export.export_package(hf_checkpoint, out, overwrite=True, progress=quiet)


def run_and_terminate(command: list[str], parent: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """Start the command, send SIGTERM as soon as its staging folder appears in `parent`."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + timeout
    sent = False
    while process.poll() is None and time.monotonic() < deadline:
        if any(p.name.startswith(STAGING_PREFIX) for p in parent.iterdir()):
            time.sleep(0.01)  # inside the work: the model is being written (a tiny export takes ~0.2 s from here)
            process.send_signal(signal.SIGTERM)
            sent = True
            break
        time.sleep(0.005)
    stdout, stderr = process.communicate(timeout=timeout)
    assert sent, f"the command ended before SIGTERM could be sent: {stderr}"
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_sigterm_during_export_leaves_no_hidden_folder(hf_checkpoint, tmp_path):
    out = tmp_path / "pkg"
    done = run_and_terminate([sys.executable, "-m", "edgelm", "export", str(hf_checkpoint), str(out)], tmp_path)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sigterm_during_quantize_keeps_the_old_package(package, tmp_path):
    """Over an existing package with --overwrite: terminated half-way, the old package is intact."""
    import shutil

    out = Path(shutil.copytree(package, tmp_path / "out"))
    before = snapshot(out)
    command = [sys.executable, "-m", "edgelm", "quantize", str(package), str(out), "--mode", "dynamic"]
    done = run_and_terminate([*command, "--overwrite", "--eval-text", str(HELDOUT)], tmp_path)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "Traceback" not in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert snapshot(out) == before
    assert read_package(out).precision == "fp32"
