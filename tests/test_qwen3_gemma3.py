"""Qwen3 (and Gemma 3) against transformers: tiny random models exported from a Hugging Face folder and from a
GGUF file written in llama.cpp's layout, run by edgelm's runtime (both graphs) and onnxruntime-genai."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from helpers import genai_greedy, hf_greedy, quiet, rewrite_gguf, save_random_model  # noqa: E402
from test_gguf import _add_tokenizer  # noqa: E402  (pytest puts tests/ on the path)
from test_llama_export import EOS, PROMPTS, SMALL  # noqa: E402

from edgelm.export.gguf import GGUFError, read_gguf  # noqa: E402
from edgelm.export.onnx_export import export_package  # noqa: E402
from edgelm.runtime import load  # noqa: E402

TOLERANCE = 1e-4
NEW_TOKENS = 32
GRAPHS = ("fused", "standard")
WINDOW = 3  # shorter than every prompt: the sliding layers' mask and local rotary both count
CASES = {
    # name: (transformers config and model classes, config overrides); head_dim 32 is not hidden / heads (16)
    "qwen3": (("Qwen3Config", "Qwen3ForCausalLM"), dict(head_dim=32, tie_word_embeddings=True)),
    # llama.cpp's Gemma 3 layout: layers 0-4 sliding (local rotary base 10000), layer 5 full, with rope_theta
    # and linear scaling (as the 1B's full layers), query_pre_attn_scalar = head_dim (what llama.cpp assumes)
    "gemma3_text": (
        ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        dict(
            head_dim=32, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=32,
            initializer_range=0.05,  # with the sqrt(hidden) embedding scale, 0.15 gives a greedy run of one token
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
}  # fmt: skip
# HF name in a layer -> llama.cpp's, where it differs by family (Gemma's norms around attention and the MLP)
GGUF_RENAMES = {
    "gemma3_text": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    }
}
# HF name in a layer -> llama.cpp's (convert_hf_to_gguf writes Qwen3's Q and K rows unpermuted)
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(hf: torch.nn.Module, path: Path) -> Path:
    """The transformers model as llama.cpp's converter writes it (f32 tensors, its metadata keys; Gemma's norms
    as 1 + w, no lm_head, the window but no layer pattern or local rotary base)."""
    c = hf.config
    gemma = c.model_type == "gemma3_text"
    arch = "gemma3" if gemma else c.model_type
    names = GGUF_NAMES | GGUF_RENAMES.get(c.model_type, {})
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    writer.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    writer.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", c.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    rope = c.rope_parameters["full_attention"] if gemma else c.rope_parameters
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    if gemma:
        writer.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{names[rest]}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
            gguf_name = gguf_name.get(name, "output.weight")
        shift = 1.0 if gemma and name.endswith("norm.weight") else 0.0
        writer.add_tensor(gguf_name, tensor.float().numpy() + np.float32(shift))
    _add_tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("families")
    models = {
        case: save_random_model(root / case, classes, {**SMALL, **overrides})
        for case, (classes, overrides) in CASES.items()
    }
    return {case: (model, root / case) for case, model in models.items()}


@pytest.fixture(scope="module")
def packages(folders) -> dict[tuple[str, str], Path]:
    """Per case: both graphs from the folder, and the fused graph from a GGUF file of the same weights."""
    out = {}
    for case, (hf, folder) in folders.items():
        for graph in GRAPHS:
            out[case, graph] = folder.parent / f"{case}-{graph}"
            export_package(folder, out[case, graph], attention=graph, progress=quiet)
        path = write_gguf(hf, folder.parent / f"{case}.gguf")
        out[case, "gguf"] = folder.parent / f"{case}-gguf"
        export_package(path, out[case, "gguf"], progress=quiet)
    return out


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, list[list[int]]]:
    out = {case: [hf_greedy(hf, p, NEW_TOKENS, pad_token_id=EOS) for p in PROMPTS] for case, (hf, _) in folders.items()}
    assert all(len(prompt) > WINDOW for prompt in PROMPTS)
    return out


SOURCES = (*GRAPHS, "gguf")


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers(case, source, folders, packages):
    hf, _ = folders[case]
    model = load(packages[case, source], provider="cpu")
    ids = np.array([PROMPTS[2]], dtype=np.int64)
    logits, _ = model.forward(ids)
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids)).logits.numpy()
    difference = float(np.abs(logits - reference).max())
    print(f"{case} {source}: max |logit difference| {difference:.2e}")
    assert difference < TOLERANCE


def test_reference_model_equals_transformers(folders):
    from edgelm.export.onnx_export import open_source

    for case, (hf, folder) in folders.items():
        ids = torch.tensor([PROMPTS[2]])
        with torch.no_grad():
            difference = (open_source(folder).model(ids)[0] - hf(ids).logits).abs().max().item()
        assert difference < TOLERANCE, case


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_transformers_batch_1_and_padded(case, source, packages, expected):
    model = load(packages[case, source], provider="cpu")
    tokens = expected[case]
    assert len(set(tokens[0])) > 4, tokens[0]  # a model repeating one token would make this test weak
    assert model.generate(PROMPTS[0], NEW_TOKENS, temperature=0, ignore_eos=True).token_ids == tokens[0]
    batch = model.generate_batch(PROMPTS, NEW_TOKENS, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in batch] == tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnxruntime_genai_runs_the_package(case, packages, expected):
    genai = json.loads((packages[case, "fused"] / "genai_config.json").read_text())
    assert genai["model"]["type"] == case  # onnxruntime-genai 0.18 knows qwen3 and gemma3_text
    for prompt, tokens in zip(PROMPTS[:2], expected[case][:2], strict=True):
        assert EOS not in tokens  # else genai would stop early, by design
        assert genai_greedy(packages[case, "fused"], prompt, NEW_TOKENS) == tokens


def test_qwen3_gguf_config(folders, packages):
    hf, folder = folders["qwen3"]
    config = read_gguf(folder.parent / "qwen3.gguf").hf_config
    assert config["model_type"] == "qwen3" and config["head_dim"] == 32 != SMALL["hidden_size"] // 6


HOSTILE = [  # (case, key, bad value): each file otherwise as written above
    ("qwen3", "qwen3.attention.key_length", "many"),
    ("qwen3", "qwen3.rope.freq_base", "many"),
    ("gemma3_text", "gemma3.attention.sliding_window", "many"),
    ("gemma3_text", "gemma3.attention.sliding_window", 0),
    ("gemma3_text", "gemma3.rope.freq_base_swa", "many"),
    ("gemma3_text", "gemma3.attention.sliding_window_pattern", "many"),
    ("gemma3_text", "gemma3.final_logit_softcapping", 30.0),
]


@pytest.mark.parametrize("case,key,value", HOSTILE)
def test_hostile_metadata_is_one_line_error(case, key, value, folders, tmp_path):
    _, folder = folders[case]
    kind = {str: "add_string", float: "add_float32", int: "add_uint32"}[type(value)]

    def add(writer):
        getattr(writer, kind)(key, value)

    path = rewrite_gguf(folder.parent / f"{case}.gguf", tmp_path / "bad.gguf", {key: None}, add=add)
    with pytest.raises(GGUFError, match=key.replace(".", r"\.")) as error:
        read_gguf(path)
    assert "\n" not in str(error.value)


def test_gemma3_gguf_pattern_and_local_base_keys_are_read(folders, tmp_path):
    """Newer writers' keys for what llama.cpp's Gemma 3 loader otherwise assumes."""
    _, folder = folders["gemma3_text"]
    pattern = [True, False, True, True, True, False]

    def add(writer):
        writer.add_sliding_window_pattern(pattern)
        writer.add_rope_freq_base_swa(5000.0)

    config = read_gguf(rewrite_gguf(folder.parent / "gemma3_text.gguf", tmp_path / "keys.gguf", {}, add=add)).hf_config
    assert config["layer_types"] == ["sliding_attention" if p else "full_attention" for p in pattern]
    assert config["rope_local_base_freq"] == 5000.0


def test_gemma3_gguf_config(folders):
    """What llama.cpp's loader assumes for a Gemma 3 file: every 6th layer full, local base 10000."""
    _, folder = folders["gemma3_text"]
    config = read_gguf(folder.parent / "gemma3_text.gguf").hf_config
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == WINDOW and config["rope_local_base_freq"] == 10000.0
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0} and config["rope_theta"] == 1e5


def test_gemma3_image_text_folder_exports_its_text_part(folders, tmp_path):
    """model_type gemma3: config.json's text_config and the weights under model.language_model (transformers 5's
    names for Gemma3ForConditionalGeneration), a vision tower beside them left out."""
    from safetensors.torch import load_file, save_file

    from edgelm.export.onnx_export import open_source

    hf, folder = folders["gemma3_text"]
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "text_config": text, "eos_token_id": EOS})
    )
    state = {
        "model.language_model." + k.removeprefix("model."): v
        for k, v in load_file(folder / "model.safetensors").items()
    }
    state["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    save_file(state, tmp_path / "model.safetensors")
    ids = torch.tensor([PROMPTS[2]])
    source = open_source(tmp_path)
    assert source.family.name == "gemma3_text"
    with torch.no_grad():
        assert (source.model(ids)[0] - hf(ids).logits).abs().max().item() < TOLERANCE


def test_gemma3_gguf_weights_match_transformers_gguf_loader(folders):
    """transformers' own GGUF reader (its Gemma 3 norm shift included) finds the HF weights in the file written
    above, so the test file's layout is llama.cpp's as transformers reads it too, not only as edgelm does. (Its
    config differs where the file is silent: query_pre_attn_scalar 256, no rope scaling; edgelm follows
    llama.cpp's loader there.)"""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    hf, folder = folders["gemma3_text"]
    loaded = AutoModelForCausalLM.from_pretrained(folder.parent, gguf_file="gemma3_text.gguf").state_dict()
    expected = hf.state_dict()
    assert set(loaded) == set(expected)
    assert max((loaded[k] - expected[k]).abs().max().item() for k in expected) < 1e-6


GEMMA_PIECES = [  # a small SentencePiece vocabulary in Gemma's GGUF spelling: runs of spaces stored as spaces
    "▁", *"abcdefghijklmnopqrstuvwxyz", "  ", "   ", "\n", ",", "!", "H", "W", "th", "he", "▁t", "▁th", "▁the", "at",
    "▁c", "▁ca", "▁cat", "in", "▁in", "▁s", "▁sa", "▁sat", "ha", "▁h", "▁hat", "ll", "el", "ell", "ello", "He",
    "Hell", "Hello", "▁▁", "sp", "ac", "es", "ace", "aces", "spaces", "▁spaces", "us", "er", "user",
]  # fmt: skip


def test_gemma_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """A Gemma GGUF vocabulary (tokenizer model llama, no space prefix, byte fallback, scores that do not follow
    the merge order) gives transformers' GGUF tokenizer's ids."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from edgelm.export.gguf_tokenizer import build_tokenizer_json

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens += [f"<0x{b:02X}>" for b in range(256)] + GEMMA_PIECES
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(GEMMA_PIECES)
    writer = gguf.GGUFWriter(tmp_path / "tok.gguf", "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(list(np.random.default_rng(0).standard_normal(len(tokens))))
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = {field.name: field.contents() for field in gguf.GGUFReader(tmp_path / "tok.gguf").fields.values()}
    ours = Tokenizer.from_str(build_tokenizer_json(meta))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for text in ["the cat sat in the hat", "  two  spaces   here", "Hello, Wörld! 😀", "<start_of_turn>user\n", " the"]:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == text.replace("<start_of_turn>", "")


@pytest.mark.parametrize("case", sorted(CASES))
def test_genai_type_is_what_the_package_records_and_older_packages_keep_theirs(case, packages):
    """The manifest records the family's genai type, and genai_config.json names it; a manifest from before
    that record still parses (its genai_config.json is the one written then), but the contract maps no family."""
    from edgelm.runtime.contract import GENAI_CONFIG_FILE, MANIFEST_FILE, Manifest, genai_config

    data = json.loads((packages[case, "fused"] / MANIFEST_FILE).read_text())
    assert data["architecture"]["genai_type"] == case
    assert genai_config(Manifest.parse(data))["model"]["type"] == case
    assert json.loads((packages[case, "fused"] / GENAI_CONFIG_FILE).read_text())["model"]["type"] == case
    del data["architecture"]["genai_type"]
    assert Manifest.parse(data).architecture.genai_type is None
    with pytest.raises(ValueError, match="no architecture.genai_type"):
        genai_config(Manifest.parse(data))


@pytest.mark.parametrize(
    "change",
    [{"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0}, {"attention_bias": True},
     {"hidden_activation": "silu"}, {"layer_types": ["sliding_attention"]}],
)  # fmt: skip
def test_gemma3_config_edgelm_does_not_implement_is_refused(change, folders, tmp_path):
    from edgelm.export.checkpoint import CheckpointError
    from edgelm.export.onnx_export import open_source

    _, folder = folders["gemma3_text"]
    shutil.copytree(folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text()) | change
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=next(iter(change))) as error:
        open_source(tmp_path / "model")
    assert "\n" not in str(error.value)
