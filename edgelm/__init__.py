"""edgelm: GPT-style models from PyTorch to a small, fast ONNX package, and a thin runtime."""

__version__ = "0.1.0"
