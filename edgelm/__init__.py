"""edgelm: GPT-2 and Llama-family models from a Hugging Face folder or a GGUF file to a small, fast ONNX
package, and a thin runtime.

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
