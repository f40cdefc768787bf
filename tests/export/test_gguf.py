"""GGUF reader: small GGUF files written here with llama.cpp's own writer, read back and compared with
transformers' GGUF loader, with numpy and with an onnxruntime MatMulNBits node; hostile files; SmolLM2."""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from edgelm.export.gguf import GGUFError, read_gguf  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = json.loads((REPO / "models" / "shakespeare" / "tokenizer.json").read_text())
VOCAB = len(TOKENIZER["model"]["vocab"])  # 2048
HIDDEN, INNER, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 128, 2, 4, 2, 128
TEXTS = [
    "Hello, world!",
    "ROMEO:\n  But soft, what light   through yonder window breaks?",
    "It's 1234 o'clock",
    "é 東京 🙂",
]


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for rotary rows: each head's (2, hd/2) halves become (hd/2, 2) pairs."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _add_tokenizer(writer, *, add_bos: bool = False) -> None:
    vocab = sorted(TOKENIZER["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token == "<|endoftext|>" else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in TOKENIZER["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ messages[0]['content'] }}")


def _add(writer, name: str, weight: np.ndarray, kind: Q) -> None:
    if kind == Q.F32:
        writer.add_tensor(name, weight.astype(np.float32))
    elif kind == Q.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(weight.astype(np.float32), kind), raw_dtype=kind)


def write_gguf(
    folder: Path, arch: str, *, kinds=(Q.F32,), tied: bool = True, seed: int = 0, add_bos=False, real_stats=False
) -> Path:
    """A tiny random model of `arch`; 2-D weights cycle through `kinds`. Returns the file's path. real_stats: with
    the activation statistics of trained models (with_real_stats), which int8 activations round as they round a
    real file's."""
    rng = np.random.default_rng(seed)
    # transformers' GGUF config mapping for gpt2 ignores these two keys and assumes GPT-2's own values
    inner, context = (4 * HIDDEN, 1024) if arch == "gpt2" else (INNER, CONTEXT)
    path = folder / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.context_length", context)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_uint32(f"{arch}.feed_forward_length", inner)
    writer.add_uint32(f"{arch}.block_count", LAYERS)
    writer.add_uint32(f"{arch}.attention.head_count", HEADS)
    head_dim = HIDDEN // HEADS
    cycle = iter(kinds * 100)
    weight = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)
    if arch == "gpt2":
        writer.add_float32("gpt2.attention.layer_norm_epsilon", 1e-5)
        tensors = {"token_embd.weight": weight(VOCAB, HIDDEN), "position_embd.weight": weight(context, HIDDEN)}
        for i in range(LAYERS):
            shapes = {"attn_qkv": (3 * HIDDEN, HIDDEN), "attn_output": (HIDDEN, HIDDEN)}
            shapes |= {
                "ffn_up": (inner, HIDDEN),
                "ffn_down": (HIDDEN, inner),
                "attn_norm": (HIDDEN,),
                "ffn_norm": (HIDDEN,),
            }
            for stem, shape in shapes.items():
                tensors[f"blk.{i}.{stem}.weight"] = weight(*shape)
                tensors[f"blk.{i}.{stem}.bias"] = weight(shape[0])
        tensors |= {"output_norm.weight": weight(HIDDEN), "output_norm.bias": weight(HIDDEN)}
    else:
        writer.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
        writer.add_float32(f"{arch}.rope.freq_base", 1e5)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
        writer.add_uint32(f"{arch}.vocab_size", VOCAB)
        tensors = {"token_embd.weight": weight(VOCAB, HIDDEN)}
        for i in range(LAYERS):
            q, k = weight(HEADS * head_dim, HIDDEN), weight(KV_HEADS * head_dim, HIDDEN)
            if arch == "llama":  # what convert_hf_to_gguf does to Llama's Q and K (not to Qwen2's)
                q, k = _permute(q, HEADS), _permute(k, KV_HEADS)
            tensors |= {f"blk.{i}.attn_q.weight": q, f"blk.{i}.attn_k.weight": k}
            tensors[f"blk.{i}.attn_v.weight"] = weight(KV_HEADS * head_dim, HIDDEN)
            if arch == "qwen2":
                tensors[f"blk.{i}.attn_q.bias"] = weight(HEADS * head_dim)
                tensors[f"blk.{i}.attn_k.bias"] = weight(KV_HEADS * head_dim)
                tensors[f"blk.{i}.attn_v.bias"] = weight(KV_HEADS * head_dim)
            tensors[f"blk.{i}.attn_output.weight"] = weight(HIDDEN, HEADS * head_dim)
            tensors[f"blk.{i}.ffn_gate.weight"] = weight(INNER, HIDDEN)
            tensors[f"blk.{i}.ffn_up.weight"] = weight(INNER, HIDDEN)
            tensors[f"blk.{i}.ffn_down.weight"] = weight(HIDDEN, INNER)
            tensors[f"blk.{i}.attn_norm.weight"] = 1 + weight(HIDDEN)
            tensors[f"blk.{i}.ffn_norm.weight"] = 1 + weight(HIDDEN)
        tensors["output_norm.weight"] = 1 + weight(HIDDEN)
    if not tied:
        tensors["output.weight"] = weight(VOCAB, HIDDEN)
    if real_stats:
        tensors = with_real_stats(tensors, rng)
    for name, value in tensors.items():
        _add(writer, name, value, next(cycle) if value.ndim == 2 else Q.F32)
    _add_tokenizer(writer, add_bos=add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


MASSIVE_CHANNEL, OUTLIER_CHANNELS = 7, [3, 21, 40, 55]
# measured on tiny Llama files (Q8_0, and Q8_0 / Q4_0 / Q4_1 / F16 mixed): int8 activations move their logits by
# 6.5-8.1 (a real Gemma 3 270M's by 11, past the old bound of 4) and their distributions barely (mean KL < 1e-3)
MASSIVE, LAYER_GAIN, LOGIT_GAIN, NORM_OUTLIER = 30.0, 3.0, 60.0, 10.0


def with_real_stats(tensors: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """What trained models' activations look like and random ones' do not (Sun et al. 2024, "Massive Activations in
    Large Language Models"; Dettmers et al. 2022, "LLM.int8()"): one channel of the residual stream about 300x the
    median on every token, a few outlier channels 20x (in the final norm's weight too), the layers writing as much
    into the residual stream, and logits of a hundred (the final norm's weight large).
    Per-block int8 activations then round away most of the block that holds the massive channel, as they do on a
    real file: a random model's activations are all alike and lose almost nothing."""
    out = dict(tensors)
    embedding = out["token_embd.weight"].copy()  # (V, C)
    embedding[:, OUTLIER_CHANNELS] *= 20
    embedding[:, MASSIVE_CHANNEL] = MASSIVE * (1 + 0.05 * rng.standard_normal(len(embedding)).astype(np.float32))
    out["token_embd.weight"] = embedding
    if "output.weight" not in out:  # tied: the head reads the embedding, which the massive channel would swamp
        out["output.weight"] = tensors["token_embd.weight"]
    for name in out:  # the layers write into the residual stream as much as the embedding holds
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            out[name] = out[name] * LAYER_GAIN
    final = out["output_norm.weight"] * LOGIT_GAIN
    final[OUTLIER_CHANNELS] *= NORM_OUTLIER  # trained final norms have outlier weights too
    final[MASSIVE_CHANNEL] = 0.01  # trained heads ignore the massive channel (it is a bias, not a feature)
    out["output_norm.weight"] = final
    return out


CASES = {  # arch, tensor types cycled over the 2-D weights, tied head
    "llama-gqa": ("llama", (Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.F16), False),
    "qwen2-bias": ("qwen2", (Q.Q4_0, Q.F16, Q.Q8_0, Q.Q4_1), True),
    "gpt2": ("gpt2", (Q.F16, Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.F32), True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, kinds, tied = CASES[request.param]
    return write_gguf(tmp_path_factory.mktemp(request.param), arch, kinds=kinds, tied=tied)


def test_tensors_and_config_match_transformers(case):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = read_gguf(case)
    reference = AutoModelForCausalLM.from_pretrained(case.parent, gguf_file=case.name).state_dict()
    config = AutoConfig.from_pretrained(case.parent, gguf_file=case.name)
    expected = {k for k in reference if not k.endswith(".attn.bias") and not k.endswith("masked_bias")}
    if model.hf_config["tie_word_embeddings"]:
        expected.discard("lm_head.weight")
    assert set(model.tensor_names) == expected
    for name in model.tensor_names:
        np.testing.assert_allclose(model.tensor(name), reference[name].float().numpy(), rtol=0, atol=1e-6, err_msg=name)
    for key, value in model.hf_config.items():
        if key in ("architectures", "rope_scaling", "bos_token_id", "eos_token_id", "hidden_act"):
            continue
        if key in ("head_dim", "attention_bias") and not hasattr(config, key):  # Qwen2Config implies them
            continue
        actual = config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(config, key)
        if key == "n_inner" and actual is None:  # GPT-2's default: 4 * n_embd
            actual = 4 * config.n_embd
        assert actual == pytest.approx(value), key


def test_tokenizer_matches_transformers(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    for add_bos in (False, True):
        path = write_gguf(tmp_path, "llama", add_bos=add_bos)
        model = read_gguf(path)
        ours = Tokenizer.from_str(model.tokenizer_json)
        reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        for text in [*TEXTS, "<|endoftext|>ROMEO<|endoftext|>"]:
            assert ours.encode(text).ids == reference(text)["input_ids"], text
        assert (ours.encode("hi").ids[0] == 0) is add_bos
        assert model.chat_template == "{{ messages[0]['content'] }}"
        assert (model.bos_token_id, model.eos_token_ids) == (0, [0])


def _unpack(bits: int, packed: np.ndarray, scales: np.ndarray, block_size: int = 32, offsets=None) -> np.ndarray:
    """MatMulNBits' (N, K/block, blob) blocks with the default zero point back to an (N, K) weight: element 2i
    low nibble, 2i+1 high; (q - 2^(bits-1)) * scale + offset, one scale and offset (N, K/block) per block."""
    if bits == 4:
        values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:2], block_size)
    else:
        values = packed
    n, blocks = packed.shape[:2]
    weight = (values.astype(np.float32) - 2 ** (bits - 1)) * scales.reshape(n, blocks, 1)
    if offsets is not None:
        weight = weight + offsets.reshape(n, blocks, 1)
    return weight.reshape(n, blocks * block_size).astype(np.float32)


def run_matmul_nbits(x: np.ndarray, nbits, *, accuracy_level: int = 0) -> np.ndarray:
    """ONNX Runtime's MatMulNBits on an NBits (export/decoder.py) with the default zero point, plus the
    block sums of x times the offsets where there are any: what export/graph.py builds."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = nbits.shape
    node = helper.make_node(
        "MatMulNBits",
        ["x", "B", "scales"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=nbits.bits,
        block_size=nbits.block_size,
        accuracy_level=accuracy_level,
    )
    inits = [numpy_helper.from_array(a, name) for a, name in ((nbits.packed, "B"), (nbits.scales, "scales"))]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        inits,
    )
    onnx_model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    session = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = session.run(None, {"x": x})[0]
    if nbits.block_offsets is not None:
        y = y + x.reshape(len(x), -1, nbits.block_size).sum(-1) @ nbits.block_offsets
    return y


def test_matmul_nbits_matches_dequantized_weights(case):
    from edgelm.export.families import kept_blocks
    from edgelm.export.gguf_blocks import dequantized

    model = read_gguf(case)
    rng = np.random.default_rng(1)
    seen = set()
    for name in model.tensor_names:
        runs = model.matmul_nbits(name)
        kind = model.quant_type(name)
        assert (runs is None) == (kind in ("F32", "F16")), name
        if runs is None:
            continue
        seen.add(kind)
        # (in, out) weight: Llama stores (out, in) in HF orientation, GPT-2's Conv1D (in, out)
        weight = model.tensor(name)
        dense = weight if any(f".{c}." in name for c in ("c_attn", "c_proj", "c_fc")) else weight.T
        np.testing.assert_allclose(dequantized(runs).T, dense, rtol=1e-5, atol=1e-6, err_msg=name)
        x = rng.standard_normal((3, dense.shape[0])).astype(np.float32)
        y = run_matmul_nbits(x, kept_blocks(model.matmul_nbits, [name]))
        np.testing.assert_allclose(y, x @ dense, rtol=1e-4, atol=1e-4, err_msg=name)
    assert seen == {"Q4_0", "Q4_1", "Q8_0"}


def test_q4_1_flat_block_keeps_its_minimum(tmp_path):
    """A Q4_1 block whose values are all equal has scale 0: it must still come out as its minimum."""
    from edgelm.export.gguf_blocks import dequantized

    path = write_gguf(tmp_path, "qwen2", kinds=(Q.Q4_1,))
    model = read_gguf(path)
    name = "model.layers.0.mlp.up_proj.weight"
    stored = model._stored["blk.0.ffn_up.weight"]
    blocks = np.asarray(stored.data).reshape(INNER, HIDDEN // 32, 20).copy()
    blocks[0, 0, 0:2] = 0  # d = 0 in the first block: every weight is m
    model._stored["blk.0.ffn_up.weight"] = type(stored)(**{**stored._asdict(), "data": blocks.reshape(INNER, -1)})
    np.testing.assert_allclose(dequantized(model.matmul_nbits(name)), model.tensor(name), rtol=1e-5, atol=1e-6)


# --- hostile files ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory) -> bytes:
    return write_gguf(tmp_path_factory.mktemp("valid"), "llama", kinds=(Q.Q4_0, Q.F16)).read_bytes()


def _tensor_info_offset(data: bytes, name: bytes) -> int:
    """Byte offset of the dimension count that follows tensor `name` in the tensor descriptions."""
    return data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


def _patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _string_length_2_63(data: bytes) -> bytes:  # the key "general.architecture" claims 2**63 bytes
    return _patched(data, data.index(b"general.architecture") - 8, "<Q", 1 << 63)


def _array_length_2_63(data: bytes) -> bytes:  # the token list claims 2**63 strings
    return _patched(data, data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8, "<Q", 1 << 63)


def _dims_of(data: bytes, name: bytes, dims: int) -> bytes:  # output_norm.weight: n_dims 1, then its dimension
    return _patched(data, _tensor_info_offset(data, name) + 4, "<Q", dims)


def _offset_of(data: bytes, name: bytes, offset: int) -> bytes:  # output_norm.weight: n_dims, dim, type, offset
    return _patched(data, _tensor_info_offset(data, name) + 4 + 8 + 4, "<Q", offset)


def _alias(data: bytes, name: bytes, other: bytes) -> bytes:  # 1-D tensor `name` given the data offset of `other`
    offset = struct.unpack_from("<Q", data, _tensor_info_offset(data, other) + 4 + 8 + 4)[0]
    return _offset_of(data, name, offset)


def _layers_aliasing_layer_0(data: bytes, layers: int) -> bytes:
    """The file rewritten to claim `layers` layers whose tensors all point at layer 0's bytes (its data section
    kept as it is): a small file asking for `layers` layers' work."""
    import tempfile

    from edgelm.export.gguf_header import read_header

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "v.gguf").write_bytes(data)
        header = read_header(Path(folder) / "v.gguf")
    data_start = min(t.start for t in header.tensors)
    first = data.index(struct.pack("<Q", len(b"token_embd.weight")) + b"token_embd.weight")
    kv = bytearray(data[24:first])
    count_at = kv.index(b"llama.block_count") + len(b"llama.block_count") + 4
    struct.pack_into("<I", kv, count_at, layers)
    infos = bytearray()
    entries = [t for t in header.tensors if not t.name.startswith("blk.")]
    layer_0 = [t for t in header.tensors if t.name.startswith("blk.0.")]
    for i in range(layers):
        entries += [dataclasses.replace(t, name=t.name.replace("blk.0.", f"blk.{i}.", 1)) for t in layer_0]
    for t in entries:
        name = t.name.encode()
        infos += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.dims))
        infos += struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", int(t.tensor_type), t.start - data_start)
    head = data[:8] + struct.pack("<QQ", len(entries), struct.unpack_from("<Q", data, 16)[0]) + bytes(kv) + bytes(infos)
    return head + bytes(-len(head) % 32) + data[data_start:]


HOSTILE = {
    "empty": (lambda d: b"", "too short"),
    "bad magic": (lambda d: b"GGML" + d[4:], "bad magic"),
    "version 1": (lambda d: _patched(d, 4, "<I", 1), "version"),
    "truncated header": (lambda d: d[:2000], "the file"),
    "truncated data": (lambda d: d[: len(d) // 2], "past the end"),
    "absurd tensor count": (lambda d: _patched(d, 8, "<Q", 1 << 60), "cannot fit"),
    "absurd metadata count": (lambda d: _patched(d, 16, "<Q", (1 << 64) - 1), "cannot fit"),
    "string length 2**63": (_string_length_2_63, "past the end"),
    "array length 2**63": (_array_length_2_63, "does not fit"),
    "absurd dimension": (lambda d: _dims_of(d, b"output_norm.weight", 1 << 62), "impossible dimensions"),
    "offset past the end": (lambda d: _offset_of(d, b"output_norm.weight", 1 << 40), "past the end"),
    "wrong shape": (lambda d: _dims_of(d, b"output_norm.weight", 32), "output_norm.weight has shape (32,)"),
    "unsupported type": (
        lambda d: _patched(d, _tensor_info_offset(d, b"output_norm.weight") + 12, "<I", int(Q.I32)),
        "type I32",
    ),
    "overlapping tensors": (
        lambda d: _alias(d, b"blk.1.attn_norm.weight", b"blk.0.attn_norm.weight"),
        "tensors blk.0.attn_norm.weight and blk.1.attn_norm.weight overlap",
    ),
    "overlapping part of a tensor": (
        lambda d: _offset_of(
            d,
            b"output_norm.weight",
            struct.unpack_from("<Q", d, _tensor_info_offset(d, b"blk.1.attn_norm.weight") + 16)[0] + 64,
        ),
        "blk.1.attn_norm.weight and output_norm.weight overlap",
    ),
    "400 layers aliasing layer 0": (lambda d: _layers_aliasing_layer_0(d, 400), "overlap"),
    "missing tensor": (lambda d: d.replace(b"output_norm.weight", b"output_nurm.weight"), "output_norm.weight"),
    "unknown architecture": (lambda d: d.replace(b"llama", b"mamba"), "architecture 'mamba'"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_file_gives_one_line_error(kind, valid_bytes, tmp_path):
    damage, expected = HOSTILE[kind]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(damage(valid_bytes))
    start = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith("hostile.gguf: ")
    assert expected in message, message
    assert time.perf_counter() - start < 5


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "absent.gguf")


def test_fuzzed_files_fail_cleanly(valid_bytes, tmp_path):
    """Random byte mutations of a small valid file, through everything export does before it builds a graph
    (read, dequantize every tensor, build and check the reference model, make the Decoder with the kept blocks):
    either it all works or one documented one-line error (GGUFError, CheckpointError) comes, in bounded time.
    Export's later steps read only what these made (the metadata values themselves:
    tests/export/test_gguf_metadata.py)."""
    hypothesis = pytest.importorskip("hypothesis")
    from edgelm.export.checkpoint import CheckpointError, check_finite
    from edgelm.export.source import open_source

    st = hypothesis.strategies
    size = len(valid_bytes)
    header = valid_bytes.index(b"output_norm.weight") + 64  # most flips land in the metadata and tensor table
    outcomes = []

    @hypothesis.settings(max_examples=100, deadline=None, database=None)
    @hypothesis.given(
        flips=st.lists(st.tuples(st.integers(0, header), st.integers(0, 255)), max_size=4),
        data_flips=st.lists(st.tuples(st.integers(header, size - 1), st.integers(0, 255)), max_size=2),
        cut=st.one_of(st.none(), st.integers(0, size)),
    )
    def check(flips, data_flips, cut):
        data = bytearray(valid_bytes)
        for offset, value in flips + data_flips:
            data[offset] = value
        path = tmp_path / "fuzz.gguf"
        path.write_bytes(bytes(data[:cut]))
        start = time.perf_counter()
        try:
            source = open_source(path)
            check_finite(source.model, source.name)
            source.family.decoder(source.model, blocks=source.blocks)
            outcomes.append("built")
        except (GGUFError, CheckpointError) as error:
            assert "\n" not in str(error)
            outcomes.append(type(error).__name__)
        assert time.perf_counter() - start < 10

    check()
    assert "built" in outcomes and "GGUFError" in outcomes, outcomes  # both ends reached


# --- SmolLM2-135M-Instruct (the real file, fetched from PyPI and cached) ------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return read_gguf(smollm2_gguf)


def test_smollm2_metadata(smollm2):
    config = smollm2.hf_config
    assert smollm2.architecture == "llama"
    expected = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    expected |= dict(intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5, vocab_size=49152)
    expected |= dict(max_position_embeddings=8192, tie_word_embeddings=True, rope_scaling=None, attention_bias=False)
    assert {key: config[key] for key in expected} == expected
    # EOS 2 (<|im_end|>), and <|endoftext|> (0), which llama.cpp also ends generation at
    assert (smollm2.bos_token_id, smollm2.eos_token_ids) == (1, [2, 0])
    assert "<|im_start|>" in smollm2.chat_template
    assert "lm_head.weight" not in smollm2.tensor_names and len(smollm2.tensor_names) == 2 + 30 * 9
    kinds = {name: smollm2.quant_type(name) for name in smollm2.tensor_names[:4]}
    assert list(kinds.values()) == ["Q8_0", "F32", "Q4_1", "Q4_1"]


def test_smollm2_rotary_rows_are_unpermuted(smollm2):
    """Re-applying llama.cpp's permutation to our q/k gives the stored rows back; v is untouched."""
    from edgelm.export.gguf_blocks import dequantized

    for stem, hf, heads in (("attn_q", "q_proj", 9), ("attn_k", "k_proj", 3), ("attn_v", "v_proj", 0)):
        stored = smollm2._stored[f"blk.3.{stem}.weight"]
        raw = gguf.quants.dequantize(stored.data, stored.tensor_type)
        ours = smollm2.tensor(f"model.layers.3.self_attn.{hf}.weight")
        np.testing.assert_array_equal(_permute(ours, heads) if heads else ours, raw)
        assert not heads or not np.array_equal(ours, raw)
        runs = smollm2.matmul_nbits(f"model.layers.3.self_attn.{hf}.weight")
        np.testing.assert_allclose(dequantized(runs), ours, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2, smollm2_gguf):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ours = Tokenizer.from_str(smollm2.tokenizer_json)
    texts = [*TEXTS, "def f(x):\n    return x**2  # square\n", "In 1999 there were 12,345 items at $3.50."]
    texts += ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", "  \t\n\n  x"]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2, smollm2_transformers):
    reference = smollm2_transformers.state_dict()
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]:
        np.testing.assert_allclose(smollm2.tensor(name), reference[name].float().numpy(), rtol=0, atol=1e-6)
    for layer in (0, 29):
        for part in ("self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj"):
            name = f"model.layers.{layer}.{part}.weight"
            np.testing.assert_allclose(smollm2.tensor(name), reference[name].float().numpy(), rtol=0, atol=1e-6)
