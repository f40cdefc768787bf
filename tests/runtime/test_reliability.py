"""Reliability and security of the runtime and of the writers: integrity checks on load, paths that
try to leave the package folder (JSON names, symlinks, ONNX external data), hostile inputs found by
tests/runtime/test_fuzz.py, one model shared by eight threads, a thousand generations in a row, the full
context, and export interrupted half-way.

The pickle side of checkpoints (weights_only=True, a malicious pickle refused and never run) is in
tests/export/test_checkpoint.py."""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers import copy_package, edit_json

from edgelm.runtime import (
    ContextLengthError,
    EdgelmError,
    InvalidInputError,
    InvalidParameterError,
    PackageError,
    PackageNotFoundError,
    load,
)
from edgelm.runtime import package as package_module
from edgelm.runtime import session as session_module
from edgelm.runtime.onnx_external import external_data_locations
from edgelm.writers.package_writer import list_files

ORT_INTERNALS = ("[ONNXRuntimeError]", "onnxruntime::", "onnxruntime_src")


# ---- helpers --------------------------------------------------------------------------------------


def genai_only(package: Path, tmp_path: Path, name: str = "genai") -> Path:
    """The package as an onnxruntime-genai folder: no manifest, so no hashes and no edgelm.json paths."""
    folder = copy_package(package, tmp_path, name)
    (folder / "edgelm.json").unlink()
    return folder


def relist(folder: Path) -> None:
    """Recompute the manifest's file list, as export does: the package is consistent again."""
    edit_json(folder / "edgelm.json", lambda m: m.update(files=list_files(folder)))


def tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def sessions(monkeypatch) -> list[str]:
    """Records every model path handed to onnxruntime.InferenceSession (the session still opens)."""
    opened: list[str] = []
    real = session_module.ort.InferenceSession

    def spy(path, *args, **kwargs):
        opened.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(session_module.ort, "InferenceSession", spy)
    return opened


def refused(folder: Path, error: type[Exception] = PackageError, *, verify: bool = True) -> str:
    """Load must fail with `error`; returns the message, checked free of ONNX Runtime internals."""
    with pytest.raises(error) as raised:
        load(folder, provider="cpu", threads=1, verify=verify)
    message = str(raised.value)
    assert not any(internal in message for internal in ORT_INTERNALS), message
    return message


# ---- 1. integrity: every file against the manifest's sha256, before ONNX Runtime sees anything ----


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20  # same size: only the hash can tell
    path.write_bytes(bytes(data))


def change_genai_config(path: Path) -> None:
    edit_json(path, lambda c: c["model"].update(context_length=4096))


DAMAGE = {
    "tokenizer.json tampered": ("tokenizer.json", flip_middle_byte, "sha256"),
    "tokenizer_config.json tampered": ("tokenizer_config.json", flip_middle_byte, "sha256"),
    "genai_config.json edited": ("genai_config.json", change_genai_config, "bytes"),
    "model.onnx truncated": ("model.onnx", lambda p: p.write_bytes(p.read_bytes()[:1000]), "truncated"),
    "model.onnx emptied": ("model.onnx", lambda p: p.write_bytes(b""), "truncated"),
    "model.onnx.data tampered": ("model.onnx.data", flip_middle_byte, "sha256"),  # a weight, same size
    "model.onnx.data truncated": ("model.onnx.data", lambda p: p.write_bytes(p.read_bytes()[:1000]), "truncated"),
}


@pytest.mark.parametrize("case", DAMAGE, ids=list(DAMAGE))
def test_damaged_file_is_named_before_onnx_runtime_opens_anything(package, tmp_path, sessions, case):
    name, damage, says = DAMAGE[case]
    folder = copy_package(package, tmp_path)
    damage(folder / name)
    message = refused(folder)
    assert name in message and says in message, message
    assert sessions == [], "ONNX Runtime was handed a package that failed verification"


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data"])
@pytest.mark.parametrize("damage", [flip_middle_byte, lambda p: p.write_bytes(b"\x08" * p.stat().st_size)])
def test_a_large_file_hashed_while_the_session_builds_still_fails_the_load(
    package, tmp_path, monkeypatch, damage, name
):
    """Files of BACKGROUND_HASH_BYTES or more (model.onnx, its weights) are hashed while ONNX Runtime builds
    the session: load() still raises the mismatch, whether or not the build itself failed on the bytes."""
    monkeypatch.setattr(package_module, "BACKGROUND_HASH_BYTES", 0)  # the tiny model's files count as large
    folder = copy_package(package, tmp_path)
    damage(folder / name)
    message = refused(folder)
    assert name in message and "sha256" in message, message


def test_a_background_hash_that_does_not_finish_never_passes(package, tmp_path, monkeypatch):
    monkeypatch.setattr(package_module, "BACKGROUND_HASH_BYTES", 0)

    def broken(path):
        raise RuntimeError("hashing stopped")

    monkeypatch.setattr(package_module, "file_sha256", broken)
    with pytest.raises(RuntimeError, match="hashing stopped"):
        load(copy_package(package, tmp_path), provider="cpu", threads=1)


def test_background_hashes_pass_for_an_intact_package(package, tmp_path, monkeypatch):
    monkeypatch.setattr(package_module, "BACKGROUND_HASH_BYTES", 0)
    model = load(copy_package(package, tmp_path), provider="cpu", threads=1)
    assert model.spec.verified and model.info()["verified"]
    assert model.generate([1, 2, 3], 4, ignore_eos=True).token_ids


@pytest.mark.parametrize("name", ["tokenizer.json", "genai_config.json", "tokenizer_config.json", "model.onnx.data"])
def test_missing_listed_file_is_named(package, tmp_path, sessions, name):
    folder = copy_package(package, tmp_path)
    (folder / name).unlink()
    assert name in refused(folder, PackageNotFoundError)
    assert sessions == []


def test_verify_false_skips_the_hashes_but_nothing_else(package, model, tmp_path):
    folder = copy_package(package, tmp_path)
    flip_middle_byte(folder / "tokenizer_config.json")  # a file the runtime does not read
    change_genai_config(folder / "genai_config.json")  # ignored: the manifest describes the package
    refused(folder)
    relaxed = load(folder, provider="cpu", threads=1, verify=False)
    assert relaxed.generate("ROMEO:", 6).token_ids == model.generate("ROMEO:", 6).token_ids


def test_a_model_file_the_manifest_does_not_list_is_not_trusted(package, model, tmp_path, sessions):
    """Hashes only protect files that are listed: a manifest pointing at an unlisted model is refused."""
    folder = copy_package(package, tmp_path)
    shutil.copy(folder / "model.onnx", folder / "other.onnx")
    edit_json(folder / "edgelm.json", lambda m: m.update(model_file="other.onnx"))
    assert "other.onnx is not listed" in refused(folder)
    assert sessions == []
    assert load(folder, provider="cpu", threads=1, verify=False).generate("ROMEO:", 4).token_ids == (
        model.generate("ROMEO:", 4).token_ids
    )


# ---- 2. paths: nothing a package names may resolve outside its folder -----------------------------


def outside_copy(package: Path, tmp_path: Path, name: str) -> Path:
    """A genuine copy of a package file outside the package folder: following the path would work."""
    target = tmp_path / "outside" / name
    target.parent.mkdir(exist_ok=True)
    shutil.copy(package / name, target)
    return target


def symlink_out(folder: Path, name: str, target: Path) -> None:
    (folder / name).unlink()
    (folder / name).symlink_to(target)


EDGELM_PATHS = ["model_file ../", "model_file absolute", "model_file symlink", "tokenizer file ../"]
EDGELM_PATHS += ["tokenizer file absolute", "tokenizer symlink", "manifest symlink"]


@pytest.mark.parametrize(
    ("case", "verify"),
    [(case, verify) for case in EDGELM_PATHS for verify in (True, False)] + [("listed file ../", True)],
)
def test_edgelm_package_paths_stay_inside(package, tmp_path, sessions, case, verify):
    folder = copy_package(package, tmp_path, "pkg")
    manifest = folder / "edgelm.json"
    model, tokenizer = outside_copy(package, tmp_path, "model.onnx"), outside_copy(package, tmp_path, "tokenizer.json")
    if case == "model_file ../":
        edit_json(manifest, lambda m: m.update(model_file="../outside/model.onnx"))
    elif case == "model_file absolute":
        edit_json(manifest, lambda m: m.update(model_file=str(model)))
    elif case == "model_file symlink":
        symlink_out(folder, "model.onnx", model)
    elif case == "tokenizer file ../":
        edit_json(manifest, lambda m: m["tokenizer"].update(file="../outside/tokenizer.json"))
    elif case == "tokenizer file absolute":
        edit_json(manifest, lambda m: m["tokenizer"].update(file=str(tokenizer)))
    elif case == "tokenizer symlink":
        symlink_out(folder, "tokenizer.json", tokenizer)
    elif case == "listed file ../":
        edit_json(manifest, lambda m: m["files"].update({"../outside/model.onnx": m["files"]["model.onnx"]}))
    elif case == "manifest symlink":
        outside_manifest = outside_copy(package, tmp_path, "edgelm.json")
        symlink_out(folder, "edgelm.json", outside_manifest)
    message = refused(folder, verify=verify)
    assert "outside the package folder" in message or "absolute path" in message, message
    assert sessions == []


@pytest.mark.parametrize("case", ["filename ../", "filename absolute", "model symlink", "tokenizer symlink"])
def test_genai_folder_paths_stay_inside(package, tmp_path, sessions, case):
    folder = genai_only(package, tmp_path)
    model, tokenizer = outside_copy(package, tmp_path, "model.onnx"), outside_copy(package, tmp_path, "tokenizer.json")
    config = folder / "genai_config.json"
    if case == "filename ../":
        edit_json(config, lambda c: c["model"]["decoder"].update(filename="../outside/model.onnx"))
    elif case == "filename absolute":
        edit_json(config, lambda c: c["model"]["decoder"].update(filename=str(model)))
    elif case == "model symlink":
        symlink_out(folder, "model.onnx", model)
    else:
        symlink_out(folder, "tokenizer.json", tokenizer)
    message = refused(folder, verify=False)
    assert "outside the package folder" in message or "absolute path" in message, message
    assert sessions == []


def test_symlinks_inside_the_folder_are_fine(package, model, tmp_path):
    folder = genai_only(package, tmp_path)
    (folder / "weights").mkdir()
    (folder / "model.onnx").rename(folder / "weights" / "model.onnx")
    (folder / "model.onnx.data").rename(folder / "weights" / "model.onnx.data")  # found beside the real file
    (folder / "model.onnx").symlink_to(folder / "weights" / "model.onnx")
    linked = load(folder, provider="cpu", threads=1, verify=False)
    assert linked.generate("ROMEO:", 6).token_ids == model.generate("ROMEO:", 6).token_ids


# ONNX external data. ONNX Runtime 1.31 refuses locations that leave the model's folder itself, but
# releases before late 2025 (pyproject allows >= 1.18) follow them anywhere; the runtime therefore reads
# the locations out of model.onnx itself (runtime/onnx_external.py, a protobuf walker) and refuses them before
# the session opens the file. `sessions == []` checks that it does so on any ONNX Runtime version.


def with_external_weights(source: Path, folder: Path, location: str, data_file: Path | None = None) -> None:
    """Rewrite folder/model.onnx (a copy of `source`) to keep its initializers in `data_file`, named by
    `location` in the model; the data file holds the real weights, so following the location works."""
    import onnx
    from onnx.external_data_helper import convert_model_to_external_data

    proto = onnx.load(str(source))
    convert_model_to_external_data(proto, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    onnx.save_model(proto, str(folder / "model.onnx"))  # writes folder/weights.bin beside it
    if location == "weights.bin" and data_file is None:
        return
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    (folder / "model.onnx").write_bytes(proto.SerializeToString())
    data_file = data_file or folder / location
    data_file.parent.mkdir(parents=True, exist_ok=True)
    (folder / "weights.bin").rename(data_file)


def test_external_weights_inside_the_folder_load(package, model, tmp_path):
    folder = genai_only(package, tmp_path)
    with_external_weights(package / "model.onnx", folder, "weights.bin")
    import onnx

    locations = external_data_locations(folder / "model.onnx")
    initializers = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.initializer
    assert len(locations) == len(initializers) > 10 and set(locations) == {"weights.bin"}
    assert (folder / "model.onnx").stat().st_size < (package / "model.onnx.data").stat().st_size / 2, "weights out"
    external = load(folder, provider="cpu", threads=1, verify=False)
    assert external.generate("ROMEO:", 8).token_ids == model.generate("ROMEO:", 8).token_ids


@pytest.mark.parametrize("where", ["../outside.bin", "absolute", "sub/../../outside.bin", "symlink"])
def test_external_data_outside_the_folder_is_refused(package, tmp_path, sessions, where):
    folder = genai_only(package, tmp_path)
    outside = tmp_path / "outside.bin"
    if where == "symlink":
        with_external_weights(package / "model.onnx", folder, "weights.bin", data_file=outside)
        (folder / "weights.bin").symlink_to(outside)
    else:
        location = str(outside) if where == "absolute" else where
        with_external_weights(package / "model.onnx", folder, location, data_file=outside)
    assert outside.stat().st_size > 100_000, "the outside file holds the real weights"
    message = refused(folder, verify=False)
    assert "external data" in message and ("outside the package folder" in message or "absolute" in message)
    assert sessions == [], "the runtime, not ONNX Runtime, must refuse it"


def test_a_package_with_its_weights_inside_model_onnx_still_runs(package, model, tmp_path):
    """Packages written before model.onnx.data keep every weight in model.onnx: they load and run the same."""
    import onnx

    folder = copy_package(package, tmp_path)
    onnx.save_model(onnx.load(str(folder / "model.onnx")), str(folder / "model.onnx"))  # data loaded, saved inline
    (folder / "model.onnx.data").unlink()
    relist(folder)
    assert external_data_locations(folder / "model.onnx") == []
    assert (folder / "model.onnx").stat().st_size > (package / "model.onnx.data").stat().st_size / 2
    inline = load(folder, provider="cpu", threads=1)
    assert inline.generate("ROMEO:", 8).token_ids == model.generate("ROMEO:", 8).token_ids


@pytest.mark.parametrize("damage", ["missing", "truncated", "fifo", "folder"])
def test_a_damaged_data_file_is_a_package_error_without_verification(package, tmp_path, sessions, damage):
    """verify=False skips the hashes, not the checks that keep ONNX Runtime from crashing or blocking."""
    folder = genai_only(package, tmp_path)
    data = folder / "model.onnx.data"
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:
        data.unlink()
        if damage == "fifo":
            os.mkfifo(data)
        elif damage == "folder":
            data.mkdir()
    message = refused(folder, verify=False)
    assert "model.onnx" in message, message
    if damage != "truncated":  # the runtime refuses before ONNX Runtime opens the model
        assert "model.onnx.data" in message and sessions == [], message


def test_external_data_in_an_edgelm_package_must_be_listed(package, model, tmp_path, sessions):
    folder = copy_package(package, tmp_path)
    with_external_weights(package / "model.onnx", folder, "weights.bin")
    edit_json(folder / "edgelm.json", lambda m: m["files"].update({"model.onnx": list_files(folder)["model.onnx"]}))
    assert "weights.bin is not listed" in refused(folder)
    assert sessions == []
    relist(folder)
    assert load(folder, provider="cpu", threads=1).generate("ROMEO:", 6).token_ids == (
        model.generate("ROMEO:", 6).token_ids
    )


def test_external_data_hidden_in_a_subgraph_is_found(tmp_path):
    """A Constant inside an If's branch inside a function-free graph: the walker descends through node
    attributes and subgraphs, not just the top-level initializers."""
    import onnx
    from onnx import TensorProto, helper

    constant = helper.make_tensor("c", TensorProto.FLOAT, [4], [0.0] * 4)
    constant.ClearField("float_data")
    constant.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../../etc/passwd"), ("offset", "0"), ("length", "16")):
        constant.external_data.add(key=key, value=value)
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["y"], value=constant)],
        "then",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    other = helper.make_graph(
        [helper.make_node("Constant", [], ["y2"], value=helper.make_tensor("d", TensorProto.FLOAT, [4], [1.0] * 4))],
        "else",
        [],
        [helper.make_tensor_value_info("y2", TensorProto.FLOAT, [4])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=other)],
        "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])],
    )
    path = tmp_path / "model.onnx"
    onnx.save_model(helper.make_model(graph), str(path))
    assert external_data_locations(path) == ["../../etc/passwd"]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "bad varint"])
def test_the_walker_refuses_malformed_protobuf(package, tmp_path, damage):
    path = tmp_path / "model.onnx"
    data = (package / "model.onnx").read_bytes()
    broken = {"truncated": data[: len(data) // 3], "garbage": b"not an onnx model\n" * 10, "bad varint": b"\xff" * 11}
    path.write_bytes(broken[damage])
    with pytest.raises(PackageError, match="model.onnx is not a valid ONNX file"):
        external_data_locations(path)


# ---- 4 (regressions). hostile inputs found by tests/runtime/test_fuzz.py ------------------------------------


@pytest.mark.parametrize("prompt", ["ROMEO \ud800", "\udfff", np.array(5), np.zeros((2, 2), dtype=np.int64)], ids=repr)
def test_prompts_that_are_not_text_or_a_flat_id_list(model, prompt):
    with pytest.raises(InvalidInputError):
        model.generate(prompt, 2)


@pytest.mark.parametrize("options", [dict(stop=5), dict(stop=object()), dict(cancel="yes"), dict(cancel=1)], ids=repr)
def test_stop_and_cancel_of_the_wrong_type(model, options):
    name = next(iter(options))
    with pytest.raises(InvalidParameterError, match=name):
        model.generate("ROMEO:", 2, **options)
    with pytest.raises(InvalidParameterError, match=name):
        model.stream("ROMEO:", 2, **options)


@pytest.mark.parametrize(
    "options",
    [dict(temperature=10**400), dict(repetition_penalty=2**1100), dict(temperature=np.float16("inf"))],
    ids=["temperature=10**400", "repetition_penalty=2**1100", "temperature=float16 inf"],
)
def test_numbers_beyond_float_range(model, options):
    with pytest.raises(InvalidParameterError, match=next(iter(options))):
        model.generate("ROMEO:", 2, **options)


def test_huge_but_finite_integers_and_numpy_integers_are_numbers(model):
    assert len(model.generate("ROMEO:", 3, temperature=2**100, seed=0).token_ids) == 3  # a float can hold it
    sampled = model.generate("ROMEO:", 4, temperature=1.0, top_k=np.uint64(5), seed=np.uint64(3)).token_ids
    assert sampled == model.generate("ROMEO:", 4, temperature=1.0, top_k=5, seed=3).token_ids


# a million threads crashed ONNX Runtime (a segfault, the whole process gone); 2**31 leaked pybind's TypeError
@pytest.mark.parametrize("options", [dict(provider=["cpu"]), dict(threads=2**31), dict(threads=10**6)], ids=repr)
def test_load_arguments_of_the_wrong_kind(package, options):
    with pytest.raises(EdgelmError):
        load(package, **{"provider": "cpu", **options})


@pytest.mark.parametrize("path", ["x" * 5000, "pkg\x00", 5, None], ids=["too long", "NUL", "int", "None"])
def test_package_paths_that_are_not_paths(path):
    with pytest.raises(PackageError):
        load(path, provider="cpu")


def test_info_with_an_unverified_corrupt_file_list(package, tmp_path):
    folder = copy_package(package, tmp_path)
    edit_json(folder / "edgelm.json", lambda m: m.update(files={"model.onnx": 7, "tokenizer.json": {"bytes": "x"}}))
    info = load(folder, provider="cpu", threads=1, verify=False).info()
    weights = folder / "model.onnx.data"  # the external data counts too
    assert weights.is_file() and info["size_bytes"] == (folder / "model.onnx").stat().st_size + weights.stat().st_size


MANIFEST_EDITS = {
    # a billion layers: without a bound the runtime would build two billion I/O names
    "n_layer huge": (lambda m: m["architecture"].update(n_layer=10**9), "layers"),
    "n_head wrong": (lambda m: m["architecture"].update(n_head=2, n_kv_head=2, head_dim=16), "past_key_values.0.key"),
    "vocab_size wrong": (lambda m: m["architecture"].update(vocab_size=1000), "logits"),
    "per-layer name without %d": (lambda m: m["io"].update(past_key="past.key"), "past_key"),
    "per-layer name with %s%s": (lambda m: m["io"].update(past_key="past.%s.%s"), "past_key"),
    "bos outside the vocabulary": (lambda m: m["tokenizer"].update(bos_token_id=-1), "special token id -1"),
    "pad outside the vocabulary": (lambda m: m["tokenizer"].update(pad_token_id=10**6), "special token"),
}


@pytest.mark.parametrize("case", MANIFEST_EDITS, ids=list(MANIFEST_EDITS))
def test_a_manifest_that_does_not_match_its_model_fails_at_load(package, tmp_path, case):
    edit, says = MANIFEST_EDITS[case]
    folder = copy_package(package, tmp_path)
    edit_json(folder / "edgelm.json", edit)
    assert says in refused(folder)


GENAI_EDITS = {
    "inputs is a list": lambda c: c["model"]["decoder"].update(inputs=["input_ids"]),
    "hidden_size is a string": lambda c: c["model"]["decoder"].update(head_size=None, hidden_size="32"),
    "position_ids names attention_mask": lambda c: c["model"]["decoder"]["inputs"].update(
        position_ids="attention_mask"
    ),
    "input_ids unbound": lambda c: c["model"]["decoder"]["inputs"].update(input_ids="position_ids"),
    "logits is a present": lambda c: c["model"]["decoder"]["outputs"].update(logits="present.0.key"),
    "layer count too low": lambda c: c["model"]["decoder"].update(num_hidden_layers=1),
}


@pytest.mark.parametrize("case", GENAI_EDITS, ids=list(GENAI_EDITS))
def test_a_genai_config_that_does_not_match_its_model_fails_at_load(package, tmp_path, case):
    folder = genai_only(package, tmp_path)
    edit_json(folder / "genai_config.json", GENAI_EDITS[case])
    refused(folder, verify=False)


def test_a_context_length_beyond_the_model_fails_cleanly_when_reached(package, tmp_path):
    """The position table's size is not in the graph's I/O, so a too-large context_length can only be
    caught when generation reaches it: a PackageError, not ONNX Runtime's own exception."""
    folder = copy_package(package, tmp_path)
    edit_json(folder / "edgelm.json", lambda m: m["architecture"].update(context_length=200))
    model = load(folder, provider="cpu", threads=1)
    assert len(model.generate("ROMEO:", 20, ignore_eos=True).token_ids) == 20
    with pytest.raises(PackageError, match="failed running model.onnx") as raised:
        model.generate("ROMEO:", 100, ignore_eos=True)
    assert not any(internal in str(raised.value) for internal in ORT_INTERNALS)


def test_deeply_nested_json_is_a_package_error(package, tmp_path):
    folder = copy_package(package, tmp_path)
    (folder / "edgelm.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "edgelm.json is not valid JSON" in refused(folder)


# ---- 5. concurrency: one model, eight threads, no cross-talk ----------------------------------------

JOBS = [
    ("ROMEO:", dict()),
    ("JULIET: O Romeo, Romeo", dict(temperature=1.0, seed=1)),
    ([5, 17, 99, 3], dict(temperature=0.8, top_k=20, seed=2)),
    ("First Citizen:\nBefore we proceed", dict()),
    ("KING", dict(temperature=1.2, top_p=0.9, seed=3, repetition_penalty=1.3)),
    ([250, 251, 252, 253, 254, 255, 256], dict(repetition_penalty=1.5)),
    ("A", dict(temperature=0.7, min_p=0.05, seed=4)),
    ("What say you, my lord?", dict(temperature=1.0, seed=5, stream=True)),
]


def run_job(model, prompt, options) -> list[int]:
    options = dict(options)
    if options.pop("stream", False):
        stream = model.stream(prompt, 16, **options)
        pieces = "".join(stream)
        assert pieces == stream.result.text
        return stream.result.token_ids
    return model.generate(prompt, 16, ignore_eos=True, **options).token_ids


def test_eight_threads_on_one_model_match_each_request_alone(package):
    model = load(package, provider="cpu", threads=1)
    alone = [run_job(model, prompt, options) for prompt, options in JOBS]
    assert len({tuple(ids) for ids in alone}) >= 6, "the requests must give distinguishable outputs"
    start = threading.Barrier(len(JOBS))

    def worker(job):
        start.wait()  # all eight decode loops at once, each repeated so they interleave at every step
        return [run_job(model, *job) for _ in range(4)]

    with ThreadPoolExecutor(len(JOBS)) as pool:
        together = list(pool.map(worker, JOBS))
    for (prompt, _), expected, repeats in zip(JOBS, alone, together, strict=True):
        assert repeats == [expected] * 4, f"cross-talk for prompt {prompt!r}"


# ---- 6. long runs and the full context ------------------------------------------------------------


def rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


RSS_TOLERANCE_MB = 10.0  # observed growth: 0.0 MB; one leaked KV cache per call (~16 KB here) would exceed it


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_a_thousand_generations_keep_memory_flat(package):
    model = load(package, provider="cpu", threads=1)
    prompts = ["ROMEO:", "JULIET: O", [7, 8, 9], "KING RICHARD III:\nNow is the winter", "A"]
    tokens = 0

    def one(i: int) -> None:
        nonlocal tokens
        prompt, n = prompts[i % len(prompts)], 4 + i % 5  # 4 to 8 new tokens
        if i % 10 == 9:
            stream = model.stream(prompt, n, temperature=0.9, seed=i)
            "".join(stream)
            tokens += len(stream.result.token_ids)
        else:
            options = dict(temperature=1.0, top_k=40, seed=i) if i % 2 else {}
            tokens += len(model.generate(prompt, n, ignore_eos=True, **options).token_ids)

    for i in range(100):
        one(i)
    gc.collect()
    warm = rss_mb()
    for i in range(100, 1000):
        one(i)
    gc.collect()
    after = rss_mb()
    print(f"\nRSS after 100 generations {warm:.1f} MB, after 1000 {after:.1f} MB, {tokens} tokens", file=sys.stderr)
    assert after - warm < RSS_TOLERANCE_MB, f"resident memory grew {after - warm:.1f} MB over 900 generations"


@pytest.mark.parametrize("prompt_tokens", [1, 32, 63])
def test_generating_up_to_the_full_context(model, prompt_tokens):
    context = model.context_length
    ids = list(range(1, prompt_tokens + 1))  # EOS is 0: never in the prompt
    new = context - prompt_tokens  # prompt + new == context exactly
    result = model.generate(ids, new, ignore_eos=True)
    assert (len(result.token_ids), result.finish_reason) == (new, "length")
    assert all(0 <= t < model.vocab_size for t in result.token_ids)
    stream = model.stream(ids, new, temperature=1.0, seed=0)
    assert "".join(stream) == stream.result.text
    assert stream.result.finish_reason in ("length", "eos")

    with pytest.raises(ContextLengthError, match="exceeds the context length"):
        model.generate(ids, new + 1)
    with pytest.raises(ContextLengthError):
        model.stream(ids, new + 1)
    if new + 1 < context:
        truncated = model.generate(ids, new + 1, truncate_prompt=True, ignore_eos=True)
        assert truncated.prompt_token_ids == ids[1:]  # the oldest token made room for one more
        assert (len(truncated.token_ids), truncated.finish_reason) == (new + 1, "length")
    else:
        with pytest.raises(ContextLengthError, match="max_new_tokens"):  # no prompt token would be left
            model.generate(ids, new + 1, truncate_prompt=True)


def test_a_batch_filling_the_context(model):
    batch = [list(range(1, 41)), list(range(1, 11))]  # the longest row sets the width: 40 + 24 == 64
    results = model.generate_batch(batch, 24, ignore_eos=True)
    assert [(len(r.token_ids), r.finish_reason) for r in results] == [(24, "length")] * 2
    with pytest.raises(ContextLengthError):
        model.generate_batch(batch, 25)


# ---- 7. atomic writes: an interrupted export leaves nothing and touches nothing -------------------


@pytest.mark.parametrize("step", ["save_model", "check_parity_shared", "write_json"])
def test_export_interrupted_half_way_leaves_nothing(hf_checkpoint, tmp_path, monkeypatch, step):
    from edgelm.export import onnx_export

    before = tree_hashes(hf_checkpoint)
    real = getattr(onnx_export, step)

    def interrupt(*args, **kwargs):
        if step == "save_model":
            real(*args, **kwargs)  # model.onnx written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx_export, step, interrupt)
    parent = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        onnx_export.export_package(hf_checkpoint, parent / "pkg", progress=lambda _: None)
    assert not parent.exists(), "no package, no staging folder, and not the parent folder export made for it"
    assert tree_hashes(hf_checkpoint) == before, "the checkpoint must not change"


def test_export_interrupted_over_an_existing_package_keeps_it(hf_checkpoint, package, model, tmp_path, monkeypatch):
    from edgelm.export import onnx_export

    out = copy_package(package, tmp_path, "pkg")
    before = tree_hashes(out)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx_export, "check_parity_shared", interrupt)
    with pytest.raises(KeyboardInterrupt):
        onnx_export.export_package(hf_checkpoint, out, overwrite=True, progress=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]
    assert tree_hashes(out) == before
    assert load(out, provider="cpu", threads=1).generate("ROMEO:", 4).token_ids == (
        model.generate("ROMEO:", 4).token_ids
    )


# ---- round 2: a missing or replaced manifest never skips the check; special files never block ----------


def replace_manifest(folder: Path, how: str) -> None:
    manifest = folder / "edgelm.json"
    manifest.unlink()
    if how == "folder":
        manifest.mkdir()
    elif how == "fifo":
        os.mkfifo(manifest)
    elif how == "garbage":
        manifest.write_bytes(b"\x00\xff not json")
    elif how == "dangling symlink":
        manifest.symlink_to(folder / "nowhere.json")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("how", ["missing", "folder", "fifo", "garbage", "dangling symlink"])
def test_a_missing_or_replaced_manifest_does_not_load_with_verification(package, model, tmp_path, sessions, how):
    folder = copy_package(package, tmp_path)
    flip_middle_byte(folder / "tokenizer.json")  # tampered: the hash check is what would catch it
    replace_manifest(folder, how)
    message = refused(folder)
    assert sessions == []
    if how == "garbage":
        assert "not valid JSON" in message
    else:
        assert "cannot be verified" in message and "verify=False" in message and "--no-verify" in message
    # on purpose, unverified: the folder loads as what it is (a genai folder), and info says so
    if how != "garbage":
        (folder / "tokenizer.json").write_bytes((package / "tokenizer.json").read_bytes())
        unsigned = load(folder, provider="cpu", threads=1, verify=False)
        assert unsigned.info()["verified"] is False and unsigned.spec.kind == "genai"
        assert unsigned.generate("ROMEO:", 4).token_ids == model.generate("ROMEO:", 4).token_ids


def test_info_says_whether_the_package_was_verified(package, model):
    assert model.info()["verified"] is True
    assert load(package, provider="cpu", threads=1, verify=False).info()["verified"] is False


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", ["model.onnx", "tokenizer.json", "genai_config.json"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_fifo_in_place_of_a_file_never_blocks(package, tmp_path, sessions, name, verify):
    folder = copy_package(package, tmp_path)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    done = threading.Event()
    outcome: list = []

    def attempt():
        try:
            outcome.append(load(folder, provider="cpu", threads=1, verify=verify))
        except Exception as e:  # noqa: BLE001 - recorded and checked below
            outcome.append(e)
        done.set()

    threading.Thread(target=attempt, daemon=True).start()
    assert done.wait(20), f"load blocked on a FIFO named {name}"
    if name == "genai_config.json" and not verify:
        return  # the manifest describes the package; this file is not read
    assert isinstance(outcome[0], PackageError), outcome
    assert "regular file" in str(outcome[0]) or "missing" in str(outcome[0]), outcome


def test_a_lying_manifest_cannot_make_the_runtime_allocate_without_bound(package, tmp_path):
    """context_length says a billion: prompt + max_new_tokens fits it, but the cache would not fit memory."""
    folder = copy_package(package, tmp_path)
    edit_json(folder / "edgelm.json", lambda m: m["architecture"].update(context_length=10**9))
    relist(folder)
    liar = load(folder, provider="cpu", threads=1)
    with pytest.raises(MemoryError, match="GiB"):
        liar.generate("ROMEO:", 10**8)
    with pytest.raises(MemoryError, match="batch size"):
        liar.generate_batch(["ROMEO:"] * 4096, 10**6)
    assert len(liar.generate("ROMEO:", 4).token_ids) == 4  # a sane request still runs


def test_kv_cache_bytes_counts_every_layer(model):
    from edgelm.runtime.kvcache import kv_cache_bytes

    spec = model.spec
    expected = 2 * spec.arch.n_layer * 3 * spec.arch.n_kv_head * 50 * spec.arch.head_dim * 4
    assert kv_cache_bytes(spec, batch=3, capacity=50) == expected
