"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) into plain arrays.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") changes a linear's
weight W (out, in) by scale * B @ A, with A (r, in) and B (out, r). PEFT stores A and B as nn.Linear weights
under `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight` whatever the layer's layout (GPT-2's
Conv1D included: fan_in_fan_out only says how PEFT adds the product to a Conv1D's (in, out) weight), and the
scale as lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (Kalajdzievski 2023); rank_pattern and
alpha_pattern override r and lora_alpha per module, matched as PEFT matches them (peft.utils.other
get_pattern_key). edgelm multiplies that by the user's own scale, as llama.cpp's --lora-scaled does.

What a plain LoRA cannot be, edgelm refuses with a one-line AdapterError: DoRA, LoRA biases, embedding
adapters, modules_to_save (whole replaced layers), other PEFT types, non-finite weights.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runtime.errors import AdapterError
from ..runtime.files import check_file
from ..runtime.package import file_sha256
from .checkpoint import read_json

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass
class LoraWeights:
    """One adapted linear: delta W (out, in) = scale * b @ a."""

    a: np.ndarray  # (r, in) float32
    b: np.ndarray  # (out, r) float32
    scale: float  # alpha / r (or / sqrt(r)) times the user's scale

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self) -> np.ndarray:
        """scale * B @ A, (out, in), in float64 then float32 (the merge's one rounding)."""
        return (self.scale * (self.b.astype(np.float64) @ self.a.astype(np.float64))).astype(np.float32)


@dataclass
class PeftAdapter:
    name: str  # the folder's name
    sha256: str  # over adapter_config.json and adapter_model.safetensors
    user_scale: float
    config: dict  # the facts the manifest records: r, lora_alpha, use_rslora, target_modules
    modules: dict[str, LoraWeights] = field(default_factory=dict)  # module path ("model.layers.0.self_attn.q_proj")

    def record(self) -> dict:
        """What a package's manifest says of this adapter."""
        ranks = sorted({w.rank for w in self.modules.values()})
        return {"adapter": self.name, "sha256": self.sha256, "scale": self.user_scale, "ranks": ranks,
                "modules": len(self.modules), **self.config}  # fmt: skip


def parse_lora_argument(text: str) -> tuple[Path, float]:
    """ "ADAPTER_DIR[:SCALE]" -> (folder, scale); a colon in a path is kept when what follows is no number."""
    folder, sep, scale = text.rpartition(":")
    if sep and folder:
        try:
            value = float(scale)
        except ValueError:
            return Path(text), 1.0
        if not math.isfinite(value):
            raise AdapterError(f"the LoRA scale in {text!r} must be a finite number")
        return Path(folder), value
    return Path(text), 1.0


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    config = read_json(path, "LoRA adapter config", error=AdapterError)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA; edgelm merges LoRA adapters")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases"), ("modules_to_save", "modules_to_save")):
        if config.get(key):
            raise AdapterError(f"{path}: {what} ({key}) is not supported; only plain LoRA weights can be used")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise AdapterError(f"{path}: {key} must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterError(f"{path}: {key} must be an object")
    return config


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    check_file(path, "LoRA adapter weights", error=AdapterError)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AdapterError(f"{path} is not a readable safetensors file: {reason}") from None


def _module_tensors(tensors: dict[str, np.ndarray], where: Path) -> dict[str, dict[str, np.ndarray]]:
    """module path -> {"A": (r, in), "B": (out, r)} float32; any other tensor is refused by name."""
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        if not key.startswith(PREFIX) or not key.endswith(SUFFIXES):
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA A/B weight (embedding adapters, DoRA and "
                               "saved modules are not supported)")  # fmt: skip
        module, part = key[len(PREFIX) : -len(".weight")].rsplit(".", 1)
        array = np.asarray(tensor, dtype=np.float32)
        if array.ndim != 2:
            raise AdapterError(f"{where}: {key} has shape {array.shape}; a LoRA weight is a matrix")
        if not np.isfinite(array).all():
            raise AdapterError(f"{where}: {key} holds NaN or inf values")
        modules.setdefault(module, {})["A" if part == "lora_A" else "B"] = array
    for module, pair in modules.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: {module} has lora_{next(iter(pair))} but not the other half")
        if pair["A"].shape[0] != pair["B"].shape[1]:
            raise AdapterError(
                f"{where}: {module} lora_A {pair['A'].shape} and lora_B {pair['B'].shape} disagree on the rank"
            )
    if not modules:
        raise AdapterError(f"{where} holds no LoRA weights")
    return modules


def read_peft_adapter(folder: str | Path, *, scale: float = 1.0) -> PeftAdapter:
    """A PEFT LoRA folder's weights and scales; AdapterError (one line) for anything edgelm cannot apply."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(
            f"{folder} is not a folder; a LoRA adapter is a folder with {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    config = _read_config(folder)
    weights = folder / WEIGHTS_FILE
    pairs = _module_tensors(_read_tensors(weights), weights)
    rslora = bool(config.get("use_rslora"))
    adapter = PeftAdapter(
        name=folder.resolve().name,
        sha256=hashlib.sha256(f"{file_sha256(folder / CONFIG_FILE)} {file_sha256(weights)}".encode()).hexdigest(),
        user_scale=float(scale),
        config={
            "r": config["r"],
            "lora_alpha": config["lora_alpha"],
            "use_rslora": rslora,
            "target_modules": config.get("target_modules"),
        },  # fmt: skip
    )
    for module, pair in pairs.items():
        rank = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        if pair["A"].shape[0] != rank:
            raise AdapterError(
                f"{weights}: {module} has rank {pair['A'].shape[0]} but {CONFIG_FILE} says r = {rank} (shape mismatch)"
            )
        base = alpha / math.sqrt(rank) if rslora else alpha / rank
        adapter.modules[module] = LoraWeights(pair["A"], pair["B"], float(base * scale))
    return adapter
