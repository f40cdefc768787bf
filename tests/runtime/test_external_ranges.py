"""External data ranges (runtime/onnx_external.py): two tensors of model.onnx whose (offset, length) ranges in
model.onnx.data overlap, or a range past the file's end, are refused at load with a PackageError, even in a
package whose manifest signs the edited files (ONNX Runtime itself reads whatever range it is given)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from edgelm.runtime import PackageError, load
from edgelm.runtime.onnx_external import external_data
from edgelm.writers.package_writer import list_files, write_json


def resigned_with(package: Path, folder: Path, change) -> Path:
    """A copy of package whose model.onnx external_data entries went through change(tensors), signed again."""
    folder = Path(shutil.copytree(package, folder))
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    change({t.name: {e.key: e for e in t.external_data} for t in external})
    onnx.save_model(model, str(folder / "model.onnx"))
    manifest = json.loads((folder / "edgelm.json").read_text())
    manifest["files"] = list_files(folder)
    write_json(folder / "edgelm.json", manifest)
    return folder


def test_the_walker_reads_every_range_as_onnx_does(package):
    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    expected = {
        t.name: {e.key: e.value for e in t.external_data}
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    }
    found = {
        e.tensor: {"location": e.location, "offset": e.offset, "length": e.length}
        for e in external_data(package / "model.onnx")
    }
    assert found == expected and len(found) > 2


@pytest.mark.parametrize("how", ["same start", "partial overlap", "inside another"])
def test_overlapping_ranges_are_refused(package, tmp_path, how):
    def overlap(tensors):  # the smallest tensor moved into the largest's bytes; its length stays its own
        ranges = sorted(tensors.values(), key=lambda e: int(e["length"].value))
        small, big = ranges[0], ranges[-1]
        start, length, small_length = int(big["offset"].value), int(big["length"].value), int(small["length"].value)
        size = (package / "model.onnx.data").stat().st_size
        assert small_length + 64 < length
        if how == "same start":
            small["offset"].value = str(start)
        elif how == "partial overlap":  # 4 bytes shared: big's last (or first) 4
            end = start + length - 4
            small["offset"].value = str(end if end + small_length <= size else start + 4 - small_length)
        else:
            small["offset"].value = str(start + 64)

    folder = resigned_with(package, tmp_path / "pkg", overlap)
    with pytest.raises(PackageError, match="overlap in model.onnx.data"):
        load(folder, provider="cpu")
    with pytest.raises(PackageError, match="overlap"):
        load(folder, provider="cpu", verify=False)


def test_a_range_past_the_end_or_not_a_number_is_refused(package, tmp_path):
    def past_end(tensors):
        entry = next(iter(tensors.values()))
        entry["offset"].value = str((package / "model.onnx.data").stat().st_size)

    with pytest.raises(PackageError, match="lie outside model.onnx.data"):
        load(resigned_with(package, tmp_path / "a", past_end), provider="cpu")

    def not_a_number(tensors):
        next(iter(tensors.values()))["length"].value = "12abc"

    with pytest.raises(PackageError, match="must be integers"):
        load(resigned_with(package, tmp_path / "b", not_a_number), provider="cpu")
