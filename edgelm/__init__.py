"""edgelm: a decoder language model (GPT-2; Llama, Qwen, Mistral, Granite, Phi-3, SmolLM3; Gemma 3 and 4; the
hybrids LFM2 and Qwen3.5: one module each in export/families/) from a Hugging Face folder or a GGUF file to a
small, fast ONNX package with its cache, quantized if asked, and a thin onnxruntime runtime that knows no family.

    import edgelm
    model = edgelm.load("SmolLM2-135M-Instruct.Q4_1.gguf")  # a package, a GGUF file or a model folder
    print(model.generate("The capital of France is", 16).text)

`edgelm.load` exports a GGUF file or a Hugging Face model folder once into a cache of packages (edgelm/cache.py)
and loads that; `edgelm.runtime.load` loads packages only, and needs no PyTorch.
"""

from __future__ import annotations

from edgelm.writers.version import __version__  # noqa: F401 (edgelm.__version__)


def load(source, provider: str = "auto", threads: int | None = None, **options):
    """A Model from a package folder, a GGUF file or a Hugging Face model folder. options: verify (default True),
    cache (default True; False exports into a temporary folder), export_options (export_package's keywords),
    progress (export's progress lines; default stderr). See edgelm/cache.py."""
    from .cache import load as load_cached

    return load_cached(source, provider, threads, **options)
