"""Saving an ONNX model, for export and quantize alike: weights go to a side file past protobuf's
2 GB limit (ONNX's external data), and the model file alone below it."""

from __future__ import annotations

from pathlib import Path

import onnx

from edgelm import __version__

EXTERNAL_DATA_LIMIT = 1_800_000_000  # bytes of serialized model above which weights go to <model>.data


def save_model(model: onnx.ModelProto, path: str | Path) -> str | None:
    """Write `model` to `path`; returns the external-data file's name, or None when there is none."""
    path = Path(path)
    model.producer_name = "edgelm"
    model.producer_version = __version__
    if model.ByteSize() <= EXTERNAL_DATA_LIMIT:
        onnx.save_model(model, str(path))
        return None
    location = path.name + ".data"
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=1024,
    )
    return location
