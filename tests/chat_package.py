"""A tiny random instruct model for the chat tests: a transformers LlamaForCausalLM with the bundled
Shakespeare BPE tokenizer plus ChatML's and Llama 3's special tokens as added tokens, saved with a chat
template and exported to a package (the fused graph by default, or the standard one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import quiet

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BASE_VOCAB = 2048  # models/shakespeare/tokenizer.json
VOCAB = BASE_VOCAB + len(SPECIAL)
IM_END = BASE_VOCAB + 1
EOT = BASE_VOCAB + 5
BEGIN = BASE_VOCAB + 2


def make_tokenizer(folder: Path, extra_special: tuple[str, ...] = ()) -> None:
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(REPO / "models" / "shakespeare" / "tokenizer.json"))
    special = [*SPECIAL, *extra_special]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    assert tokenizer.token_to_id("<|im_end|>") == IM_END and tokenizer.get_vocab_size() == VOCAB + len(extra_special)
    tokenizer.save(str(folder / "tokenizer.json"))


def make_chat_folder(
    folder: Path,
    *,
    template: str = "smollm2",
    context: int = 256,
    layers: int = 2,
    seed: int = 0,
    vocab: int | None = None,
    extra_special: tuple[str, ...] = (),
    family: str = "llama",
) -> Path:
    """A Llama checkpoint folder (or family="lfm2": LFM2, convolution and attention layers alternating; or
    "qwen3_5_text": Qwen3.5, Gated DeltaNet and attention layers alternating): random
    weights, the tokenizer above (with extra_special control tokens after the others),
    tests/data/chat_templates/<template>.jinja or a path to a template (no template for template=""), EOS ids
    [<|im_end|>, <|eot_id|>]; `vocab` embedding rows (>= the tokenizer's; default: the tokenizer's)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    shared = dict(
        vocab_size=vocab or VOCAB + len(extra_special), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=layers, intermediate_size=128, max_position_embeddings=context, bos_token_id=BEGIN,
        eos_token_id=[IM_END, EOT], pad_token_id=0, tie_word_embeddings=True,
        initializer_range=0.1,  # not near-uniform logits: a wrong position or cache would change the tokens
    )  # fmt: skip
    if family == "gemma4":  # KV sharing (the last 2 of 6 layers), per-layer inputs, two head sizes, a window of 8
        kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
        config = transformers.Gemma4TextConfig(
            **shared, head_dim=16, global_head_dim=32, layer_types=kinds[:layers], num_kv_shared_layers=2,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=shared["vocab_size"], sliding_window=8,
        )  # fmt: skip
        model = transformers.Gemma4ForCausalLM(config)
    elif family == "lfm2":
        kinds = ["conv" if i % 2 == 0 else "full_attention" for i in range(layers)]
        model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**shared, layer_types=kinds))
    elif family == "qwen3_5_text":  # heads of 64, a quarter rotated: the least GroupQueryAttention's rotary takes
        kinds = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        config = transformers.Qwen3_5TextConfig(**shared, layer_types=kinds, head_dim=64, linear_num_key_heads=2,
                                                linear_num_value_heads=4, linear_key_head_dim=16,
                                                linear_value_head_dim=8)  # fmt: skip
        model = transformers.Qwen3_5ForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shared, rope_theta=1e4, rms_norm_eps=1e-5))
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(folder)
    make_tokenizer(folder, extra_special)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    if template:
        source = Path(template) if template.endswith(".jinja") else TEMPLATES / f"{template}.jinja"
        shutil.copy(source, folder / "chat_template.jinja")
    return folder


def make_chat_package(out: Path, *, attention: str = "fused", **options) -> Path:
    from edgelm.export.onnx_export import export_package

    folder = make_chat_folder(out.parent / f"{out.name}-checkpoint", **options)
    export_package(folder, out, attention=attention, progress=quiet)
    return out
