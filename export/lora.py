"""LoRA at export: PEFT adapters merged into the weights, and run-time slots for adapters chosen per request.

Merge (`edgelm export BASE OUT --lora ADAPTER_DIR[:SCALE]`): W += scale * B @ A on the reference model's own
linears before the graph is built, so every family, graph and quantization mode works on the result. A GGUF
base whose blocks are kept has no float weights to add to: the linears an adapter touches are written as
fp32 from the file's dequantized values plus the adapter (the others keep their blocks); `--dequantize`
gives an all-fp32 package for `edgelm quantize`.

Slots (`--lora-slots MODULES:MAX_RANK`, or adapter folders whose modules and largest rank they take): each
slotted linear adds x @ A @ B, A and B being graph inputs with zero-size defaults (ranks 0: the base runs as
it is, at its speed) that a run may bind; runtime/lora_contract.py describes them, and `convert_adapter` writes
an ONNX Runtime adapter file of A and B for one PEFT adapter, ranks zero-padded to the slots', the scale folded
into B. Linears packed into one MatMul (Q, K, V; gate, up) share one slot: A is their A's side by side and B
holds each part's B in its own rows and columns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from edgelm.writers.package_writer import StagedFiles, write_json

from ..runtime.contract import MANIFEST_FILE, Manifest
from ..runtime.errors import AdapterError
from ..runtime.lora_contract import (
    ADAPTER_SUFFIX,
    RECORD_SUFFIX,
    AdapterRecord,
    LoraSlots,
    SlotLinear,
    model_version,
    parse_slots,
)
from ..runtime.package import file_sha256, read_package
from .decoder import Decoder
from .families import Family
from .lazy_weights import TensorLoader, is_lazy, lazy_parameter, read
from .peft_adapter import OUTPUT_LAYER, LoraWeights, PeftAdapter, read_peft_adapter

Progress = Callable[[str], None]
MAX_RANK = 1024


@dataclass
class SlotSpec:
    modules: list[str]  # module names ("q_proj", "c_attn", "mlp.c_proj") or ["all"]
    max_rank: int


def parse_slot_argument(text: str) -> SlotSpec:
    """ "q_proj,k_proj,v_proj:16" (or "all:16") -> SlotSpec; an existing folder is a PEFT adapter to take them from."""
    if Path(text).is_dir():
        return slots_from_adapters([read_peft_adapter(text)])
    modules, sep, rank = text.rpartition(":")
    names = [name.strip() for name in modules.split(",") if name.strip()]
    if not sep or not names or not rank.isdigit() or not 1 <= int(rank) <= MAX_RANK:
        raise AdapterError(
            f"--lora-slots {text!r}: expected MODULES:MAX_RANK (e.g. q_proj,v_proj:16 or all:8, rank 1 to "
            f"{MAX_RANK}) or a PEFT adapter folder"
        )
    return SlotSpec(names, int(rank))


def slots_from_adapters(adapters: list[PeftAdapter]) -> SlotSpec:
    """Slots that fit every adapter given: the modules any of them adapts, at the largest rank among them."""
    names = sorted({path.rsplit(".", 1)[-1] for adapter in adapters for path in adapter.pairs})
    return SlotSpec(names, max(rank for adapter in adapters for rank in adapter.ranks))


def merge_slot_specs(specs: list[SlotSpec]) -> SlotSpec | None:
    if not specs:
        return None
    names = sorted({name for spec in specs for name in spec.modules})
    return SlotSpec(["all"] if "all" in names else names, max(spec.max_rank for spec in specs))


# ---- merge ------------------------------------------------------------------------------------------


def packed_paths(modules: dict[str, torch.nn.Module], packed: tuple) -> dict[str, list[str]]:
    """Each checkpoint linear the model holds split (Family.lora_packed), by full path -> its parts' paths."""
    out = {}
    for name in modules:
        for whole, parts in packed:
            if name.endswith(f".{parts[0]}"):
                stem = name.removesuffix(parts[0])
                out[f"{stem}{whole}"] = [f"{stem}{part}" for part in parts]
    return out


def _linear_features(modules: dict[str, torch.nn.Module], split: dict[str, list[str]], path: str) -> tuple[int, int]:
    """(in_features, out_features) of a linear, a packed one's being its parts' together."""
    parts = [modules[part] for part in split.get(path, [path])]
    return parts[0].in_features, sum(part.out_features for part in parts)


def _split_packed(adapter: PeftAdapter, modules: dict, split: dict[str, list[str]]) -> dict[str, LoraWeights]:
    """The adapter's modules on the reference model's linears: a packed linear's B split by rows into its parts
    (A shared), as the packed weight's rows are."""
    out = {}
    for path, weights in adapter.modules.items():
        if path not in split:
            out[path] = weights
            continue
        in_features, out_features = _linear_features(modules, split, path)
        if (weights.b.shape[0], weights.a.shape[1]) != (out_features, in_features):
            raise AdapterError(
                f"LoRA adapter {adapter.name}: {path} adapts a ({weights.b.shape[0]}, {weights.a.shape[1]}) "
                f"weight but the model's is {(out_features, in_features)} (shape mismatch: an adapter for another "
                "model size?)"
            )
        rows = np.cumsum([modules[part].out_features for part in split[path]])[:-1]
        pieces = zip(split[path], np.split(weights.b, rows), strict=True)
        out |= {part: LoraWeights(weights.a, b, weights.scale) for part, b in pieces}
    return out


def merge_adapters(model: torch.nn.Module, adapters: list[PeftAdapter], *, family: str, packed: tuple = ()) -> set[str]:
    """Add every adapter's scale * B @ A to the model's linears PEFT's targeting selects (PeftAdapter.select), in
    order; returns the weights changed (checkpoint names, "model.layers.0.self_attn.q_proj.weight"). AdapterError
    before any change when a module is not a linear of this model, a shape differs, or the weight is shared
    with another module; a tied LM head is untied first (its own copy, as export's --untie), so that the input
    embedding stays the base's, as in PEFT's forward. packed: Family.lora_packed, the checkpoint's packed linears
    (Phi-3's qkv_proj) that PEFT adapts whole and the reference model holds split."""
    modules = dict(model.named_modules())
    split = packed_paths(modules, packed)
    parts = {part for names in split.values() for part in names}
    linears = {name: isinstance(m, torch.nn.Linear) for name, m in modules.items() if name not in parts}
    expanded = []
    sharing: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        sharing.setdefault(id(parameter), []).append(name)
    for adapter in adapters:
        adapter.select(linears | dict.fromkeys(split, True), model_type=family)
        for path, saved in adapter.base_weights.items():  # PEFT loads them over the model's: they must be its own
            module = modules.get(path)
            if module is None or not np.array_equal(saved, read(module.weight).float().numpy()):
                raise AdapterError(
                    f"LoRA adapter {adapter.name}: it carries its own {path} weight (PEFT's save_embedding_layers) "
                    "and it differs from this model's (a resized vocabulary?); edgelm merges only LoRA weights"
                )
        expanded.append(_split_packed(adapter, modules, split))
        for path, weights in expanded[-1].items():
            module = modules.get(path)
            if not isinstance(module, torch.nn.Linear):
                raise AdapterError(
                    f"LoRA adapter {adapter.name}: {path} is not a linear layer of this {family} model "
                    "(an adapter for another architecture?)"
                )
            shared = [name for name in sharing[id(module.weight)] if name != f"{path}.weight"]
            tied_head = path == OUTPUT_LAYER and getattr(model.config, "tie_word_embeddings", False)  # untied below
            if shared and not tied_head:
                raise AdapterError(
                    f"LoRA adapter {adapter.name}: {path} shares its weight with {shared[0]} (tied word embeddings); "
                    "merging it would change that too, so edgelm refuses it: train the adapter without "
                    f"{path.rsplit('.', 1)[-1]} in target_modules, or untie the base's embeddings first"
                )
            expected = (module.out_features, module.in_features)
            if (weights.b.shape[0], weights.a.shape[1]) != expected:
                raise AdapterError(
                    f"LoRA adapter {adapter.name}: {path} adapts a ({weights.b.shape[0]}, {weights.a.shape[1]}) "
                    f"weight but the model's is {expected} (shape mismatch: an adapter for another model size?)"
                )
    if any(OUTPUT_LAYER in adapter.modules for adapter in adapters) and model.config.tie_word_embeddings:
        head = modules[OUTPUT_LAYER]
        weight = head.weight
        head.weight = lazy_parameter(weight.loader) if is_lazy(weight) else torch.nn.Parameter(weight.detach().clone())
        model.config.tie_word_embeddings = False
    for targets in expanded:
        for path, weights in targets.items():
            modules[path].weight = _merged(modules[path].weight, weights)
    changed = [*(path for adapter in adapters for path in adapter.modules), *(p for t in expanded for p in t)]
    return {f"{path}.weight" for path in changed}  # a packed linear's parts and its own name (a GGUF file's blocks)


def _merged(weight: torch.nn.Parameter, lora) -> torch.nn.Parameter:
    """The weight plus the adapter's scale * B @ A, in float32, computed when the weight is read
    (export/lazy_weights.py): a merge holds one adapted weight at a time, not the model."""

    def load() -> torch.Tensor:
        return read(weight).to(torch.float32) + torch.from_numpy(lora.delta())

    return lazy_parameter(TensorLoader(tuple(weight.shape), load))


def without_blocks(blocks, merged: set[str]):
    """A GGUF file's blocks but for the merged weights: those linears become fp32 with the adapter added."""
    if blocks is None or not merged:
        return blocks
    return lambda name: None if name in merged else blocks(name)


# ---- slots ------------------------------------------------------------------------------------------


def _selected(template: str, names: list[str]) -> bool:
    return "all" in names or any(template.endswith(f".{name}") for name in names)


def plan_slots(model: torch.nn.Module, family: Family, spec: SlotSpec) -> LoraSlots:
    """The slots for `spec` on this model (base_sha256 left empty until the weights are written). A linear held by
    some layers only (a hybrid model's attention or convolution layers) has slots in those layers; layers whose
    linear has other parts or widths (Gemma 4's KV-shared layers: Q alone; its full layers' larger heads) get a
    slot record of their own, under the same per-layer names."""
    table = family.lora_linears
    if not table:
        raise AdapterError(f"the {family.name} family has no LoRA slots")
    known = sorted({t.rsplit(".", 1)[-1] for t, _ in table} | {".".join(t.split(".")[-2:]) for t, _ in table})
    unknown = [name for name in spec.modules if name != "all" and not any(_selected(t, [name]) for t, _ in table)]
    if unknown:
        raise AdapterError(
            f"no linear named {', '.join(unknown)} in a {family.name} model; slots can be {', '.join(known)}"
        )
    modules = dict(model.named_modules())
    split = packed_paths(modules, family.lora_packed)
    n_layer = model.config.n_layer
    columns = family.lora_columns(model) if family.lora_columns is not None else {}
    groups: dict[tuple, SlotLinear] = {}  # (linear, its parts and widths) -> the slot of the layers that match
    for i in range(n_layer):
        offsets: dict[str, int] = {}
        layer: dict[str, list[dict]] = {}
        features: dict[str, int] = {}
        for template, linear in table:  # in the packed order: a part's offset counts the parts before it
            if template % i not in modules and template % i not in split:
                continue
            features[linear], out_features = _linear_features(modules, split, template % i)
            offset = offsets.get(linear, 0)
            offsets[linear] = offset + out_features
            if not _selected(template, spec.modules):
                continue
            part = {"module": template, "offset": offset, "width": out_features}
            if template in columns:
                runs = [[first, count] for first, count in columns[template]]
                assert sum(count for _, count in runs) == out_features, f"{template}'s columns miss some of its outputs"
                part |= {"offset": runs[0][0], "columns": runs}
            layer.setdefault(linear, []).append(part)
        for linear, parts in layer.items():
            key = (linear, features[linear], offsets[linear], repr(parts))
            slot = groups.setdefault(key, SlotLinear(
                f"layers.%d.{linear}.lora_A", f"layers.%d.{linear}.lora_B", features[linear], offsets[linear], parts, []
            ))  # fmt: skip
            slot.layers.append(i)
    order = [linear for _, linear in table]
    linears = [groups[key] for key in sorted(groups, key=lambda key: (order.index(key[0]), groups[key].layers[0]))]
    for slot in linears:
        slot.layers = None if len(slot.layers) == n_layer else slot.layers
    if not linears:
        raise AdapterError(f"no layer of this {family.name} model holds {', '.join(spec.modules)}")
    return LoraSlots(spec.max_rank, list(spec.modules), n_layer, "", linears)


def add_slots(decoder: Decoder, slots: LoraSlots) -> None:
    """Mark the decoder's slotted linears: the graph adds x @ A @ B to them (export/graph.py). A linear whose
    inputs the graph feeds in another order than the checkpoint's gets that order as the slot's rows."""
    for slot in slots.linears:
        path = slot.a.split(".", 2)[2].removesuffix(".lora_A")  # "layers.%d.conv.in_proj.lora_A" -> "conv.in_proj"
        for index in slot.layer_indices(len(decoder.layers)):
            target = decoder.layers[index]
            for name in path.split("."):  # a Layer field, or a field of its mixer (ShortConv, DeltaNet)
                target = getattr(target, name)
            target.lora = (slot.a % index, slot.b % index)
            rows = _input_order(decoder.layers[index], path)
            assert index == slot.layer_indices(len(decoder.layers))[0] or rows == slot.rows, f"{path}: orders differ"
            slot.rows = rows


def _input_order(layer, path: str) -> list[int] | None:
    """The inputs of a DeltaNet's out_proj whose kept GGUF blocks take the value heads in the file's order
    (DeltaNet.out_heads): the graph gathers them so, and A's rows must follow."""
    net = layer.delta_net
    if path != "delta_net.out_proj" or net is None or net.out_heads is None:
        return None
    return (np.asarray(net.out_heads)[:, None] * net.v_dim + np.arange(net.v_dim)).ravel().tolist()


def weights_hash(manifest: Manifest) -> str:
    """What an adapter is bound to: the model file and its weights, by their sha256 in the manifest."""
    lines = sorted(f"{name} {entry['sha256']}" for name, entry in manifest.files.items() if name.startswith("model."))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# ---- convert ----------------------------------------------------------------------------------------


def _slot_tensors(slots: LoraSlots, adapter: PeftAdapter, where: str) -> dict[str, np.ndarray]:
    """Every slot tensor for this adapter: A (in, parts * R), B (parts * R, out), zero where it adapts nothing."""
    rank, used = slots.max_rank, set()
    tensors = {}
    for slot in slots.linears:
        width = len(slot.parts) * rank
        for layer in slot.layer_indices(slots.n_layer):
            a = np.zeros((slot.in_features, width), np.float32)
            b = np.zeros((width, slot.out_features), np.float32)
            for index, part in enumerate(slot.parts):
                path = part["module"] % layer
                weights = adapter.modules.get(path)
                if weights is None:
                    continue
                used.add(path)
                if weights.rank > rank:
                    raise AdapterError(f"{where}: {path} has rank {weights.rank}, above the package's slots ({rank})")
                if weights.a.shape[1] != slot.in_features or weights.b.shape[0] != part["width"]:
                    raise AdapterError(
                        f"{where}: {path} adapts a ({weights.b.shape[0]}, {weights.a.shape[1]}) weight but the "
                        f"package's is ({part['width']}, {slot.in_features}) (shape mismatch)"
                    )
                rows = slice(index * rank, index * rank + weights.rank)
                a[:, rows] = weights.a.T if slot.rows is None else weights.a.T[slot.rows]
                b[rows, _columns(part)] = weights.scale * weights.b.T
            tensors[slot.a % layer], tensors[slot.b % layer] = a, b
    missing = sorted(set(adapter.modules) - used)
    if missing:
        raise AdapterError(
            f"{where}: {missing[0]} has no LoRA slot in this package (slots: {', '.join(slots.modules)}); "
            "export the base with --lora-slots covering it"
            + (f" ({len(missing)} modules without a slot)" if len(missing) > 1 else "")
        )
    return tensors


def _columns(part: dict) -> np.ndarray:
    """The packed linear's output columns a part's outputs fill, in order."""
    runs = part.get("columns") or [[part["offset"], part["width"]]]
    return np.concatenate([np.arange(first, first + count) for first, count in runs])


def convert_adapter(
    adapter_dir: str | Path, package: str | Path, out: str | Path, *, scale: float = 1.0, overwrite: bool = False
) -> Path:
    """A PEFT adapter folder -> OUT (an .onnx_adapter file) and OUT.json, bound to `package`'s base, written
    through writers/package_writer.py's StagedFiles (no symlink written through, nothing replaced without
    overwrite, nothing inside an input). AdapterError for a package without slots or an adapter that does
    not fit them."""
    out = Path(out)
    if out.suffix != ADAPTER_SUFFIX:
        raise AdapterError(f"the adapter file's name must end in {ADAPTER_SUFFIX}, got {out.name}")
    record_path = out.with_name(f"{out.name}{RECORD_SUFFIX}")
    staged = StagedFiles([out, record_path], inputs=[adapter_dir, package], overwrite=overwrite)  # before any work
    spec = read_package(package)
    slots = parse_slots(spec.manifest.lora if spec.manifest else None, MANIFEST_FILE)
    if slots is None:
        raise AdapterError(f"{package} has no LoRA slots: export the base with --lora-slots MODULES:MAX_RANK")
    adapter = read_peft_adapter(adapter_dir, scale=scale)
    adapter.select_by_name(model_type=spec.manifest.architecture.type if spec.manifest else None)
    if adapter.base_weights:
        saved = next(iter(adapter.base_weights))
        raise AdapterError(f"LoRA adapter {adapter.name}: {saved} (a layer saved with its LoRA) has no LoRA slot; "
                           "merge this adapter at export with --lora instead")  # fmt: skip
    tensors = _slot_tensors(slots, adapter, f"LoRA adapter {adapter.name}")
    dtype = np.float16 if spec.io.kv_dtype == "float16" else np.float32  # an fp16 package's inputs are half
    writer = ort.AdapterFormat()
    writer.set_adapter_version(1)
    writer.set_model_version(model_version(slots.base_sha256))
    arrays = {name: np.ascontiguousarray(t, dtype=dtype) for name, t in tensors.items()}  # alive while written
    writer.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()})
    with staged as folder:
        writer.export_adapter(str(folder / out.name))
        record = AdapterRecord(file_sha256(folder / out.name), slots.base_sha256, slots.max_rank, adapter.record())
        write_json(folder / record_path.name, record.to_json())
    return out


# ---- export's steps -------------------------------------------------------------------------------


def read_adapters(lora: list[tuple[str | Path, float]]) -> list[PeftAdapter]:
    """The adapters to merge, read (and checked) before the checkpoint is."""
    return [read_peft_adapter(folder, scale=scale) for folder, scale in lora]


def apply_lora(source, adapters: list[PeftAdapter], *, keeps_blocks: bool, progress: Progress) -> None:
    """Merge the adapters into the source's reference model; kept GGUF blocks of merged linears are dropped
    (keeps_blocks: whether the package would keep a GGUF file's blocks at all)."""
    if not adapters:
        return
    merged = merge_adapters(source.model, adapters, family=source.family.name, packed=source.family.lora_packed)
    for adapter in adapters:
        ranks = sorted({w.rank for w in adapter.modules.values()})
        left_out = f" ({len(adapter.ignored)} modules not targeted, left out)" if adapter.ignored else ""
        progress(f"      merged LoRA adapter {adapter.name}: {len(adapter.modules)} linears, rank "
                 f"{'/'.join(map(str, ranks))}, scale {adapter.user_scale:g}{left_out}")  # fmt: skip
    if source.blocks is not None:
        source.blocks = without_blocks(source.blocks, merged)
        if keeps_blocks:
            progress(f"      the {len(merged)} GGUF weights the adapters change are fp32 (the rest keep their blocks)")


def lora_record(adapters: list[PeftAdapter], slots: LoraSlots | None) -> dict | None:
    """The manifest's `lora`: merged adapters (sha256, scale, ranks) and the slots (runtime/lora_contract.py)."""
    if not adapters and slots is None:
        return None
    record: dict = {"merged": [adapter.record() for adapter in adapters]}
    if slots is not None:
        record["slots"] = slots.to_json()
    return record


def finish_lora(manifest: Manifest) -> None:
    """Once the package's files are hashed: the slots' base_sha256, which adapters are bound to."""
    if manifest.lora and manifest.lora.get("slots"):
        manifest.lora["slots"]["base_sha256"] = weights_hash(manifest)
