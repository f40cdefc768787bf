"""What a package's bytes are, class by class, against the GGUF file it came from: each initializer of model.onnx
sorted by what it is (MatMulNBits' values, its scales, the offsets beside a block type with minimums, a table
gathered by rows, norms and other small arrays), and the file's bytes by tensor type.

    python benchmarks/package_bytes.py PACKAGE [FILE.gguf]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np
import onnx


def _bytes(tensor: onnx.TensorProto) -> int:
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    if tensor.raw_data:
        return len(tensor.raw_data)
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def package_classes(package: Path) -> dict[str, int]:
    graph = onnx.load(str(package / "model.onnx"), load_external_data=False).graph
    role = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            if node.op_type == "MatMulNBits":
                role.setdefault(name, ("MatMulNBits values", "MatMulNBits scales", "MatMulNBits zero points")[
                    min(index - 1, 2)] if index else "activations")  # fmt: skip
            elif node.op_type in ("MatMulPacked", "GatherPacked"):  # the blocks: B of MatMulPacked, data of a gather
                blocks = index == (1 if node.op_type == "MatMulPacked" else 0)
                role.setdefault(name, "the file's blocks (MatMulPacked, GatherPacked)" if blocks else "activations")
            elif node.op_type in ("Gather", "GatherBlockQuantized"):
                role.setdefault(name, "gathered table (embedding rows)")
            elif node.op_type == "MatMul":
                role.setdefault(name, "float MatMul weights / block offsets")
    classes, stored = collections.Counter(), set()
    for tensor in graph.initializer:
        where = {entry.key: entry.value for entry in tensor.external_data}
        if where:  # two initializers may view the same bytes (a tied table's rows gathered from the head's blocks)
            key = (where.get("location"), where.get("offset"))
            if key in stored:
                continue
            stored.add(key)
        classes[role.get(tensor.name, "norms, biases and other")] += _bytes(tensor)
    classes["graph (model.onnx)"] = (package / "model.onnx").stat().st_size
    for name in ("tokenizer.json", "genai_config.json", "edgelm.json", "tokenizer_config.json"):
        if (package / name).exists():
            classes["tokenizer and JSON files"] += (package / name).stat().st_size
    return dict(classes)


def file_classes(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    classes = collections.Counter()
    reader = GGUFReader(path)
    for tensor in reader.tensors:
        classes[tensor.tensor_type.name] += int(tensor.n_bytes)
    classes["header and metadata"] = path.stat().st_size - sum(classes.values())
    return dict(classes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("gguf", type=Path, nargs="?")
    args = parser.parse_args()
    ours = package_classes(args.package)
    total = sum(ours.values())
    for name, size in sorted(ours.items(), key=lambda item: -item[1]):
        print(f"package  {name:40s} {size / 1e6:9.2f} MB")
    print(f"package  {'total':40s} {total / 1e6:9.2f} MB")
    if args.gguf:
        theirs = file_classes(args.gguf)
        for name, size in sorted(theirs.items(), key=lambda item: -item[1]):
            print(f"file     {name:40s} {size / 1e6:9.2f} MB")
        size = args.gguf.stat().st_size
        print(f"file     {'total':40s} {size / 1e6:9.2f} MB; package / file {total / size:.2f}x")


if __name__ == "__main__":
    main()
