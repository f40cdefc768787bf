"""Forwards to benchmarks/peers/peer_runner.py, for real_sizes.py and packed_vs_llamacpp.py (issue 45's, being
edited now) until they put benchmarks/peers/ on sys.path themselves; then delete this file."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
del sys.modules[__name__]  # so the import below finds benchmarks/peers/peer_runner.py, not this file
import peer_runner  # noqa: E402, F401  (the module itself, under its own name)
