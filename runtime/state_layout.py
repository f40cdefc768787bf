"""A hybrid model's states as the manifest states them (LFM2, Qwen3.5): which layer keeps what (layer_types), and
the shapes of a convolution layer's convolution state and a linear-attention layer's convolution and recurrent
states, fixed in size, folding every token in. The record of this kind of state, parsed and validated here; its
drivers are runtime/statecache.py's (above runtime/runner.py, which this module's place in runtime/contract.py is
below: see docs/architecture.md's runtime floors).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import PackageError
from .fields import integer

# what a layer keeps between steps (architecture.layer_types, onnxruntime-genai's words): attention layers a KV
# cache, convolution layers a convolution state, linear-attention layers a convolution and a recurrent state
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
LAYER_STATES = {"full_attention": ("key", "value"), "sliding_attention": ("key", "value"), "conv": ("conv",),
                "linear_attention": ("conv", "recurrent")}  # fmt: skip
STATE_KINDS = ("conv", "recurrent")  # cache tensors that hold a state, not keys or values


@dataclass
class StateLayout:
    """The manifest's architecture keys for a hybrid model's layers; each None in a model whose every layer is
    attention. runtime/contract.py's Architecture holds one (`arch.states`) and writes its keys flat. The graph's
    names for the states are IONames' past_conv, present_conv, past_recurrent and present_recurrent."""

    layer_types: list[str] | None = None  # per layer, a key of LAYER_STATES (None: every layer attention)
    conv_state: list[int] | None = None  # (channels, kernel - 1) of a convolution state
    recurrent_state: list[int] | None = None  # (value heads, key head size, value head size)

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps a state that folds tokens in (it cannot be cut back to any length)."""
        return any(kind not in ATTENTION_LAYERS for kind in self.layer_types or ())

    def shape(self, kind: str) -> tuple[int, ...]:
        """One row's state of `kind` ("conv" or "recurrent")."""
        return tuple(self.conv_state if kind == "conv" else self.recurrent_state)

    def to_json(self) -> dict:
        """The keys a manifest holds: only those set, so a package without them keeps the manifest it always had."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    def genai_decoder(self) -> dict:
        """genai_config.json model.decoder's keys for a hybrid model (onnxruntime-genai's LFM2 reads them)."""
        decoder = {"layer_types": self.layer_types} if self.layer_types else {}
        if self.conv_state:
            decoder["conv_cache_size"] = self.conv_state[1]
        return decoder

    @classmethod
    def parse(cls, arch: dict, where: str) -> StateLayout:
        """A hybrid model's layer_types and the state shapes its state layers need; arch's n_layer is checked."""
        kinds = arch.get("layer_types")
        if kinds is None:
            return cls()
        n_layer = arch["n_layer"]
        if not isinstance(kinds, list) or len(kinds) != n_layer or not all(kind in LAYER_STATES for kind in kinds):
            raise PackageError(
                f"{where}: layer_types must list {n_layer} of {', '.join(LAYER_STATES)}, got {kinds!r:.80}"
            )
        shapes = {}
        for key, size, needed in (
            ("conv_state", 2, {"conv", "linear_attention"}),
            ("recurrent_state", 3, {"linear_attention"}),
        ):
            shape = arch.get(key)
            if shape is None and not needed & set(kinds):
                continue
            if not isinstance(shape, list) or len(shape) != size:
                raise PackageError(f"{where}: {key} must list {size} sizes, got {shape!r:.60}")
            shapes[key] = [integer({key: n}, key, where, minimum=1) for n in shape]
        if not any(kind in ATTENTION_LAYERS for kind in kinds):
            raise PackageError(f"{where}: layer_types has no attention layer")
        return cls(layer_types=kinds, **shapes)
