"""What the KV cache and the decode loop need from a loaded model: a narrow runner, not the whole `Model`.

runtime/model.py's `Model` is one; a test or a wrapper (a timing session, a LoRA-adapter runner) may be
another. The cache drivers (runtime/kvcache.py) bind tensors and call `run`; the decode loop
(runtime/decode.py) reads the package's token ids and sizes through `spec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .package import PackageSpec
    from .text import Tokenizer


class Runner(Protocol):
    spec: PackageSpec  # the package: architecture, I/O names (spec.io), token ids (spec.tokens)
    session: Any  # an onnxruntime.InferenceSession: the cache drivers make their IO bindings from it
    device: str  # "cpu" or "cuda": where the KV cache lives
    kv_dtype: Any  # numpy dtype of the past/present keys and values (np.float32 or np.float16)
    logits_dtype: Any  # numpy dtype of the logits output
    uses_position_ids: bool  # whether the graph takes position_ids

    def run(self, binding: Any) -> None:
        """Run the session on an IO binding; a failed run raises PackageError."""
        ...


class TextModel(Runner, Protocol):
    """A runner with a tokenizer: what a Conversation (runtime/chat.py) needs."""

    tokenizer: Tokenizer | None  # None when the package has no tokenizer.json
    context_length: int  # tokens the model attends to at most

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text or token ids -> validated token ids (an empty prompt becomes [BOS] when there is one)."""
        ...
