"""Bad LoRA adapters are one-line errors (AdapterError; the CLI exits 1 with one line on stderr), and a model that
refused one still serves the base and the adapters it had: rank above the slots, a target without a slot, a shape
mismatch, another base's adapter, a tampered or truncated file, NaN weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from helpers import LORA_BASES, edgelm, quiet, save_lora_base, save_peft_adapter, save_random_model

from edgelm.export.lora import SlotSpec, convert_adapter
from edgelm.export.onnx_export import export_package
from edgelm.runtime import AdapterError, InvalidParameterError, load

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 99, 1200, 7, 640]
SLOTS = SlotSpec(["q_proj", "v_proj"], 8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-errors")
    hf = save_lora_base(root / "base", "llama")
    other = save_lora_base(root / "other-base", "llama", seed=5)
    export_package(root / "base", root / "pkg", lora_slots=SLOTS, progress=quiet)
    export_package(root / "other-base", root / "other-pkg", lora_slots=SLOTS, progress=quiet)
    save_peft_adapter(hf, root / "good", r=8, targets=["q_proj", "v_proj"])
    save_peft_adapter(other, root / "other-good", r=4, targets=["q_proj", "v_proj"])
    good = convert_adapter(root / "good", root / "pkg", root / "good.onnx_adapter")
    other_file = convert_adapter(root / "other-good", root / "other-pkg", root / "other.onnx_adapter")
    model = load(root / "pkg", provider="cpu", threads=1)
    model.load_adapter(good)
    expected = {name: model.generate(PROMPT, 8, ignore_eos=True, adapter=name).token_ids for name in (None, "good")}
    return {"root": root, "hf": hf, "model": model, "good": good, "other": other_file, "expected": expected}


def _still_serves(setup: dict) -> None:
    model = setup["model"]
    for name, ids in setup["expected"].items():
        assert model.generate(PROMPT, 8, ignore_eos=True, adapter=name).token_ids == ids
    assert model.adapters == ["good"]


def _nan_adapter(setup: dict, folder: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(setup["root"] / "good", folder)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    first = sorted(tensors)[0]
    tensors[first][0, 0] = np.nan
    save_file(tensors, str(weights))
    return folder


def test_convert_refuses_what_does_not_fit(setup, tmp_path):
    root, hf = setup["root"], setup["hf"]
    cases = {
        "rank above": (save_peft_adapter(hf, tmp_path / "r16", r=16, targets=["q_proj", "v_proj"]), "above"),
        "no slot": (save_peft_adapter(hf, tmp_path / "o", r=4, targets=["q_proj", "o_proj"]), "has no LoRA slot"),
    }
    small = save_random_model(tmp_path / "small", LORA_BASES["llama"][0], {**LORA_BASES["llama"][1], "hidden_size": 48})
    cases["shape"] = (save_peft_adapter(small, tmp_path / "shape", r=4, targets=["q_proj"]), "shape mismatch")
    cases["nan"] = (None, "NaN")
    folders = {"rank above": "r16", "no slot": "o", "shape": "shape", "nan": "nan"}
    _nan_adapter(setup, tmp_path / "nan")
    for case, (_, message) in cases.items():
        with pytest.raises(AdapterError, match=message):
            convert_adapter(tmp_path / folders[case], root / "pkg", tmp_path / f"{folders[case]}.onnx_adapter")
    with pytest.raises(AdapterError, match="NaN"):
        export_package(root / "base", tmp_path / "merged", lora=[(tmp_path / "nan", 1.0)], progress=quiet)
    with pytest.raises(AdapterError, match="shape mismatch"):
        export_package(root / "base", tmp_path / "merged", lora=[(tmp_path / "shape", 1.0)], progress=quiet)
    assert not (tmp_path / "merged").exists()


def test_load_refuses_bad_files_and_keeps_serving(setup, tmp_path):
    model = setup["model"]
    other = setup["other"]
    with pytest.raises(AdapterError, match="another base"):
        model.load_adapter(other)
    shutil.copy(other, tmp_path / "bare.onnx_adapter")  # no record beside it: its model_version still says
    with pytest.raises(AdapterError, match="another base"):
        model.load_adapter(tmp_path / "bare.onnx_adapter", verify=False)
    with pytest.raises(AdapterError, match="no bare.onnx_adapter.json"):
        model.load_adapter(tmp_path / "bare.onnx_adapter")
    data = bytearray(setup["good"].read_bytes())
    for name, content in {
        "tampered": data[:-40] + bytes([data[-40] ^ 1]) + data[-39:],
        "truncated": data[:200],
    }.items():
        path = tmp_path / f"{name}.onnx_adapter"
        path.write_bytes(bytes(content))
        shutil.copy(f"{setup['good']}.json", f"{path}.json")
        with pytest.raises(AdapterError, match="tampered or truncated"):
            model.load_adapter(path)
    with pytest.raises(AdapterError, match="not a readable"):
        model.load_adapter(tmp_path / "truncated.onnx_adapter", verify=False)
    _still_serves(setup)


def test_load_refuses_nan_and_wrong_shapes(setup, tmp_path):
    reader = ort.AdapterFormat.read_adapter(str(setup["good"]))
    arrays = {name: np.array(value.numpy(), copy=True) for name, value in reader.get_parameters().items()}
    name = sorted(arrays)[0]
    for case, change in {"NaN": lambda a: a.__setitem__((0, 0), np.nan), "shape mismatch": None}.items():
        changed = {key: value.copy() for key, value in arrays.items()}
        if change is None:
            changed[name] = np.zeros((changed[name].shape[0], 32), np.float32)  # 3 packed parts of rank 8 take 24
        else:
            change(changed[name])
        writer = ort.AdapterFormat()
        writer.set_adapter_version(1)
        writer.set_model_version(reader.get_model_version())
        writer.set_parameters({key: ort.OrtValue.ortvalue_from_numpy(value) for key, value in changed.items()})
        path = tmp_path / f"{case.split()[0]}.onnx_adapter"
        writer.export_adapter(str(path))
        with pytest.raises(AdapterError, match=case):
            setup["model"].load_adapter(path, verify=False)
    _still_serves(setup)


def test_api_errors(setup, tmp_path):
    with pytest.raises(InvalidParameterError, match="no adapter named 'nope'"):
        setup["model"].generate(PROMPT, 4, adapter="nope")
    with pytest.raises(InvalidParameterError, match="no adapter named"):
        setup["model"].conversation(template="{{ messages[0]['content'] }}", adapter="nope")
    export_package(setup["root"] / "base", tmp_path / "plain", progress=quiet)
    with pytest.raises(AdapterError, match="has no LoRA slots"):
        load(tmp_path / "plain", provider="cpu").load_adapter(setup["good"])
    with pytest.raises(AdapterError, match="has no LoRA slots"):
        convert_adapter(setup["root"] / "good", tmp_path / "plain", tmp_path / "x.onnx_adapter")
    _still_serves(setup)


def test_cli_errors_are_one_line(setup, tmp_path):
    root = setup["root"]
    save_peft_adapter(setup["hf"], tmp_path / "r16", r=16, targets=["q_proj"])
    for args in (
        ("adapter", "convert", tmp_path / "r16", root / "pkg", tmp_path / "x.onnx_adapter"),
        ("adapter", "convert", root / "good", root / "pkg", tmp_path / "x.bin"),
        ("generate", root / "pkg", "hi", "--adapter", setup["other"]),
        ("export", root / "base", tmp_path / "bad", "--lora-slots", "qq_proj:8"),
        ("export", root / "base", tmp_path / "bad", "--lora-slots", "q_proj"),
    ):
        done = edgelm(*args)
        assert done.returncode == 1, args
        assert len(done.stderr.strip().splitlines()) == 1 and "error:" in done.stderr, (args, done.stderr)


def _tree(folder: Path) -> dict:
    """Every entry under folder (symlinks not followed): its bytes, or where a symlink points."""
    return {
        str(p.relative_to(folder)): (f"-> {p.readlink()}" if p.is_symlink() else p.read_bytes() if p.is_file() else "")
        for p in sorted(folder.rglob("*"))
    }


def test_convert_writes_through_the_staged_writer(setup, tmp_path):
    """`adapter convert` writes OUT and OUT.json as export writes packages: never through a symlink, never over an
    existing file without --overwrite, never inside an input, no staging folder left; nothing changes on refusal."""
    root = setup["root"]
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    cases = {  # name: (prepare(out), message)
        "symlink OUT": (lambda out: out.symlink_to(victim), "symlink"),
        "dangling symlink OUT": (lambda out: out.symlink_to(tmp_path / "nowhere"), "symlink"),
        "symlink OUT.json": (lambda out: Path(f"{out}.json").symlink_to(victim), "symlink"),
        "existing OUT": (lambda out: out.write_text("old adapter"), "already exists"),
        "existing OUT.json": (lambda out: Path(f"{out}.json").write_text("old record"), "already exists"),
        "OUT a folder": (lambda out: out.mkdir(), "not a regular file"),
    }
    for index, (case, (prepare, message)) in enumerate(cases.items()):
        folder = tmp_path / f"case{index}"
        folder.mkdir()
        out = folder / "a.onnx_adapter"
        prepare(out)
        before = _tree(tmp_path)
        with pytest.raises((ValueError, FileExistsError), match=message):
            convert_adapter(root / "good", root / "pkg", out)
        assert _tree(tmp_path) == before, case
    package_before = _tree(root / "pkg")
    with pytest.raises(ValueError, match="lies inside the input"):
        convert_adapter(root / "good", root / "pkg", root / "pkg" / "a.onnx_adapter")
    with pytest.raises(ValueError, match="lies inside the input"):
        convert_adapter(root / "good", root / "pkg", root / "good" / "a.onnx_adapter")
    assert _tree(root / "pkg") == package_before
    out = tmp_path / "case3" / "a.onnx_adapter"  # "existing OUT", replaced on request
    convert_adapter(root / "good", root / "pkg", out, overwrite=True)
    assert out.read_bytes() == setup["good"].read_bytes()
    assert json.loads(Path(f"{out}.json").read_text()) == json.loads(Path(f"{setup['good']}.json").read_text())
    assert victim.read_text() == "keep me"
    assert not [p for p in tmp_path.rglob(".edgelm-staging-*")]
    for case in ("case0", "case4"):  # symlink OUT, existing OUT.json
        done = edgelm("adapter", "convert", root / "good", root / "pkg", tmp_path / case / "a.onnx_adapter")
        assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert victim.read_text() == "keep me" and (tmp_path / "case4" / "a.onnx_adapter.json").read_text() == "old record"
