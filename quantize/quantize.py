"""Quantize a model package into a new one: read the package, run a recipe (quantize/recipes.py) on
its model, and write a complete new package atomically, with the derived manifest (precision and
recipe recorded) and, given held-out text, the accuracy report against the fp32 package.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import NoReturn

import numpy as np

from edgelm.writers.package_writer import StagedOutput, list_files, write_json
from edgelm.writers.version import __version__

from ..runtime import PackageError, load
from ..runtime.contract import MANIFEST_FILE
from ..runtime.files import read_text
from ..runtime.onnx_external import external_data_locations
from ..runtime.package import read_package
from ..runtime.text import Tokenizer
from .calibration import DecoderCalibrationReader, PackageFacts
from .evaluate import evaluate_package, text_chunks
from .modes import CALIBRATION_METHODS, MODES
from .recipes import RECIPES, Options
from .weights import SourceModel

MIN_CALIBRATION_TOKENS = 256
__all__ = ["RECIPES", "quantize_package"]


def _calibration_ids(path: str | Path | None, tokenizer) -> np.ndarray:
    if path is None:
        raise ValueError("static quantization needs calibration text: pass --calibration-text FILE")
    if tokenizer is None:
        raise PackageError("static calibration reads text, and this package has no tokenizer.json")
    path = Path(path)
    ids = np.array(tokenizer.encode(read_text(path, "calibration text")), dtype=np.int64)
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise ValueError(
            f"calibration text {path} is too short: {len(ids)} tokens, need at least {MIN_CALIBRATION_TOKENS}"
        )
    return ids


SMOKE_TOKENS = 16  # the prompt on which every quantized package must give finite logits


def _finite_logits(model) -> bool:
    """Whether a package's logits are finite on a short fixed prompt: the least a package must do to generate."""
    ids = np.random.default_rng(0).integers(0, model.vocab_size, (1, min(SMOKE_TOKENS, model.context_length)))
    return bool(np.isfinite(model.forward(ids)[0]).all())


def _check_weights(model_path: Path) -> None:
    """Refuse NaN or inf in a float weight of the source, naming it: the package cannot generate, and ONNX
    Runtime's quantizers stop on it with an assertion. Reads the weights file a slab at a time."""
    import onnx

    source = SourceModel(model_path)
    for name, tensor in source.initializers.items():
        if tensor.data_type != onnx.TensorProto.FLOAT:
            continue
        for start, stop in source.slabs(name):
            values = source.rows(name, start, stop)
            # the sum is non-finite where a value is (and where it overflows: the mask confirms), at a tenth of
            # its cost
            with np.errstate(over="ignore"):
                finite = np.isfinite(np.sum(values)) or np.isfinite(values).all()
            if not finite:
                raise PackageError(
                    f"weight {name!r} of {model_path.parent.name} holds NaN or inf values: the package cannot "
                    "generate; re-export it from a checkpoint without them"
                )


def _non_finite(report: dict) -> list[str]:
    """The accuracy report's figures that are NaN or inf, as "name value"."""
    return [f"{key} {value}" for key, value in report.items() if isinstance(value, float) and not math.isfinite(value)]


def _refuse(package: Path, source, figures: list[str]) -> NoReturn:
    """Quantize never leaves a package whose logits are not finite; a source that already gives them is named."""
    source = source if source is not None else load(package, provider="cpu")
    if any(figure.startswith("reference_") for figure in figures) or not _finite_logits(source):
        raise PackageError(f"{package} gives logits that are not finite (NaN or inf): it cannot generate; re-export it")
    raise RuntimeError(
        f"the quantized model's logits are not finite ({', '.join(figures)}): this mode does not work for this model"
    )


def _read_source(package: Path):
    """The fp32 source package's spec and its external weight files; refuses what quantize cannot take."""
    spec = read_package(package)  # verifies every file's sha256
    if spec.manifest is None:
        raise PackageError(f"{package} is not an edgelm package (no {MANIFEST_FILE}); export it with edgelm first")
    if spec.manifest.recipe.get("mode") == "gguf":  # re-rounding the file's blocks would only add error
        raise PackageError(
            f"{package} keeps its GGUF file's own quantized blocks ({spec.precision}); to quantize another way, "
            "export the file with --dequantize and quantize that fp32 package"
        )
    if spec.precision != "fp32":
        raise PackageError(f"{package} is already quantized ({spec.precision}); quantize the fp32 package instead")
    weights = sorted(set(external_data_locations(spec.model_path)))  # model.onnx.data; none in older packages
    _check_weights(spec.model_path)
    return spec, weights


def _copy_other_files(spec, package: Path, staging: Path, weights: list[str]) -> None:
    """Copy the source's files the recipe did not write; its weights are not copied: the recipe wrote its own."""
    for name in spec.manifest.files:
        if name != spec.model_path.name and name not in weights and not (staging / name).exists():
            shutil.copyfile(package / name, staging / name)


def _derive_manifest(spec, package: Path, staging: Path, mode: str, facts: dict, weights: list[str]):
    """The new package's manifest: the source's, with the mode's precision, the recipe's facts and provenance."""
    model_file = spec.model_path.name
    manifest = spec.manifest.derive(
        precision=MODES[mode].precision,
        recipe={
            **facts,
            "tool": f"edgelm {__version__}",
            "source_package": package.name,
            "source_model_sha256": spec.manifest.files[model_file]["sha256"],
            # the source's weights (model.onnx.data): the graph file alone no longer identifies them
            "source_weights_sha256": {name: spec.manifest.files[name]["sha256"] for name in weights},
        },
        evaluation=None,
    )
    manifest.io.kv_dtype = RECIPES[mode].kv_dtype
    manifest.files = list_files(staging)
    write_json(staging / MANIFEST_FILE, manifest.to_json())
    return manifest


def _evaluate(staging: Path, manifest, eval_text, *, package: Path, out_dir: Path, source, progress) -> None:
    """Measure the staged package against the source on eval_text and record the report in its manifest."""
    progress(f"evaluating on {eval_text} against {package}")
    report = evaluate_package(staging, eval_text, reference=source)
    if _non_finite(report):
        _refuse(package, source, _non_finite(report))
    report["package"] = out_dir.name
    report["reference"] = package.name
    manifest.evaluation = report
    write_json(staging / MANIFEST_FILE, manifest.to_json())
    progress(
        f"  perplexity x{report['perplexity_ratio']:.4f}, top-1 agreement "
        f"{100 * report['top1_agreement']:.2f}%, KL {report['mean_kl_nats']:.5f}, size "
        f"x{report['size_ratio']:.3f}"
    )


def _calibration(recipe, spec, text: str | Path | None, *, samples: int):
    """The calibration data reader a calibrated recipe runs on (None for the others): its feeds are run by the
    recipe's own session (quantize/calibration.py), so no session of the source is built for them."""
    if not recipe.calibrated:
        return None
    tokenizer = Tokenizer(spec.tokenizer_path) if spec.tokenizer_path else None
    return DecoderCalibrationReader(PackageFacts.of(spec), _calibration_ids(text, tokenizer), samples=samples)


def quantize_package(
    package: str | Path,
    out_dir: str | Path,
    *,
    mode: str,
    calibration_text: str | Path | None = None,
    calibration_method: str = "percentile",
    calibration_samples: int = 32,
    per_channel: bool | None = None,
    block_size: int = 32,
    int4_lm_head: str = "int8",
    eval_text: str | Path | None = None,
    evaluate: bool = True,
    overwrite: bool = False,
    progress=print,
) -> dict:
    """Read a package, write its quantized copy to out_dir; returns the new manifest (as JSON)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if calibration_method not in CALIBRATION_METHODS:
        raise ValueError(f"unknown calibration method {calibration_method!r}; valid: {', '.join(CALIBRATION_METHODS)}")
    recipe = RECIPES[mode]
    package, out_dir = Path(package), Path(out_dir)
    staged = StagedOutput(out_dir, inputs=[package, calibration_text, eval_text], overwrite=overwrite)
    spec, weights = _read_source(package)
    if mode == "fp16" and spec.arch.kv.kv_source is not None:  # seen on Gemma 4's fused graph with KV sharing
        raise ValueError(
            "fp16 of a package whose layers share a cache (edgelm.json architecture.kv_source) is refused: ONNX "
            "Runtime 1.32 crashes optimizing that graph in fp16; use int4, int8-weight-only or dynamic"
        )
    evaluated = evaluate and eval_text is not None and recipe.evaluated
    # the fp32 package runs only to be compared with: loading it costs its size in memory
    source = load(package, provider="cpu") if evaluated else None
    options = Options(
        per_channel=True if per_channel is None else per_channel,
        block_size=block_size,
        int4_lm_head=int4_lm_head,
        calibration_method=calibration_method,
        calibration=_calibration(recipe, spec, calibration_text, samples=calibration_samples),
    )
    if evaluated:
        for _ in text_chunks(eval_text, what="eval text"):  # text that is not UTF-8 fails now, not after the work
            pass

    progress(f"quantizing {package} -> {out_dir} ({mode})")
    with staged as staging:
        facts = recipe.run(spec.model_path, staging / spec.model_path.name, options)
        _copy_other_files(spec, package, staging, weights)
        manifest = _derive_manifest(spec, package, staging, mode, facts, weights)
        if recipe.evaluated and not _finite_logits(load(staging, provider="cpu", verify=False)):  # fp16: GPUs only
            _refuse(package, source, [f"NaN or inf on a {SMOKE_TOKENS}-token prompt"])
        if evaluated:
            _evaluate(staging, manifest, eval_text, package=package, out_dir=out_dir, source=source, progress=progress)
    progress(f"wrote {out_dir} ({sum(f['bytes'] for f in manifest.files.values()) / 1e6:.2f} MB)")
    return manifest.to_json()
