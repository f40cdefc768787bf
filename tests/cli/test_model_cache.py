"""A GGUF file or a Hugging Face model folder run directly (edgelm/cache.py): the first use exports it into the cache
once, even when two processes start at once; later uses load the cached package; `edgelm list` / `edgelm rm`,
$EDGELM_CACHE, --no-cache, a damaged entry, and the Python API (`edgelm.load`; `edgelm.runtime.load` refuses)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import quiet  # noqa: E402
from test_gguf import write_gguf  # noqa: E402

import edgelm  # noqa: E402
from edgelm.runtime import PackageError  # noqa: E402
from edgelm.runtime import load as runtime_load  # noqa: E402

EXPORTING = "exporting it once into the cache"
GENERATE = ("ROMEO:", "--max-new-tokens", "8", "--provider", "cpu", "--threads", "1", "--json")


def run(*args, cache: Path, **env) -> subprocess.CompletedProcess:
    """`python -m edgelm ARGS` with $EDGELM_CACHE set to `cache`."""
    environment = {**os.environ, "PYTHONIOENCODING": "utf-8", "EDGELM_CACHE": str(cache), **env}
    command = [sys.executable, "-m", "edgelm", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, encoding="utf-8", env=environment, timeout=300)


def one_error(done: subprocess.CompletedProcess, command: str, mentions: str) -> str:
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edgelm {command}: error:") and mentions in lines[0], done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf"), "llama", kinds=(Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.F16))


@pytest.fixture(scope="module")
def expected_ids(tiny_gguf, tmp_path_factory) -> list[int]:
    """The greedy ids of the package `edgelm export --plain-blocks` writes: what the cache holds."""
    from edgelm.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("direct") / "pkg"
    export_package(tiny_gguf, out, compact_blocks=False, progress=quiet)
    return runtime_load(out, provider="cpu", threads=1).generate("ROMEO:", 8).token_ids


@pytest.fixture(scope="module")
def first_runs(tiny_gguf, tmp_path_factory):
    """Two `edgelm generate tiny.gguf` started at once into an empty cache."""
    cache = tmp_path_factory.mktemp("cache")
    environment = {**os.environ, "PYTHONIOENCODING": "utf-8", "EDGELM_CACHE": str(cache)}
    command = [sys.executable, "-m", "edgelm", "generate", str(tiny_gguf), *GENERATE]
    children = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=300) for child in children]
    return cache, [(child.returncode, out, err) for child, (out, err) in zip(children, outputs, strict=True)]


def entries_of(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "packages").iterdir() if not p.name.startswith("."))


def test_two_first_runs_export_once_and_the_next_loads_from_the_cache(first_runs, tiny_gguf, expected_ids):
    cache, runs = first_runs
    for code, out, err in runs:
        assert code == 0 and "Traceback" not in err, err
        assert json.loads(out)["token_ids"] == expected_ids
    assert sum(EXPORTING in err for _, _, err in runs) == 1, [err for _, _, err in runs]
    (entry,) = entries_of(cache)  # one package; no staging folder left behind
    assert entry.name.startswith("tiny-llama-") and (entry / "edgelm.json").is_file()
    assert json.loads((entry / "edgelm.json").read_text())["recipe"]["storage"] == "plain"
    written = (entry / "edgelm.json").stat().st_mtime_ns

    done = run("generate", tiny_gguf, *GENERATE, cache=cache)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == expected_ids
    assert EXPORTING not in done.stderr and "[1/4]" not in done.stderr and done.stderr == ""
    assert (entry / "edgelm.json").stat().st_mtime_ns == written


def test_a_renamed_copy_loads_the_same_entry_and_an_edited_file_has_another_key(first_runs, tiny_gguf, tmp_path):
    from edgelm.cache import CACHE_EXPORT_OPTIONS, cache_key, source_sha256

    cache, _ = first_runs
    copy = Path(shutil.copy(tiny_gguf, tmp_path / "renamed.gguf"))
    done = run("info", copy, "--json", cache=cache)
    assert done.returncode == 0 and EXPORTING not in done.stderr, done.stderr
    assert json.loads(done.stdout)["package"] == str(entries_of(cache)[0])
    key = lambda: cache_key(source_sha256(copy, cache=tmp_path / "memo"), CACHE_EXPORT_OPTIONS)
    assert entries_of(cache)[0].name.endswith("-" + key())
    stat = copy.stat()
    with open(copy, "r+b") as f:  # one byte of the last tensor's data: same size, other content
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the remembered hash is keyed by mtime too
    assert not entries_of(cache)[0].name.endswith("-" + key())


def test_list_and_rm(first_runs, tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(first_runs[0], cache)
    (entry,) = entries_of(cache)
    listed = run("list", cache=cache)
    assert listed.returncode == 0 and listed.stdout.startswith(entry.name + "  "), listed
    assert "from tiny-llama.gguf" in listed.stdout and str(cache / "packages") in listed.stderr
    data = json.loads(run("list", "--json", cache=cache).stdout)
    assert data["cache"] == str(cache / "packages")
    assert [(p["name"], p["source"]) for p in data["packages"]] == [(entry.name, "tiny-llama.gguf")]

    one_error(run("rm", cache=cache), "rm", "--all")
    one_error(run("rm", "no-such-entry", cache=cache), "rm", "no cached package 'no-such-entry'")
    one_error(run("rm", "../packages", cache=cache), "rm", "no cached package")
    done = run("rm", tiny_gguf, cache=cache)  # by the file it was exported from
    assert done.returncode == 0 and f"removed {entry}" in done.stderr, done.stderr
    assert entries_of(cache) == [] and json.loads(run("list", "--json", cache=cache).stdout)["packages"] == []

    shutil.copytree(first_runs[0] / "packages" / entry.name, entry)
    assert run("rm", entry.name, cache=cache).returncode == 0 and entries_of(cache) == []
    shutil.copytree(first_runs[0] / "packages" / entry.name, entry)
    assert run("rm", "--all", cache=cache).returncode == 0 and entries_of(cache) == []


def test_no_cache_exports_to_a_temporary_folder_removed_at_exit(tiny_gguf, expected_ids, tmp_path):
    cache, temporary = tmp_path / "cache", tmp_path / "tmp"
    temporary.mkdir()
    done = run("generate", tiny_gguf, *GENERATE, "--no-cache", cache=cache, TMPDIR=str(temporary))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == expected_ids
    assert "exporting it to a temporary package" in done.stderr
    assert not cache.exists() and [p for p in temporary.iterdir() if p.name.startswith("edgelm-")] == []


def test_a_damaged_entry_says_how_to_remove_it(first_runs, tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(first_runs[0], cache)
    (entry,) = entries_of(cache)
    (entry / "tokenizer.json").write_text("{}")
    line = one_error(run("generate", tiny_gguf, *GENERATE, cache=cache), "generate", f"`edgelm rm {entry.name}`")
    assert "tokenizer.json" in line


def test_a_model_folder_runs_directly(hf_checkpoint, model, tmp_path):
    done = run("generate", hf_checkpoint, *GENERATE, cache=tmp_path / "cache")
    assert done.returncode == 0 and "is a Hugging Face model folder: exporting it once" in done.stderr, done.stderr
    assert json.loads(done.stdout)["token_ids"] == model.generate("ROMEO:", 8).token_ids


def test_python_api(first_runs, tiny_gguf, hf_checkpoint, expected_ids, monkeypatch):
    monkeypatch.setenv("EDGELM_CACHE", str(first_runs[0]))
    lines = []
    loaded = edgelm.load(tiny_gguf, provider="cpu", threads=1, progress=lines.append)
    assert lines == [] and loaded.origin.how == "cached"
    assert loaded.generate("ROMEO:", 8).token_ids == expected_ids
    assert edgelm.load(loaded.spec.folder, provider="cpu").origin.how == "package"
    for source, kind in ((tiny_gguf, "a GGUF file"), (hf_checkpoint, "a Hugging Face model folder")):
        with pytest.raises(PackageError, match=f"is {kind}, not a package: load it with edgelm.load") as caught:
            runtime_load(source, provider="cpu")
        assert "\n" not in str(caught.value) and f"`edgelm export {source} OUT`" in str(caught.value)


def test_rm_of_a_linked_entry_removes_the_link_not_its_target(tmp_path, monkeypatch):
    """An entry that is a symlink to a folder elsewhere: `edgelm rm` unlinks it (no hidden leftover in the cache)
    and the folder it points at is kept whole."""
    from edgelm import cache

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "edgelm.json").write_text("{}")
    (tmp_path / "cache" / "packages").mkdir(parents=True)
    (tmp_path / "cache" / "packages" / "linked").symlink_to(elsewhere)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    assert [entry.name for entry in cache.entries()] == ["linked"]
    cache.remove("linked")
    assert list((tmp_path / "cache" / "packages").iterdir()) == []
    assert sorted(p.name for p in elsewhere.iterdir()) == ["edgelm.json"]


# ---- round 5: an entry is trusted by what it holds, not its name, and is removable whatever its state ----------


def _source_sha256(entry: Path) -> str:
    return json.loads((entry / "edgelm.json").read_text())["source"]["sha256"]


@pytest.mark.parametrize("how", ["linked", "copied", "manifest-linked"])
def test_an_entry_holding_another_models_package_is_replaced_not_run(
    first_runs, tiny_gguf, expected_ids, package, tmp_path, how
):
    """An entry folder replaced by a symlink to, or a copy of, another model's package (here the GPT-2 test
    package), or whose manifest is a link to another's: resolving the GGUF file exports it again, and loads that."""
    from edgelm.cache import resolve

    cache = tmp_path / "cache"
    shutil.copytree(first_runs[0], cache)
    (entry,) = entries_of(cache)
    own = _source_sha256(entry)
    other = tmp_path / "other"
    shutil.copytree(package, other)
    shutil.rmtree(entry)
    if how == "linked":
        entry.symlink_to(other, target_is_directory=True)
    elif how == "copied":
        shutil.copytree(other, entry)
    else:
        shutil.copytree(first_runs[0] / "packages" / entry.name, entry)
        (entry / "edgelm.json").unlink()
        (entry / "edgelm.json").symlink_to(other / "edgelm.json")
    lines = []
    os.environ["EDGELM_CACHE"], saved = str(cache), os.environ.get("EDGELM_CACHE")
    try:
        resolved = resolve(tiny_gguf, progress=lines.append)
    finally:
        os.environ.pop("EDGELM_CACHE") if saved is None else os.environ.__setitem__("EDGELM_CACHE", saved)
    assert resolved.how == "exported" and resolved.path == entry and not entry.is_symlink()
    assert _source_sha256(entry) == own and not (entry / "edgelm.json").is_symlink()
    assert any("is not a package exported from" in line for line in lines), lines
    assert sorted(p.name for p in other.iterdir()) == sorted(p.name for p in package.iterdir())  # target kept
    assert runtime_load(entry, provider="cpu", threads=1).generate("ROMEO:", 8).token_ids == expected_ids


def test_an_entry_missing_its_manifest_is_removable_and_later_runs_recover(
    first_runs, tiny_gguf, expected_ids, tmp_path
):
    cache = tmp_path / "cache"
    shutil.copytree(first_runs[0], cache)
    (entry,) = entries_of(cache)
    (entry / "edgelm.json").unlink()  # an export or a removal cut short, or a hand edit
    listed = json.loads(run("list", "--json", cache=cache).stdout)["packages"]
    assert [(p["name"], p["precision"]) for p in listed] == [(entry.name, "incomplete")]
    done = run("rm", entry.name, cache=cache)
    assert done.returncode == 0 and f"removed {entry}" in done.stderr and entries_of(cache) == [], done.stderr

    shutil.copytree(first_runs[0] / "packages" / entry.name, entry)
    (entry / "edgelm.json").unlink()
    assert run("rm", "--all", cache=cache).returncode == 0 and entries_of(cache) == []

    shutil.copytree(first_runs[0] / "packages" / entry.name, entry)
    (entry / "edgelm.json").unlink()
    done = run("generate", tiny_gguf, *GENERATE, cache=cache)  # not stuck: exported again
    assert done.returncode == 0 and EXPORTING in done.stderr, done.stderr
    assert json.loads(done.stdout)["token_ids"] == expected_ids
    assert (entry / "edgelm.json").is_file()
    assert run("rm", tiny_gguf, cache=cache).returncode == 0 and entries_of(cache) == []


@pytest.mark.parametrize("how", ["file", "dangling", "read-only"])
def test_an_unusable_cache_folder_is_named_with_its_variable(tiny_gguf, tmp_path, how):
    cache = tmp_path / "cache"
    if how == "file":
        cache.write_text("not a folder")
    elif how == "dangling":
        cache.symlink_to(tmp_path / "gone")
        (tmp_path / "gone").mkdir()
        (tmp_path / "gone" / "packages").symlink_to(tmp_path / "nowhere")
    else:
        cache.mkdir()
        (cache / "packages").mkdir()
        (cache / "packages").chmod(0o500)
    try:
        if how == "read-only" and os.access(cache / "packages", os.W_OK):
            pytest.skip("running as a user that can write anywhere (root)")
        line = one_error(run("generate", tiny_gguf, *GENERATE, cache=cache), "generate", "$EDGELM_CACHE")
        assert str(cache / "packages") in line
    finally:
        if how == "read-only":
            (cache / "packages").chmod(0o700)


def test_a_damaged_hash_record_is_hashed_again(tiny_gguf, tmp_path):
    from edgelm.cache import source_sha256
    from edgelm.runtime.package import file_sha256

    memo = tmp_path / "cache"
    digest = source_sha256(tiny_gguf, cache=memo)
    (record,) = (memo / ".hashes").iterdir()
    for damage in ("[" * 100_000 + "]" * 100_000, '{"sha256": NaN}', "\xff"):
        record.write_text(damage, encoding="utf-8", errors="surrogateescape")
        assert source_sha256(tiny_gguf, cache=memo) == digest == file_sha256(tiny_gguf)
