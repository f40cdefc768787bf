"""Field validators for the package's JSON files: each returns the checked value or raises PackageError naming
the file and key. Used by the manifest (runtime/contract.py, runtime/lora_contract.py) and the readers of genai
and Optimum folders (runtime/foreign.py)."""

from __future__ import annotations

from .errors import PackageError


def integer(data: dict, key: str, where: str, *, minimum: int = 0) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PackageError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def heads(data: dict, where: str, *, n_head_key: str, n_kv_head_key: str) -> tuple[int, int]:
    """Query and key/value head counts (KV heads default to the query heads); each KV head must serve the
    same number of query heads (grouped-query attention)."""
    n_head = integer(data, n_head_key, where, minimum=1)
    n_kv_head = integer(data, n_kv_head_key, where, minimum=1) if n_kv_head_key in data else n_head
    if n_head % n_kv_head:
        raise PackageError(f"{where}: {n_head_key} ({n_head}) must be a multiple of {n_kv_head_key} ({n_kv_head})")
    return n_head, n_kv_head


def optional_id(value: object) -> int | None:
    """A token id that a package may leave out (null); range-checked against the vocabulary later."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def optional_name(data: dict, key: str, where: str) -> str | None:
    value = data.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise PackageError(f"{where}: {key} must be a file name or null, got {value!r}")
    return value


def token_list(value: object, where: str) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise PackageError(f"{where}: eos token id(s) must be non-negative integers, got {value!r}")
    return ids


def choice(data: dict, key: str, allowed: tuple[str, ...], where: str, *, default: str) -> str:
    value = data.get(key, default)
    if value not in allowed:
        raise PackageError(f"{where}: {key} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def io_name(
    table: dict, key: str, default: str | None, where: str, *, per_layer: bool = False, optional: bool = False
) -> str | None:
    """An ONNX I/O name from package JSON (None where optional and null). Per-layer names hold exactly
    one %d (the layer index) and no other %, so formatting them can neither fail nor blow up."""
    value = table.get(key, default)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise PackageError(f"{where}: {key} must be a non-empty string, got {value!r}")
    if per_layer and (value.count("%") != 1 or "%d" not in value):
        raise PackageError(f"{where}: {key} must hold one %d for the layer index, got {value!r}")
    return value
