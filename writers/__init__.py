"""The writers under export/ and quantize/ (edgelm.writers): an ONNX model and its external data
(`onnxfile.py`), a package folder staged and swapped in (`package_writer.py`), a graph in half precision
(`float16.py`), an embedding gathered from MatMulNBits blocks (`nbits_gather.py`) and the version they stamp
(`version.py`). Both rooms import them by absolute name; they import only the runtime's contract, never export/,
quantize/ or the CLI.
"""
