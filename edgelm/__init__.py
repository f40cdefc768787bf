"""edgelm: GPT-2 and Llama-family models from a Hugging Face folder or a GGUF file to a small, fast ONNX
package, and a thin runtime."""

__version__ = "0.1.0"
