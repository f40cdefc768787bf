"""Reading a model package: the contract between export, quantize and the runtime.

Three kinds of folder load:

1. an edgelm package: `edgelm.json` (the manifest) names the model file, the I/O names, the
   architecture, the special tokens, the precision and the sha256 of every file; each file is
   checked against it before ONNX Runtime sees anything;
2. an onnxruntime-genai folder: `genai_config.json` (model.decoder.* gives the same facts);
3. an Optimum export of GPT-2: `model.onnx` + Hugging Face `config.json`.

Everything the runtime needs comes from these JSON files; nothing is guessed from names. Every path
a JSON file names must resolve inside the package folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import PackageError, PackageNotFoundError

MANIFEST_FILE = "edgelm.json"
MANIFEST_FORMAT = "edgelm-package"
MANIFEST_VERSION = 1
GENAI_CONFIG_FILE = "genai_config.json"
HF_CONFIG_FILE = "config.json"


@dataclass
class PackageSpec:
    """What the runtime knows about a package, whichever kind of folder it came from."""

    folder: Path
    kind: str  # "edgelm", "genai" or "optimum"
    model_path: Path
    vocab_size: int
    context_length: int
    n_layer: int
    n_head: int
    head_dim: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int
    tokenizer_path: Path | None
    precision: str = "fp32"
    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask"
    position_ids: str | None = "position_ids"
    logits: str = "logits"
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    manifest: dict = field(default_factory=dict)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackageError(f"{path.name} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PackageError(f"{path.name} is not a JSON object")
    return data


def inside(folder: Path, name: object, what: str) -> Path:
    """Resolve a file name taken from package JSON; refuse anything that leaves the folder."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise PackageError(f"{what} must be a file name, got {name!r}")
    if os.path.isabs(name):
        raise PackageError(f"{what} {name!r} is an absolute path; package files must be inside the package folder")
    root = folder.resolve()
    path = (folder / name).resolve()
    if path != root and root not in path.parents:
        raise PackageError(f"{what} {name!r} resolves outside the package folder")
    return path


def _int(data: dict, key: str, where: str, *, minimum: int = 0) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PackageError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _token_list(value: object, where: str) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise PackageError(f"{where}: eos token id(s) must be non-negative integers, got {value!r}")
    return ids


def _tokenizer(folder: Path) -> Path | None:
    path = folder / "tokenizer.json"
    return inside(folder, "tokenizer.json", "tokenizer") if path.is_file() else None


def _from_manifest(folder: Path, manifest: dict) -> PackageSpec:
    if manifest.get("format") != MANIFEST_FORMAT:
        raise PackageError(f"{MANIFEST_FILE}: format is {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    version = manifest.get("format_version")
    if version != MANIFEST_VERSION:
        raise PackageError(
            f"{MANIFEST_FILE}: format_version {version!r} is not supported (this runtime reads "
            f"{MANIFEST_VERSION}); upgrade edgelm or re-export the package"
        )
    arch, io, tok = manifest.get("architecture"), manifest.get("io"), manifest.get("tokenizer")
    if not all(isinstance(x, dict) for x in (arch, io, tok)):
        raise PackageError(f"{MANIFEST_FILE}: architecture, io and tokenizer must be objects")
    if arch.get("type") != "gpt2":
        raise PackageError(f"{MANIFEST_FILE}: unknown architecture {arch.get('type')!r} (this runtime runs 'gpt2')")
    where = MANIFEST_FILE
    tokenizer_file = tok.get("file")
    pad = tok.get("pad_token_id")
    eos = _token_list(tok.get("eos_token_ids"), where)
    bos = tok.get("bos_token_id")
    return PackageSpec(
        folder=folder,
        kind="edgelm",
        model_path=inside(folder, manifest.get("model_file"), "model_file"),
        vocab_size=_int(arch, "vocab_size", where, minimum=1),
        context_length=_int(arch, "context_length", where, minimum=1),
        n_layer=_int(arch, "n_layer", where, minimum=1),
        n_head=_int(arch, "n_head", where, minimum=1),
        head_dim=_int(arch, "head_dim", where, minimum=1),
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        pad_token_id=pad if isinstance(pad, int) else eos[0],
        tokenizer_path=inside(folder, tokenizer_file, "tokenizer file") if tokenizer_file else None,
        precision=str(manifest.get("precision", "fp32")),
        past_key=str(io.get("past_key", "past_key_values.%d.key")),
        past_value=str(io.get("past_value", "past_key_values.%d.value")),
        present_key=str(io.get("present_key", "present.%d.key")),
        present_value=str(io.get("present_value", "present.%d.value")),
        manifest=manifest,
    )


def _from_genai(folder: Path, config: dict) -> PackageSpec:
    where = GENAI_CONFIG_FILE
    model = config.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise PackageError(f"{where}: model.decoder is missing")
    inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
    head_dim = decoder.get("head_size") or (
        decoder.get("hidden_size", 0) // max(1, decoder.get("num_attention_heads", 1))
    )
    eos = _token_list(model.get("eos_token_id"), where)
    pad = model.get("pad_token_id")
    bos = model.get("bos_token_id")
    return PackageSpec(
        folder=folder,
        kind="genai",
        model_path=inside(folder, decoder.get("filename"), "decoder filename"),
        vocab_size=_int(model, "vocab_size", where, minimum=1),
        context_length=_int(model, "context_length", where, minimum=1),
        n_layer=_int(decoder, "num_hidden_layers", where, minimum=1),
        n_head=_int(decoder, "num_attention_heads", where, minimum=1),
        head_dim=_int({"head_size": head_dim}, "head_size", where, minimum=1),
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        pad_token_id=pad if isinstance(pad, int) else eos[0],
        tokenizer_path=_tokenizer(folder),
        input_ids=inputs.get("input_ids", "input_ids"),
        attention_mask=inputs.get("attention_mask", "attention_mask"),
        position_ids=inputs.get("position_ids", "position_ids"),
        logits=outputs.get("logits", "logits"),
        past_key=inputs.get("past_key_names", "past_key_values.%d.key"),
        past_value=inputs.get("past_value_names", "past_key_values.%d.value"),
        present_key=outputs.get("present_key_names", "present.%d.key"),
        present_value=outputs.get("present_value_names", "present.%d.value"),
    )


def _from_hf_config(folder: Path, config: dict) -> PackageSpec:
    where = HF_CONFIG_FILE
    if config.get("model_type") != "gpt2":
        raise PackageError(f"{where}: unknown model_type {config.get('model_type')!r} (this runtime runs 'gpt2')")
    n_embd, n_head = _int(config, "n_embd", where, minimum=1), _int(config, "n_head", where, minimum=1)
    eos = _token_list(config.get("eos_token_id", 50256), where)
    pad = config.get("pad_token_id")
    bos = config.get("bos_token_id")
    return PackageSpec(
        folder=folder,
        kind="optimum",
        model_path=inside(folder, "model.onnx", "model file"),
        vocab_size=_int(config, "vocab_size", where, minimum=1),
        context_length=_int(config, "n_positions", where, minimum=1),
        n_layer=_int(config, "n_layer", where, minimum=1),
        n_head=n_head,
        head_dim=n_embd // n_head,
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        pad_token_id=pad if isinstance(pad, int) else eos[0],
        tokenizer_path=_tokenizer(folder),
    )


def verify_files(folder: Path, manifest: dict) -> None:
    """Check every file the manifest lists against its size and sha256."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise PackageError(f"{MANIFEST_FILE}: 'files' must list the package's files with their sha256")
    for name, entry in files.items():
        path = inside(folder, name, "listed file")
        if not path.is_file():
            raise PackageNotFoundError(f"package file {name} is missing from {folder}")
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            raise PackageError(f"{MANIFEST_FILE}: entry for {name} lacks a sha256")
        size = path.stat().st_size
        if isinstance(entry.get("bytes"), int) and size != entry["bytes"]:
            raise PackageError(
                f"package file {name} is {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)"
            )
        if file_sha256(path) != entry["sha256"]:
            raise PackageError(
                f"package file {name} does not match its sha256 in {MANIFEST_FILE} (corrupt or tampered)"
            )


def read_package(path: str | Path, *, verify: bool = True) -> PackageSpec:
    """Read a package folder's JSON; with verify, check file hashes first (edgelm packages)."""
    folder = Path(path)
    if not folder.exists():
        raise PackageNotFoundError(f"package folder {folder} does not exist")
    if not folder.is_dir():
        raise PackageError(f"{folder} is not a folder (a package is a folder holding model.onnx and its JSON)")
    if (folder / MANIFEST_FILE).is_file():
        manifest = _read_json(folder / MANIFEST_FILE)
        if verify:
            verify_files(folder, manifest)
        spec = _from_manifest(folder, manifest)
    elif (folder / GENAI_CONFIG_FILE).is_file():
        spec = _from_genai(folder, _read_json(folder / GENAI_CONFIG_FILE))
    elif (folder / HF_CONFIG_FILE).is_file() and (folder / "model.onnx").is_file():
        spec = _from_hf_config(folder, _read_json(folder / HF_CONFIG_FILE))
    else:
        raise PackageError(
            f"{folder} is not a model package: it has no {MANIFEST_FILE}, no {GENAI_CONFIG_FILE}, "
            f"and no {HF_CONFIG_FILE} + model.onnx"
        )
    if not spec.model_path.is_file():
        raise PackageNotFoundError(f"model file {spec.model_path.name} is missing from {folder}")
    for token in [*spec.eos_token_ids, spec.pad_token_id]:
        if token >= spec.vocab_size:
            raise PackageError(f"special token id {token} is outside the vocabulary (size {spec.vocab_size})")
    return spec


def list_files(folder: Path) -> dict:
    """The manifest's "files" entry for a folder: sha256 and size of every file but the manifest."""
    return {
        p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }


class StagedPackage:
    """Write a package into a temporary folder beside `out_dir` and rename it into place only when
    the block succeeds: an interrupted or failed run leaves nothing that looks like a package.

        with StagedPackage(out_dir, overwrite=False) as staging:
            ... write files into staging ...
    """

    def __init__(self, out_dir: str | Path, *, overwrite: bool = False):
        import tempfile

        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite:
            raise FileExistsError(f"{self.out_dir} already exists (use --overwrite / overwrite=True to replace it)")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.partial-", dir=self.out_dir.parent))

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        import shutil

        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        self.path.chmod(0o755)  # mkdtemp makes it private; a package is an ordinary folder
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        self.path.rename(self.out_dir)
