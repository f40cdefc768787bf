"""How a chat samples when the user says nothing: what the model's authors recommend, else defaults that do not loop.

Greedy decoding is exact and reproducible, and the right default for `generate` and the Python API, but in a chat
a small model's near-ties make it repeat itself until the token limit (SmolLM2-135M at int8 activations: "la
femme, la femme, ..."). So a chat samples:

1. with the source's generation_config.json, when export recorded one (runtime/contract.py `Sampling`) whose
   do_sample is true: its values, and for those it leaves out Hugging Face's own defaults (temperature 1, top-k 50),
   which is what transformers' generate() would use; a generation_config.json without do_sample: true makes
   transformers decode greedily, so it recommends no sampling and the next rule applies;
2. else CHAT_SAMPLING: temperature 0.7, top-p 0.9 and min-p 0.05 (llama.cpp's and Ollama's ranges) keep the
   answer on the likely tokens, and a repetition penalty of 1.1 (Ollama's default) breaks the loops.
"""

from __future__ import annotations

from dataclasses import asdict

from .contract import Sampling

CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}
# transformers' GenerationConfig defaults, for the keys a generation_config.json leaves out
HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
FROM_MODEL = "the model's generation_config.json"
FROM_EDGELM = "edgelm's chat defaults"


def chat_sampling(sampling: Sampling | None) -> tuple[dict, str]:
    """(sampling options for Conversation.stream/send, where they come from: FROM_MODEL or FROM_EDGELM) for a
    package's recorded sampling (`model.spec.manifest.sampling`; None: none recorded)."""
    if sampling is None or sampling.do_sample is not True:
        return dict(CHAT_SAMPLING), FROM_EDGELM
    given = {key: value for key, value in asdict(sampling).items() if key != "do_sample" and value is not None}
    return HF_SAMPLING | given, FROM_MODEL


def model_chat_sampling(model) -> tuple[dict, str]:
    """chat_sampling for a loaded Model (a package without a manifest, such as a genai folder, records none)."""
    manifest = model.spec.manifest
    return chat_sampling(manifest.sampling if manifest is not None else None)
