"""tokenizer_config.json for a package: the tokenizer settings transformers and onnxruntime-genai read beside
tokenizer.json (genai's tokenizer, onnxruntime-extensions, refuses a folder without this file).

The file is written from the package's own tokenizer.json and token ids, never carried from a source folder:
a source's file can name settings (`clean_up_tokenization_spaces`, custom classes, a second chat template)
that would make another reader encode or decode differently from edgelm. Whether BOS/EOS are added is stated,
not left to a reader's per-class defaults, and is what tokenizer.json's post-processor does.
"""

from __future__ import annotations

import json

from ..runtime.contract import Manifest
from .checkpoint import CheckpointError

# transformers' class for a plain tokenizer.json; onnxruntime-extensions reads it as a BPE tokenizer
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
PROBE = "a"  # any text that encodes to at least one id: what the post-processor adds around it


def _added_specials(tokenizer, bos: int | None, eos: int) -> tuple[bool, bool]:
    """(add_bos_token, add_eos_token): whether encoding with special tokens puts BOS first / EOS last."""
    plain = tokenizer.encode(PROBE, add_special_tokens=False).ids
    full = tokenizer.encode(PROBE, add_special_tokens=True).ids
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    before, after = full[:start], full[start + len(plain) :]
    return (bos is not None and bos in before), eos in after


def tokenizer_config(tokenizer_json: str, manifest: Manifest, *, chat_template: str | None) -> dict:
    """The package's tokenizer_config.json as a dict: special tokens by name, added tokens, context length,
    chat template."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise CheckpointError(f"tokenizer.json is not a valid tokenizers file: {str(e).splitlines()[0]}") from None
    tokens = manifest.tokenizer
    name = tokenizer.id_to_token
    add_bos, add_eos = _added_specials(tokenizer, tokens.bos_token_id, tokens.eos_token_ids[0])
    unk = json.loads(tokenizer_json).get("model", {}).get("unk_token")
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": name(tokens.bos_token_id) if tokens.bos_token_id is not None else None,
        "eos_token": name(tokens.eos_token_ids[0]),
        "pad_token": name(tokens.pad_token_id),
        "unk_token": unk,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,  # edgelm's decode is tokenizer.json's decoder alone
        "model_max_length": manifest.architecture.context_length,
        "added_tokens_decoder": {
            str(token_id): {
                "content": added.content,
                "lstrip": added.lstrip,
                "normalized": added.normalized,
                "rstrip": added.rstrip,
                "single_word": added.single_word,
                "special": added.special,
            }
            for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items())
        },
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
