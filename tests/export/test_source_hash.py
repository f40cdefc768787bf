"""The manifest's source hash covers every file export reads: a sharded Llama folder's config, generation
config, index and every shard, its tokenizer files and chat template, each with its own sha256 in
`source.files`; a GGUF file's own sha256. Changing any one of them changes the recorded hash; a file export
does not read (a README, a pytorch_model.bin beside the safetensors) does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import quiet

from edgelm.export.checkpoint import combined_hash, source_files, source_hashes
from edgelm.export.onnx_export import export_package
from edgelm.runtime.package import file_sha256

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    from test_llama import make_hf_llama  # pytest puts tests/ on the path

    folder = tmp_path_factory.mktemp("sharded") / "src"
    folder.mkdir()
    make_hf_llama(folder, "Llama", dict(num_hidden_layers=2, vocab_size=2048), max_shard_size="400KB")
    shutil.copyfile(REPO / "models" / "shakespeare" / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return folder


def change_one_byte(path: Path) -> None:
    """A weights file: its last byte (a tensor's) flipped; a text file: a space added (still valid JSON)."""
    data = bytearray(path.read_bytes())
    if path.suffix == ".safetensors":
        data[-1] ^= 0x01
    else:
        data += b" "
    path.write_bytes(bytes(data))


def test_export_records_every_file_it_reads(sharded, tmp_path):
    manifest = export_package(sharded, tmp_path / "pkg", progress=quiet)
    shards = set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1
    expected = {"config.json", "generation_config.json", "model.safetensors.index.json", *shards}
    expected |= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    files = manifest["source"]["files"]
    assert set(files) == expected
    assert all(files[name] == file_sha256(sharded / name) for name in expected)
    assert manifest["source"]["sha256"] == combined_hash(source_hashes(sharded))


def test_changing_any_one_file_changes_the_hash(sharded, tmp_path):
    recorded = combined_hash(source_hashes(sharded))
    names = source_files(sharded)
    assert sum(name.startswith("model-") for name in names) > 1, "the shards are among the files"
    for name in names:
        copy = Path(shutil.copytree(sharded, tmp_path / name))
        change_one_byte(copy / name)
        assert combined_hash(source_hashes(copy)) != recorded, name
    copy = Path(shutil.copytree(sharded, tmp_path / "unread"))
    (copy / "README.md").write_text("not read by export")
    (copy / "pytorch_model.bin").write_bytes(b"not read: the safetensors index wins")
    assert combined_hash(source_hashes(copy)) == recorded


def test_gguf_source_is_the_file(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf import write_gguf

    path = write_gguf(tmp_path, "llama")
    manifest = export_package(path, tmp_path / "pkg", progress=quiet)
    assert manifest["source"]["files"] == {path.name: file_sha256(path)}
    assert manifest["source"]["sha256"] == file_sha256(path)
