"""Attention's keys and values as the manifest states them, beyond heads and head size: KV sharing between layers
and per-layer shapes (Gemma 4). The record of this kind of state, parsed and validated here; its drivers are
runtime/kvdrivers.py's (they sit above runtime/runner.py, which this module's place in runtime/contract.py is below,
so the two are not one module: see docs/architecture.md's runtime floors).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import PackageError
from .fields import integer

KV_KINDS = ("key", "value")  # an attention layer's cache tensors; any other kind is a fixed-size state


@dataclass
class KVLayout:
    """The manifest's architecture keys for keys and values where layers differ (Gemma 4); each None where every
    layer keeps its own cache of the architecture's n_kv_head and head_dim. runtime/contract.py's Architecture
    holds one (`arch.kv`) and writes its keys flat, after the others."""

    # KV sharing: per layer, the layer whose keys and values its attention reads: itself (it keeps a cache) or an
    # earlier layer (it has no past/present of its own)
    kv_source: list[int] | None = None
    # per layer, its cache's head size and KV heads where layers differ (Gemma 4's full layers)
    layer_head_dim: list[int] | None = None
    layer_n_kv_head: list[int] | None = None

    @property
    def uniform(self) -> bool:
        """Every layer keeps its own cache, of one shape."""
        return self.kv_source is None and self.layer_head_dim is None and self.layer_n_kv_head is None

    def keeps_cache(self, layer: int) -> bool:
        """Whether `layer` has a past and present of its own (it reads no other layer's)."""
        return self.kv_source is None or self.kv_source[layer] == layer

    def shape(self, layer: int, *, n_kv_head: int, head_dim: int) -> tuple[int, int]:
        """(KV heads, head size) of a layer's keys and values; n_kv_head, head_dim: the architecture's."""
        heads = n_kv_head if self.layer_n_kv_head is None else self.layer_n_kv_head[layer]
        return heads, head_dim if self.layer_head_dim is None else self.layer_head_dim[layer]

    def to_json(self) -> dict:
        """The keys a manifest holds: only those set, so a package without them keeps the manifest it always had."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def parse(cls, arch: dict, where: str) -> KVLayout:
        """kv_source (each layer's source: itself or an earlier layer that keeps its own cache) and the per-layer
        cache shapes, where the manifest has them; arch's n_layer and n_head are checked already."""
        n_layer, parsed = arch["n_layer"], {}
        for key in ("kv_source", "layer_head_dim", "layer_n_kv_head"):
            values = arch.get(key)
            if values is None:
                continue
            if not isinstance(values, list) or len(values) != n_layer:
                raise PackageError(f"{where}: {key} must list {n_layer} integers, got {values!r:.60}")
            parsed[key] = [integer({key: v}, key, where, minimum=0 if key == "kv_source" else 1) for v in values]
        for kv_heads in parsed.get("layer_n_kv_head", []):
            if arch["n_head"] % kv_heads:
                raise PackageError(f"{where}: n_head ({arch['n_head']}) must be a multiple of every layer_n_kv_head")
        source = parsed.get("kv_source")
        if source is not None:
            for i, s in enumerate(source):
                if s > i or source[s] != s:
                    raise PackageError(
                        f"{where}: kv_source[{i}] is {s}: a layer reads its own cache or that of an earlier layer "
                        "which keeps its own"
                    )
        return cls(**parsed)
