"""LoRA adapters at run time: load `.onnx_adapter` files beside a package with LoRA slots and choose one per request.

    model = load("out/smol-slots")
    model.load_adapter("pirate.onnx_adapter")              # named "pirate" (the file's stem), or name=...
    model.generate("Hello", adapter="pirate")                # None (the default) is the base model
    model.conversation(adapter="pirate")                     # its kept cache belongs to the adapter

An adapter is ONNX Runtime's adapter format (onnxruntime.AdapterFormat): values for the slots' A and B
inputs (runtime/lora_contract.py). ONNX Runtime's RunOptions.add_active_adapter does not reach runs with an
IO binding (ONNX Runtime says so: "run_with_iobinding has active adapters specified, but won't have an
effect"), which is how the decode loop runs, so an `AdapterRunner` binds the adapter's tensors into each
generation's own binding, once: requests on other threads, with other adapters or none, never see them.

Loading checks everything before the adapter can be used (AdapterError, one line; the model keeps serving
the base and the adapters already loaded): the record beside the file (NAME.onnx_adapter.json: the file's
sha256, the base it was converted for), the format, every tensor's name, shape and dtype against the
package's slots, and finite values.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from .contract import MANIFEST_FILE
from .errors import AdapterError, InvalidParameterError
from .lora_contract import RECORD_SUFFIX, AdapterRecord, LoraSlots, model_version, parse_slots
from .package import file_sha256
from .session import ort_reason

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@dataclass
class Adapter:
    """A loaded adapter: its tensors as OrtValues (bound into runs) and where it came from."""

    name: str
    path: Path
    values: dict[str, ort.OrtValue]  # slot tensor name -> value; the arrays below keep their memory alive
    arrays: dict[str, np.ndarray]
    record: AdapterRecord | None  # None when loaded with verify=False and no record was found

    def info(self) -> dict:
        source = self.record.source if self.record else {}
        return {"name": self.name, "path": str(self.path), "tensors": len(self.values), "source": source}


def _read_record(path: Path, slots: LoraSlots, *, verify: bool) -> AdapterRecord | None:
    record_path = Path(f"{path}{RECORD_SUFFIX}")
    if not record_path.is_file():
        if verify:
            raise AdapterError(
                f"{path.name} has no {record_path.name} beside it (written by `edgelm adapter convert`); pass "
                "verify=False to load it unchecked"
            )
        return None
    try:
        data = json.loads(record_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested past Python's limit
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AdapterError(f"{record_path.name} is not valid JSON: {reason}") from None
    except OSError as e:
        raise AdapterError(f"{record_path.name} cannot be read: {e.strerror or e}") from None
    record = AdapterRecord.parse(data, record_path.name)
    if record.base_sha256 != slots.base_sha256:
        raise AdapterError(
            f"{path.name} was converted for another base model (weights {record.base_sha256[:12]}..., this package's "
            f"are {slots.base_sha256[:12]}...); convert the PEFT adapter again against this package"
        )
    if verify and file_sha256(path) != record.sha256:
        raise AdapterError(f"{path.name} does not match the sha256 in {record_path.name}: tampered or truncated")
    return record


def _read_values(path: Path, slots: LoraSlots) -> dict[str, np.ndarray]:
    try:
        adapter = ort.AdapterFormat.read_adapter(str(path))
        if adapter.get_model_version() != model_version(slots.base_sha256):
            raise AdapterError(f"{path.name} was made for another base model (its model_version differs)")
        # copied: the values are views of the reader's buffer, freed with it
        return {name: np.array(value.numpy(), copy=True) for name, value in adapter.get_parameters().items()}
    except AdapterError:
        raise
    except Exception as e:  # onnxruntime's pybind types: a truncated or foreign file
        raise AdapterError(f"{path.name} is not a readable ONNX Runtime adapter: {ort_reason(e)}") from None


def _check_values(path: Path, arrays: dict[str, np.ndarray], slots: LoraSlots, dtypes: dict[str, Any]) -> None:
    expected = slots.shapes()
    for name, array in arrays.items():
        if name not in expected:
            raise AdapterError(f"{path.name} holds {name!r}, which is not a LoRA slot of this package")
        if array.shape != expected[name]:
            raise AdapterError(
                f"{path.name}: {name} has shape {array.shape}, the package's slot is {expected[name]} (shape mismatch;"
                f" rank above the slots' {slots.max_rank}?)"
            )
        if array.dtype != dtypes.get(name, np.float32):
            raise AdapterError(f"{path.name}: {name} is {array.dtype}, the package's slot is {dtypes.get(name)}")
        if not np.isfinite(array).all():
            raise AdapterError(f"{path.name}: {name} holds NaN or inf values")
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise AdapterError(f"{path.name} has no value for {missing[0]} ({len(missing)} slot tensors missing)")


def read_adapter(path: str | Path, slots: LoraSlots, session: ort.InferenceSession, *, name: str, verify: bool):
    """An adapter file checked against the package's slots and session inputs; AdapterError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"adapter file {path} does not exist or is not a file")
    record = _read_record(path, slots, verify=verify)
    arrays = _read_values(path, slots)
    dtypes = {i.name: _DTYPES.get(i.type) for i in session.get_overridable_initializers()}
    _check_values(path, arrays, slots, dtypes)
    values = {key: ort.OrtValue.ortvalue_from_numpy(array) for key, array in arrays.items()}
    return Adapter(name, path, values, arrays, record)


class AdapterRunner:
    """The base model's Runner (runtime/runner.py) with one adapter bound into every binding it runs. Made per
    generation or conversation: it remembers the one binding it has filled."""

    def __init__(self, model, adapter: Adapter):
        self.model, self.adapter = model, adapter
        self.spec, self.session, self.device = model.spec, model.session, model.device
        self.kv_dtype, self.logits_dtype = model.kv_dtype, model.logits_dtype
        self.uses_position_ids, self.tokenizer = model.uses_position_ids, model.tokenizer
        self.context_length = model.context_length
        self._bound = None  # the binding that holds the adapter's tensors

    def encode(self, prompt):
        return self.model.encode(prompt)

    def run(self, binding) -> None:
        if binding is not self._bound:  # a cache binds a new binding when it grows
            for name, value in self.adapter.values.items():
                binding.bind_ortvalue_input(name, value)
            self._bound = binding
        self.model.run(binding)


class AdapterMixin:
    """Model's adapter registry: load_adapter, unload_adapter, adapters, and the runner for a request."""

    def _init_adapters(self) -> None:
        self._adapters: dict[str, Adapter] = {}
        self._adapters_lock = threading.Lock()
        manifest = self.spec.manifest
        self.lora_slots: LoraSlots | None = parse_slots(manifest.lora if manifest else None, MANIFEST_FILE)

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded adapters."""
        return list(self._adapters)

    def load_adapter(self, path: str | Path, name: str | None = None, *, verify: bool = True) -> str:
        """Load an .onnx_adapter file (from `edgelm adapter convert`) for this package; returns its name (the
        file's stem unless given). AdapterError when it does not fit; the model is unchanged then."""
        if self.lora_slots is None:
            raise AdapterError(
                f"the package {self.spec.folder.name} has no LoRA slots: export it with --lora-slots MODULES:RANK"
            )
        name = Path(path).stem if name is None else name
        if not isinstance(name, str) or not name:
            raise AdapterError(f"an adapter name must be a non-empty string, got {name!r}")
        adapter = read_adapter(path, self.lora_slots, self.session, name=name, verify=verify)
        with self._adapters_lock:
            self._adapters[name] = adapter  # a dict assignment: requests running keep the one they started with
        return name

    def unload_adapter(self, name: str) -> None:
        with self._adapters_lock:
            self._adapter(name)
            del self._adapters[name]

    def _adapter(self, name: str) -> Adapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            loaded = ", ".join(self._adapters) or "none"
            raise InvalidParameterError(f"no adapter named {name!r} is loaded (loaded: {loaded}); load_adapter first")
        return adapter

    def runner(self, adapter: str | None):
        """The Runner of a request: the model itself for the base (None), else an AdapterRunner."""
        if adapter is None:
            return self
        if not isinstance(adapter, str):
            raise InvalidParameterError(f"adapter must be a loaded adapter's name or None, got {adapter!r}")
        return AdapterRunner(self, self._adapter(adapter))
