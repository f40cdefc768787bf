"""Output safety by file identity (writers/package_writer.py): a bind mount, a symlinked parent or a hard link is the
same file as its input whatever the path says; a run killed with SIGKILL leaves a staging folder that the next
run into the same folder removes (never a live writer's); a 255-character output name can be written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import quiet
from test_outputs import snapshot, write_fake_package

from edgelm.runtime.contract import MANIFEST_FILE, MANIFEST_FORMAT
from edgelm.runtime.package import read_package
from edgelm.writers.package_writer import (
    OWNER_FILE,
    STAGING_PREFIX,
    StagedOutput,
    _owner,
    check_output,
    list_files,
    remove_stale_staging,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def bind_mount(source: Path, target: Path):
    """`mount --bind source target`, or skip the test where this process may not mount."""
    target.mkdir()
    try:
        done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, text=True)
    except OSError as e:  # no mount command at all
        pytest.skip(f"mount --bind is not available here: {e}")
    if done.returncode != 0:
        pytest.skip(f"mount --bind is not permitted here: {done.stderr.strip() or done.returncode}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_quantize_through_a_bind_mount_never_replaces_its_own_input(package, tmp_path, monkeypatch):
    """The issue's case: `quantize IN OUT --overwrite` where OUT is IN seen through a bind mount of a parent."""
    from edgelm.quantize import quantize as quantize_module

    real = tmp_path / "real"
    fp32 = Path(shutil.copytree(package, real / "fp32"))
    before = snapshot(real)
    monkeypatch.setattr(quantize_module, "read_package", lambda *a, **k: pytest.fail("work started"))
    with bind_mount(real, tmp_path / "bind") as bind:
        assert (bind / "fp32" / "edgelm.json").is_file() and str(bind / "fp32") != str(fp32)
        cases = {bind / "fp32": "must differ", bind: "contains the input", bind / "fp32" / "int8": "lies inside"}
        for out, says in cases.items():
            with pytest.raises(ValueError, match=f"{says}.*another path"):
                quantize_module.quantize_package(fp32, out, mode="dynamic", overwrite=True, progress=quiet)
        # and the other way round: the input given through the mount, the output by its real path
        with pytest.raises(ValueError, match="must differ"):
            check_output(fp32, inputs=[bind / "fp32"], overwrite=True)
        # export alike: over the folder holding its checkpoint, seen through the mount
        from edgelm.export import onnx_export

        monkeypatch.setattr(onnx_export, "open_source", lambda *a, **k: pytest.fail("work started"))
        with pytest.raises(ValueError, match="contains the input.*another path"):
            onnx_export.export_package(fp32, bind, overwrite=True, progress=quiet)
    assert snapshot(real) == before
    assert read_package(fp32).precision == "fp32"


def test_a_symlinked_parent_or_dotted_spelling_is_the_same_folder(tmp_path):
    source = tmp_path / "real" / "fp32"
    write_fake_package(source, b"input")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for out in (tmp_path / "link" / "fp32", tmp_path / "real" / ".." / "link" / "fp32" / "." / "sub"):
        with pytest.raises(ValueError, match="must differ|lies inside"):
            check_output(out, inputs=[source], overwrite=True)
    with pytest.raises(ValueError, match="contains the input"):
        check_output(tmp_path / "link" / ".." / "real", inputs=[source], overwrite=True)


def test_an_old_package_holding_a_hard_link_to_an_input_is_refused(tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("some calibration text")
    out = tmp_path / "out"  # an old package whose tokenizer.json is the calibration text's other name
    out.mkdir()
    (out / "model.onnx").write_bytes(b"old")
    os.link(text, out / "tokenizer.json")
    write_json(out / MANIFEST_FILE, {"format": MANIFEST_FORMAT, "files": list_files(out)})
    with pytest.raises(ValueError, match="hard link to the input"):
        check_output(out, inputs=[tmp_path / "pkg", text], overwrite=True)
    check_output(out, inputs=[tmp_path / "pkg"], overwrite=True)  # without that input it is an ordinary package


def write_owner(folder: Path, **owner) -> Path:
    folder.mkdir()
    (folder / OWNER_FILE).write_text(json.dumps(owner))
    (folder / "package").mkdir()
    (folder / "package" / "model.onnx.data").write_bytes(b"\x00" * 1024)
    return folder


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_staging_folders_are_removed_and_only_those(tmp_path):
    host = socket.gethostname()
    me = {"pid": os.getpid(), "host": host}
    started = _owner("pkg")["started"]
    dead = write_owner(tmp_path / f"{STAGING_PREFIX}dead0001", pid=dead_pid(), host=host, started=1)
    reused = write_owner(tmp_path / f"{STAGING_PREFIX}reused01", **me, started=(started or 0) + 12345)
    kept = {
        "live": write_owner(tmp_path / f"{STAGING_PREFIX}live0001", **me, started=started),
        "other host": write_owner(tmp_path / f"{STAGING_PREFIX}remote01", pid=dead_pid(), host=host + "-x", started=1),
        "garbled": write_owner(tmp_path / f"{STAGING_PREFIX}garbled1", pid="1; rm -rf /", host=host),
        "pid 0": write_owner(tmp_path / f"{STAGING_PREFIX}zero0001", pid=0, host=host, started=1),
        "huge pid": write_owner(tmp_path / f"{STAGING_PREFIX}huge0001", pid=2**70, host=host, started=1),
        "no record": tmp_path / f"{STAGING_PREFIX}norecord",
        "not ours": write_owner(tmp_path / "mine-not-edgelm", pid=dead_pid(), host=host, started=1),
    }
    kept["no record"].mkdir()
    (tmp_path / f"{STAGING_PREFIX}symlink1").symlink_to(dead)
    with StagedOutput(tmp_path / "pkg") as staging:
        write_fake_package(staging, b"new")
    assert not dead.exists() and not reused.exists()
    for why, folder in kept.items():
        assert folder.is_dir(), why
    assert (tmp_path / f"{STAGING_PREFIX}symlink1").is_symlink()
    assert (tmp_path / "pkg" / "model.onnx").read_bytes() == b"new"
    assert remove_stale_staging(tmp_path) == []


def test_a_run_killed_between_its_two_renames_gets_its_old_package_back(tmp_path):
    """Where renameat2 cannot swap, the old package is moved into the staging folder first: a run killed then
    leaves no output, and the next run puts the old package back instead of deleting the only copy."""
    host = socket.gethostname()
    killed = write_owner(tmp_path / f"{STAGING_PREFIX}killed01", pid=dead_pid(), host=host, started=1, output="pkg")
    write_fake_package(killed / "old", b"the only copy")
    done = write_owner(tmp_path / f"{STAGING_PREFIX}killed02", pid=dead_pid(), host=host, started=1, output="new")
    write_fake_package(done / "old", b"replaced")
    write_fake_package(tmp_path / "new", b"in place")  # killed after the second rename: the new one is there
    assert sorted(remove_stale_staging(tmp_path)) == [killed.name, done.name]
    assert (tmp_path / "pkg" / "model.onnx").read_bytes() == b"the only copy"
    assert (tmp_path / "new" / "model.onnx").read_bytes() == b"in place"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "pkg"]


def test_kill_9_during_quantize_leaves_a_folder_the_next_run_removes(package, tmp_path):
    """A real quantize killed with SIGKILL mid-write: no handler runs, the staging folder stays; the next
    run writing beside it removes it, and a live writer's folder beside it survives that run."""
    command = [sys.executable, "-m", "edgelm", "quantize", str(package), str(tmp_path / "int8"), "--mode", "dynamic"]
    command += ["--eval-text", str(REPO / "data" / "shakespeare-heldout.txt")]  # seconds of work after the files
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.monotonic() + 120
    staged: list[Path] = []
    while process.poll() is None and time.monotonic() < deadline and not staged:
        staged = [p for p in tmp_path.glob(f"{STAGING_PREFIX}*/package/{MANIFEST_FILE}") if p.is_file()]
        time.sleep(0.005)
    assert staged, f"quantize ended before it wrote a file: {process.stderr.read() if process.stderr else ''}"
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]
    assert len(left) == 1 and (left[0] / OWNER_FILE).is_file()
    assert not (tmp_path / "int8").exists()

    with StagedOutput(tmp_path / "other") as live:  # a concurrent writer still at work
        with StagedOutput(tmp_path / "int8") as staging:
            write_fake_package(staging, b"rerun")
        assert not left[0].exists()
        assert live.is_dir()
        write_fake_package(live, b"other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8", "other"]


def test_an_output_name_of_255_characters_can_be_written(package, tmp_path):
    from edgelm.quantize.quantize import quantize_package

    out = tmp_path / ("q" * 255)
    quantize_package(package, out, mode="dynamic", evaluate=False, progress=quiet)
    assert read_package(out).precision == "int8-dynamic"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    with pytest.raises(ValueError, match="cannot be used: File name too long"):  # one more is the system's limit
        check_output(tmp_path / ("q" * 256))


def test_overwriting_without_an_atomic_swap_leaves_no_staging_folder(tmp_path, monkeypatch):
    from edgelm.writers import package_writer as outputs

    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)  # a file system without RENAME_EXCHANGE
    write_fake_package(tmp_path / "pkg", b"old")
    with StagedOutput(tmp_path / "pkg", overwrite=True) as staging:
        write_fake_package(staging, b"new")
    assert (tmp_path / "pkg" / "model.onnx").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]
