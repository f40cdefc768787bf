"""`edgelm info` in words: what a package's weights really are, what its export check proved, how accurate a
quantized package measured, and how chat samples with it. The manifest's records (runtime/contract.py) are read as
export/onnx_export.py and quantize/ write them; `edgelm info --json` prints them as they are."""

from __future__ import annotations

from .options import describe_sampling

QUANTIZED_BY = ("dynamic", "static", "int4", "int8-weight-only", "fp16")  # quantize's recipe modes


def lines(info: dict, manifest) -> list[tuple[str, str]]:
    """(key, text) lines added to info's facts: source, weights, export_check, accuracy, sampling."""
    recipe = info.get("recipe") or {}
    found = [("source", source(manifest, recipe)), ("weights", weights(info["precision"], recipe))]
    found.append(("export_check", export_check(info.get("parity"), recipe)))
    found.append(("accuracy", accuracy(info.get("evaluation"), recipe)))
    found.append(("sampling", sampling(manifest, chat=bool(info.get("chat_template")))))
    return [(key, text) for key, text in found if text]


def source(manifest, recipe: dict) -> str | None:
    if manifest is None:
        return None
    if recipe.get("mode") in QUANTIZED_BY:
        return f"quantized from the package {recipe.get('source_package', '?')}"
    checkpoint, digest = manifest.source.get("checkpoint"), manifest.source.get("sha256")
    if not checkpoint:
        return None
    return f"exported from {checkpoint}" + (f" (sha256 {digest[:12]}...)" if isinstance(digest, str) else "")


def _bits(kept: dict) -> str:
    """{"int4": 16, "int8": 104} -> "4-bit 16 linears, 8-bit 104 linears"."""
    return ", ".join(f"{name.removeprefix('int')}-bit {count} linears" for name, count in kept.items() if count)


def weights(precision: str, recipe: dict) -> str | None:
    """What the weights are, where the precision alone (the widest-spread label) would mislead."""
    mode = recipe.get("mode")
    if mode == "gguf":
        kept = _bits(recipe.get("kept_bits") or {}) or "no linears"
        floats = recipe.get("float_linears") or 0
        types = sorted((recipe.get("types") or {}).items(), key=lambda item: -item[1])
        op = "as the file stores them, ai.edgelm MatMulPacked" if recipe.get("storage") == "packed" else "MatMulNBits"
        text = f"the GGUF file's own blocks ({op}): {kept}" + (f", {floats} float" if floats else "")
        text += f"; LM head {_width(recipe.get('lm_head'))}"
        if "embedding" in recipe:
            text += f", embedding {_width(recipe['embedding'])}"
        return text + "; the file's tensors: " + ", ".join(f"{kind} {count}" for kind, count in types)
    if mode in ("int4", "int8-weight-only"):
        return (
            f"int{recipe.get('bits')} blocks of {recipe.get('block_size')} (MatMulNBits, {recipe.get('algorithm')}), "
            f"LM head {recipe.get('lm_head')}; activations int8 at run time (accuracy level "
            f"{recipe.get('accuracy_level')})"
        )
    if mode in ("dynamic", "static"):
        return f"{recipe.get('weights')} weights; activations {recipe.get('activations')}"
    if mode == "fp16":
        return f"fp16 ({recipe.get('note')})"
    return None  # fp32, or a recipe this does not know: the precision and recipe lines say it


def _width(label: object) -> str:
    """ "int8" -> "8-bit"; other labels as they are."""
    text = str(label)
    return f"{text.removeprefix('int')}-bit" if text.startswith("int") and text[3:].isdigit() else text


def export_check(parity: dict | None, recipe: dict) -> str | None:
    """The export's ONNX Runtime vs PyTorch check, explained. A quantized package carries its source's record, which
    says nothing of its own weights: then the line says so and points at the accuracy line."""
    if not isinstance(parity, dict) or not isinstance(parity.get("max_abs_logit_diff"), (int, float)):
        return None
    if recipe.get("mode") in QUANTIZED_BY:
        return f"the one recorded is its source's ({recipe.get('source_package', '?')}); quantizing changed the " + (
            "weights since: see accuracy"
        )
    difference, tolerance = parity["max_abs_logit_diff"], parity.get("tolerance")
    verdict = "passed" if isinstance(tolerance, (int, float)) and difference <= tolerance else "FAILED"
    steps, batch = parity.get("decode_steps", "?"), parity.get("batch", "?")
    where = f"ONNX Runtime against {parity.get('reference', 'PyTorch')} on a padded batch of {batch}, {steps} steps"
    int8 = parity.get("int8")
    if isinstance(int8, dict) and all(isinstance(int8.get(k), (int, float)) for k in ("mean_kl", "max_kl")):
        return (
            f"{verdict}: {where}. With float activations (its float twin, accuracy level 0) max |logit difference| "
            f"{difference:.1e} (allowed {tolerance:.0e}): the same model; as shipped, with int8 activations, mean KL "
            f"{int8['mean_kl']:.1e} nats (allowed {int8.get('mean_kl_bound', '?')}), max {int8['max_kl']:.1e} "
            f"(allowed {int8.get('max_kl_bound', '?')}), top-1 agreement "
            f"{100 * float(int8.get('top1_agreement', 0)):.0f}%: what rounding activations to int8 costs"
        )
    if parity.get("activations"):  # a package of an earlier version: one bound on the int8 graph's logits
        return (
            f"{verdict}: {where}, max |logit difference| {difference:.2f} (allowed {tolerance:g}). Not an error: at "
            "accuracy level 4 MatMulNBits rounds activations to int8, which moves logits about this much; a wrong "
            "weight would scramble them"
        )
    return f"{verdict}: {where}, max |logit difference| {difference:.1e} (allowed {tolerance:.0e}): the same model"


def accuracy(evaluation: dict | None, recipe: dict) -> str | None:
    """A quantized package's own report (quantize --eval-text), or how to get one."""
    keys = ("perplexity_ratio", "top1_agreement", "mean_kl_nats")
    if isinstance(evaluation, dict) and all(isinstance(evaluation.get(k), (int, float)) for k in keys):
        return (
            f"against {evaluation.get('reference', 'its source')} on {evaluation.get('text', '?')} "
            f"({_count(evaluation.get('tokens'))} tokens): perplexity x{evaluation['perplexity_ratio']:.4f}, top-1 "
            f"agreement {100 * evaluation['top1_agreement']:.2f}%, mean KL {evaluation['mean_kl_nats']:.5f} nats"
        )
    if evaluation is not None:
        return None  # a record of another shape: info's raw `evaluation` line shows it
    if recipe.get("mode") in QUANTIZED_BY:
        return (
            f"not measured (quantized without --eval-text); measure it with `edgelm eval PACKAGE --text FILE "
            f"--reference {recipe.get('source_package', 'SOURCE')}`"
        )
    return None


def _count(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def sampling(manifest, *, chat: bool) -> str:
    """How `edgelm chat` samples with this package (runtime/chat_defaults.py), and generate."""
    from edgelm.runtime.chat_defaults import chat_sampling

    if not chat:
        return "generate: greedy (no chat template, so no chat)"
    options, origin = chat_sampling(manifest.sampling if manifest is not None else None)
    return f"chat: {describe_sampling(options)} ({origin}); generate: greedy"
