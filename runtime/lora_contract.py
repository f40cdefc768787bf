"""LoRA in the package contract: the manifest's `lora` record and the record beside a converted adapter.

A package exported with LoRA slots adds x @ A @ B to the named linears, A (in, parts * max_rank) and
B (parts * max_rank, out) being overridable initializers (graph inputs with a default) that are zero by
default, so the base runs unchanged; an adapter file (ONNX Runtime's `.onnx_adapter` format,
onnxruntime.AdapterFormat) holds values for them, and a run that binds them runs the adapted model. The
manifest says which tensors those are, which PEFT modules each packs (Q, K and V share one slot, their
B block-diagonal), the layers that hold each linear (a hybrid model's attention and convolution layers have
different ones; every layer when absent), and the hash of the base they belong to:

    "lora": {"slots": {"max_rank": 16, "modules": ["q_proj", "v_proj"], "n_layer": 30,
                       "base_sha256": "...",
                       "linears": [{"a": "layers.%d.qkv.lora_A", "b": "layers.%d.qkv.lora_B", "in": 576,
                                    "out": 960, "parts": [{"module": "model.layers.%d.self_attn.q_proj",
                                                            "offset": 0, "width": 576}, ...],
                                    "layers": [1, 3]}]},
             "merged": [{"adapter": "...", "sha256": "...", "scale": 1.0, ...}]}

`edgelm adapter convert` writes `NAME.onnx_adapter` and `NAME.onnx_adapter.json` (AdapterRecord): the
adapter file's sha256 and the base_sha256 it was made for, so the runtime refuses a tampered file or one
made for another base. The adapter file's model_version is the base hash's first 28 bits, for readers that
only see the file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import AdapterError, PackageError
from .fields import integer, io_name

ADAPTER_SUFFIX = ".onnx_adapter"
RECORD_SUFFIX = ".json"  # the record is the adapter file's name + this
ADAPTER_FORMAT = "edgelm-lora-adapter"
ADAPTER_FORMAT_VERSION = 1


def model_version(base_sha256: str) -> int:
    """The adapter file's model_version (an int32 in ONNX Runtime's format): the base hash's first 28 bits."""
    return int(base_sha256[:7], 16)


@dataclass
class SlotLinear:
    """One slotted linear kind, the same in each layer that holds it (names hold %d for the layer)."""

    a: str  # "layers.%d.qkv.lora_A": (in, len(parts) * max_rank)
    b: str  # "layers.%d.qkv.lora_B": (len(parts) * max_rank, out)
    in_features: int
    out_features: int
    # {"module": PEFT module path with %d, "offset": first output column, "width": columns}, and "columns":
    # [[first, count], ...] where the module's outputs are not one block (Qwen3.5's q_proj: each head's query and
    # gate go to the packed linear's query and gate columns), which they fill in order
    parts: list[dict]
    layers: list[int] | None = None  # the layers that hold this linear; None: every layer
    # A's rows in the order the graph feeds the linear its inputs: row j takes the adapter's input rows[j] (a
    # Qwen3.5 GGUF base's DeltaNet out_proj, whose kept blocks take the value heads in llama.cpp's order); None: as is
    rows: list[int] | None = None

    def layer_indices(self, n_layer: int) -> list[int]:
        return list(range(n_layer)) if self.layers is None else self.layers


@dataclass
class LoraSlots:
    max_rank: int
    modules: list[str]  # the module names asked for ("q_proj", "c_attn", ...)
    n_layer: int
    base_sha256: str  # the fp32 (or kept-block) export's weights: an adapter is bound to it
    linears: list[SlotLinear]

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Every slot tensor's name -> shape."""
        out = {}
        for linear in self.linears:
            width = len(linear.parts) * self.max_rank
            for layer in linear.layer_indices(self.n_layer):
                out[linear.a % layer] = (linear.in_features, width)
                out[linear.b % layer] = (width, linear.out_features)
        return out

    def to_json(self) -> dict:
        data = asdict(self)
        data["linears"] = [
            {"a": x.a, "b": x.b, "in": x.in_features, "out": x.out_features, "parts": x.parts}
            | ({} if x.layers is None else {"layers": x.layers})
            | ({} if x.rows is None else {"rows": x.rows})
            for x in self.linears
        ]
        return data


def parse_slots(lora: object, where: str) -> LoraSlots | None:
    """The manifest's lora.slots, validated; None when the package has none. PackageError names the field."""
    if lora is None:
        return None
    if not isinstance(lora, dict) or not isinstance(lora.get("slots", {}), dict):
        raise PackageError(f"{where}: lora must be an object and lora.slots an object")
    slots = lora.get("slots")
    if not slots:
        return None
    where = f"{where} lora.slots"
    n_layer = integer(slots, "n_layer", where, minimum=1)
    linears = slots.get("linears")
    if not isinstance(linears, list) or not linears or not all(isinstance(x, dict) for x in linears):
        raise PackageError(f"{where}: linears must be a non-empty list of objects")
    parsed = []
    for linear in linears:
        parts = linear.get("parts")
        if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
            raise PackageError(f"{where}: each linear needs a non-empty list of parts")
        layers = linear.get("layers")
        is_layer = lambda i: isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layer  # noqa: E731
        if layers is not None and not (isinstance(layers, list) and layers and all(map(is_layer, layers))):
            raise PackageError(f"{where}: a linear's layers must be a non-empty list of layer indices below {n_layer}")
        in_features, rows = integer(linear, "in", where, minimum=1), linear.get("rows")
        if rows is not None and (not isinstance(rows, list) or sorted(rows) != list(range(in_features))):
            raise PackageError(f"{where}: a linear's rows must be an order of its {in_features} inputs")
        parsed.append(
            SlotLinear(
                io_name(linear, "a", None, where, per_layer=True), io_name(linear, "b", None, where, per_layer=True),
                in_features, integer(linear, "out", where, minimum=1), parts,
                None if layers is None else sorted(set(layers)), rows,
            )
        )  # fmt: skip
    modules, base = slots.get("modules"), slots.get("base_sha256")
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise PackageError(f"{where}: modules must be a list of names")
    if not isinstance(base, str) or len(base) != 64:
        raise PackageError(f"{where}: base_sha256 must be a sha256 hex digest")
    return LoraSlots(integer(slots, "max_rank", where, minimum=1), modules, n_layer, base, parsed)


@dataclass
class AdapterRecord:
    """NAME.onnx_adapter.json: what a converted adapter is and which base it belongs to."""

    sha256: str  # of the .onnx_adapter file
    base_sha256: str  # LoraSlots.base_sha256 of the package it was converted for
    max_rank: int  # the slots' rank the tensors are padded to
    source: dict  # the PEFT adapter: name, sha256, rank(s), alpha, use_rslora, scale, modules
    format: str = ADAPTER_FORMAT
    format_version: int = ADAPTER_FORMAT_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, data: object, where: str) -> AdapterRecord:
        if not isinstance(data, dict) or data.get("format") != ADAPTER_FORMAT:
            raise AdapterError(f"{where} is not an edgelm adapter record (format {ADAPTER_FORMAT!r})")
        if data.get("format_version") != ADAPTER_FORMAT_VERSION:
            raise AdapterError(f"{where}: format_version {data.get('format_version')!r} is not supported")
        for key in ("sha256", "base_sha256"):
            if not isinstance(data.get(key), str) or len(data[key]) != 64:
                raise AdapterError(f"{where}: {key} must be a sha256 hex digest")
        rank = data.get("max_rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise AdapterError(f"{where}: max_rank must be an integer >= 1")
        source = data.get("source") if isinstance(data.get("source"), dict) else {}
        return cls(data["sha256"], data["base_sha256"], rank, source)
