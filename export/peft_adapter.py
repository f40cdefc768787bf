"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) into plain arrays.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") changes a linear's
weight W (out, in) by scale * B @ A, with A (r, in) and B (out, r). PEFT stores A and B as nn.Linear weights
under `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight` whatever the layer's layout (GPT-2's
Conv1D included: fan_in_fan_out only says how PEFT adds the product to a Conv1D's (in, out) weight), and the
scale as lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (Kalajdzievski 2023); rank_pattern and
alpha_pattern override r and lora_alpha per module, matched as PEFT matches them (peft.utils.other
get_pattern_key). edgelm multiplies that by the user's own scale, as llama.cpp's --lora-scaled does.

Which modules an adapter changes is PEFT's choice, not the file's: `select` applies PEFT's own rule
(peft.tuners.tuners_utils check_target_module_exists: target_modules as names, a regex or "all-linear",
PEFT's per-model default when absent; layers_to_transform with layers_pattern; exclude_modules) to the
model's module names, and the file's weights for modules it does not select are left out, as PEFT leaves
them out when it loads the adapter. Every pattern runs through export/safe_regex.py (no backtracking).

What a plain LoRA cannot be, edgelm refuses with a one-line AdapterError: DoRA, LoRA biases, embedding
adapters, modules_to_save (whole replaced layers), other PEFT types, non-finite weights.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runtime.errors import AdapterError
from ..runtime.files import check_file
from ..runtime.package import file_sha256
from .checkpoint import read_json
from .safe_regex import Pattern, PatternError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
SUFFIXES = (".lora_A.weight", ".lora_B.weight")
BASE_SUFFIX = ".base_layer.weight"  # PEFT's save_embedding_layers: an LM head's own weight saved with its LoRA
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear but the output layer
OUTPUT_LAYER = "lm_head"  # the output layer's module name in every family's reference model
# PEFT's targets when target_modules is absent (peft.utils.constants TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
DEFAULT_TARGETS = {"gpt2": ["c_attn"], **{t: ["q_proj", "v_proj"] for t in ("llama", "mistral", "qwen2", "qwen3",
                                                                            "gemma3_text")}}  # fmt: skip
MAX_NAME = 1000  # characters in a tensor name: what the patterns are matched against
MAX_PATTERNS = 1000  # keys of rank_pattern and alpha_pattern, entries of target_modules and exclude_modules
MAX_STATES = 4_000  # NFA states of a config's patterns together (export/safe_regex.py): bounds the matching work
LAYER_NAME = re.compile(r"[\w.]{1,200}")  # a layers_pattern edgelm runs with re: a module name, no quantifiers


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
class Targeting:
    """adapter_config.json's choice of modules, checked; `selects` is PEFT's check_target_module_exists."""

    target_modules: list[str] | Pattern | None  # names (a module path's last parts), a regex, or PEFT's default
    all_linear: bool  # target_modules "all-linear"
    exclude_modules: list[str] | Pattern | None
    layers_to_transform: list[int] | int | None
    layers_pattern: list[str] | None

    def resolve(self, modules: dict[str, bool], model_type: str | None, where: str) -> list[str] | set[str] | Pattern:
        """The targets for this model: modules maps every module path to whether it is a linear."""
        if self.all_linear:  # full paths, so a set: PEFT matches them whole, before layers_to_transform
            return {name for name, linear in modules.items() if linear and name != OUTPUT_LAYER}
        if self.target_modules is None:
            if model_type not in DEFAULT_TARGETS:
                raise AdapterError(f"{where}: target_modules is not set and PEFT has no default for {model_type!r}")
            return DEFAULT_TARGETS[model_type]
        return self.target_modules

    def selects(self, key: str, targets: list[str] | set[str] | Pattern) -> bool:
        exclude = self.exclude_modules
        if isinstance(exclude, Pattern):
            if exclude.fullmatch(key):
                return False
        elif exclude and (key in exclude or any(key.endswith(f".{name}") for name in exclude)):
            return False
        if isinstance(targets, Pattern):
            return targets.fullmatch(key)
        if key in targets:
            return True
        found = any(key.endswith(f".{name}") for name in targets)
        indexes = self.layers_to_transform
        if not found or indexes is None or (isinstance(indexes, list) and not indexes):
            return found
        match = None
        if not self.layers_pattern:  # the first numbered part after some name: "model.layers.3." -> 3
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for pattern in self.layers_pattern:  # plain names (LAYER_NAME): no backtracking blowup
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
                if match is not None:
                    break
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == indexes if isinstance(indexes, int) else index in indexes


@dataclass
class PeftAdapter:
    name: str  # the folder's name
    sha256: str  # over adapter_config.json and adapter_model.safetensors
    user_scale: float
    config: dict  # the facts the manifest records: r, lora_alpha, use_rslora, target_modules
    pairs: dict[str, dict[str, np.ndarray]]  # every module the file holds: {"A": (r, in), "B": (out, r)}
    targeting: Targeting
    rank_pattern: dict[str, tuple[Pattern, int]]
    alpha_pattern: dict[str, tuple[Pattern, float]]
    where: str  # the weights file, for messages
    base_weights: dict[str, np.ndarray] = field(default_factory=dict)  # a layer's own weight, saved beside its LoRA
    modules: dict[str, LoraWeights] = field(default_factory=dict)  # module path ("model.layers.0.self_attn.q_proj")
    ignored: list[str] = field(default_factory=list)  # modules the file holds that the targeting leaves out

    def select(self, modules: dict[str, bool], *, model_type: str | None) -> None:
        """Keep the file's weights for the modules PEFT would adapt on this model (modules: every module path
        -> whether it is a linear), with their scales; AdapterError when that leaves nothing."""
        targets = self.targeting.resolve(modules, model_type, f"LoRA adapter {self.name}")
        chosen = [name for name in self.pairs if name in modules and self.targeting.selects(name, targets)]
        self.ignored = sorted(set(self.pairs) - set(chosen))
        if not chosen:
            raise AdapterError(
                f"LoRA adapter {self.name}: its target_modules select none of the {len(self.pairs)} modules its "
                f"weights are for{' on this model' if set(self.pairs) - set(modules) else ''} (PEFT would leave "
                "them all out); check target_modules, layers_to_transform and exclude_modules"
            )
        if self.ignored:
            warnings.warn(
                f"LoRA adapter {self.name}: {len(self.ignored)} of the file's modules are not selected by its "
                f"target_modules / layers_to_transform / exclude_modules ({self.ignored[0]}, ...) and are left out, "
                "as PEFT leaves them out",
                stacklevel=2,
            )
        rslora = bool(self.config["use_rslora"])
        self.modules = {}
        for module in chosen:
            pair = self.pairs[module]
            rank = _pattern_value(self.rank_pattern, module, self.config["r"])
            alpha = _pattern_value(self.alpha_pattern, module, self.config["lora_alpha"])
            if pair["A"].shape[0] != rank:
                raise AdapterError(
                    f"{self.where}: {module} has rank {pair['A'].shape[0]} but {CONFIG_FILE} says r = {rank} "
                    "(shape mismatch)"
                )
            base = alpha / math.sqrt(rank) if rslora else alpha / rank
            self.modules[module] = LoraWeights(pair["A"], pair["B"], float(base * self.user_scale))

    def select_by_name(self, *, model_type: str | None) -> None:
        """select() where only the adapter's own module paths are known (a package's slots): each a linear."""
        self.select(dict.fromkeys(self.pairs, True), model_type=model_type)

    @property
    def ranks(self) -> list[int]:
        """The ranks of the file's weights (before selection)."""
        return sorted({pair["A"].shape[0] for pair in self.pairs.values()})

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


def _pattern_value(patterns: dict[str, tuple[Pattern, float]], module: str, default: float) -> float:
    r"""PEFT's rank_pattern / alpha_pattern lookup (get_pattern_key): the first key whose regex matches the end of
    the module path, `(.*\.)?(KEY)$` from its start."""
    for pattern, value in patterns.values():
        if pattern.match(module):
            return value
    return default


def _number(value: object, *, integer: bool) -> bool:
    """A positive finite number (an integer where integer), not a bool."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return math.isfinite(value) and value > 0


def _patterns(config: dict, key: str, path: Path, *, integer: bool) -> dict[str, tuple[Pattern, float]]:
    """rank_pattern / alpha_pattern: each key compiled as PEFT wraps it, each value checked."""
    patterns = config.get(key) or {}
    if not isinstance(patterns, dict):
        raise AdapterError(f"{path}: {key} must be an object of module patterns and numbers")
    if len(patterns) > MAX_PATTERNS:
        raise AdapterError(f"{path}: {key} has {len(patterns)} entries; edgelm reads at most {MAX_PATTERNS}")
    what = "a positive integer" if integer else "a positive finite number"
    out = {}
    for name, value in patterns.items():
        if not _number(value, integer=integer):
            raise AdapterError(f"{path}: {key}[{name[:80]!r}] must be {what}, got {str(value)[:40]!r}")
        out[name] = (_compile(rf"(.*\.)?({name})$", name, key, path), value)
    return out


def _compile(pattern: str, shown: str, key: str, path: Path) -> Pattern:
    try:
        Pattern(shown)  # the key alone first: its own error positions
        return Pattern(pattern, plain=shown)
    except PatternError as e:
        raise AdapterError(f"{path}: {key} pattern {shown[:80]!r}: {e}") from None


def _names(config: dict, key: str, path: Path) -> list[str] | Pattern | None:
    """target_modules / exclude_modules: absent, a list of module names, or one regex matched whole."""
    value = config.get(key)
    if value is None or isinstance(value, str):
        return None if value is None else _compile(value, value, key, path)
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise AdapterError(f"{path}: {key} must be a list of module names or a regular expression")
    if len(value) > MAX_PATTERNS:
        raise AdapterError(f"{path}: {key} has {len(value)} entries; edgelm reads at most {MAX_PATTERNS}")
    return value


def _targeting(config: dict, path: Path) -> Targeting:
    """PEFT's LoraConfig checks (peft/tuners/lora/config.py __post_init__) and the values edgelm can run."""
    if config.get("target_parameters"):
        raise AdapterError(f"{path}: target_parameters (LoRA on bare parameters) is not supported")
    targets = config.get("target_modules")
    all_linear = isinstance(targets, str) and targets.lower() == ALL_LINEAR
    layers, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if isinstance(targets, str) and (layers is not None or pattern is not None):  # "all-linear" too
        raise AdapterError(f"{path}: layers_to_transform and layers_pattern cannot be used when target_modules is "
                           "a string (a regular expression or all-linear; PEFT refuses it too)")  # fmt: skip
    if pattern and layers is None:
        raise AdapterError(f"{path}: layers_pattern needs layers_to_transform (PEFT refuses it too)")
    is_index = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if not (layers is None or is_index(layers) or (isinstance(layers, list) and all(map(is_index, layers)))):
        raise AdapterError(f"{path}: layers_to_transform must be a layer index or a list of them")
    patterns = [pattern] if isinstance(pattern, str) else pattern
    if patterns is not None and not (isinstance(patterns, list) and all(isinstance(p, str) for p in patterns)):
        raise AdapterError(f"{path}: layers_pattern must be a name or a list of names")
    for name in patterns or []:
        if not LAYER_NAME.fullmatch(name):
            raise AdapterError(f"{path}: layers_pattern {name[:80]!r} must be the name of the layers' module list "
                               "(letters, digits, _ and .), e.g. layers or h")  # fmt: skip
    return Targeting(
        target_modules=None if all_linear else _names(config, "target_modules", path),
        all_linear=all_linear,
        exclude_modules=_names(config, "exclude_modules", path),
        layers_to_transform=layers,
        layers_pattern=patterns,
    )


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    config = read_json(path, "LoRA adapter config", error=AdapterError)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA; edgelm merges LoRA adapters")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases"), ("modules_to_save", "modules_to_save")):
        if config.get(key):
            raise AdapterError(f"{path}: {what} ({key}) is not supported; only plain LoRA weights can be used")
    if not _number(config.get("r"), integer=True):
        raise AdapterError(f"{path}: r must be a positive integer, got {str(config.get('r'))[:40]!r}")
    if not _number(config.get("lora_alpha"), integer=False):
        raise AdapterError(f"{path}: lora_alpha must be a positive number, got {str(config.get('lora_alpha'))[:40]!r}")
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


def _module_tensors(tensors: dict[str, np.ndarray], where: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(module path -> {"A": (r, in), "B": (out, r)} float32, module path -> a saved base weight); any other
    tensor is refused by name."""
    modules: dict[str, dict[str, np.ndarray]] = {}
    bases: dict[str, np.ndarray] = {}
    for key, tensor in tensors.items():
        if key.startswith(PREFIX) and key.endswith(BASE_SUFFIX) and len(key) <= MAX_NAME:
            bases[key[len(PREFIX) : -len(BASE_SUFFIX)]] = np.asarray(tensor)
            continue
        if not key.startswith(PREFIX) or not key.endswith(SUFFIXES):
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA A/B weight (embedding adapters, DoRA and "
                               "saved modules are not supported)")  # fmt: skip
        if len(key) > MAX_NAME:
            raise AdapterError(f"{where}: tensor name {key[:80]!r}... is over {MAX_NAME} characters")
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
    return modules, bases


def read_peft_adapter(folder: str | Path, *, scale: float = 1.0) -> PeftAdapter:
    """A PEFT LoRA folder's weights and scales; AdapterError (one line) for anything edgelm cannot apply."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(
            f"{folder} is not a folder; a LoRA adapter is a folder with {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise AdapterError(f"the LoRA scale must be a finite number, got {scale!r}")
    config = _read_config(folder)
    path = folder / CONFIG_FILE
    targeting = _targeting(config, path)
    rank_pattern = _patterns(config, "rank_pattern", path, integer=True)
    alpha_pattern = _patterns(config, "alpha_pattern", path, integer=False)
    compiled = [p for p, _ in (*rank_pattern.values(), *alpha_pattern.values())]
    compiled += [p for p in (targeting.target_modules, targeting.exclude_modules) if isinstance(p, Pattern)]
    if sum(p.states for p in compiled) > MAX_STATES:
        raise AdapterError(f"{path}: its rank_pattern, alpha_pattern, target_modules and exclude_modules patterns are "
                           f"too large together (over {MAX_STATES} states); use fewer or simpler ones")  # fmt: skip
    weights = folder / WEIGHTS_FILE
    pairs, base_weights = _module_tensors(_read_tensors(weights), weights)
    targets = config.get("target_modules")
    return PeftAdapter(
        name=folder.resolve().name,
        sha256=hashlib.sha256(f"{file_sha256(path)} {file_sha256(weights)}".encode()).hexdigest(),
        user_scale=float(scale),
        config={
            "r": config["r"],
            "lora_alpha": config["lora_alpha"],
            "use_rslora": bool(config.get("use_rslora")),
            "target_modules": targets[:MAX_PATTERNS] if isinstance(targets, (str, list)) else None,
        },  # fmt: skip
        pairs=pairs,
        base_weights=base_weights,
        targeting=targeting,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        where=str(weights),
    )
