"""GGUF metadata trusted no further than it can be checked: every number export reads is of its type and in its
range (a NaN rotary base, a zero epsilon, a context of 2**31), every token id an integer inside the vocabulary,
the tokenizer no larger than the embedding, and a hostile SentencePiece vocabulary built in linear time. Each
case is a tiny valid GGUF (tests/export/test_gguf.py) rewritten with one value changed by llama.cpp's own writer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGUFValueType as V  # noqa: E402
from helpers import rewrite_gguf  # noqa: E402
from test_gguf import VOCAB, write_gguf  # noqa: E402  (pytest puts tests/ on the path)
from tokenizers import Tokenizer  # noqa: E402

from edgelm.cli import main  # noqa: E402
from edgelm.export.gguf import GGUFError, read_gguf  # noqa: E402
from edgelm.export.gguf_header import read_header  # noqa: E402
from edgelm.export.gguf_tokenizer import MAX_MERGED_LENGTH, build_tokenizer_json  # noqa: E402

NAN = float("nan")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny")
    return {arch: write_gguf(folder, arch) for arch in ("llama", "gpt2")}


def _tokens_plus(path: Path, extra: int) -> dict:
    """Changes that append `extra` ordinary tokens to the tokenizer (the embedding keeps its rows)."""
    meta = read_header(path).metadata
    tokens = meta["tokenizer.ggml.tokens"] + [f"extra{i}" for i in range(extra)]
    types = meta["tokenizer.ggml.token_type"] + [1] * extra
    return {
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
    }


LINEAR = {"llama.rope.scaling.type": ("linear", V.STRING)}
# name -> (architecture, metadata changes, what the one-line error must say)
BAD = {
    "eot id 1.5": ("llama", {"tokenizer.ggml.eot_token_id": (1.5, V.FLOAT32)}, "eot_token_id should be one integer"),
    "eos id list": ("llama", {"tokenizer.ggml.eos_token_id": ([1, 2], V.ARRAY, V.UINT32)}, "not [1, 2]"),
    "eos id string": ("llama", {"tokenizer.ggml.eos_token_id": ("2", V.STRING)}, "not '2'"),
    "eos id bool": ("llama", {"tokenizer.ggml.eos_token_id": (True, V.BOOL)}, "not True"),
    "unknown id 1.5": ("llama", {"tokenizer.ggml.unknown_token_id": (1.5, V.FLOAT32)}, "unknown_token_id"),
    "padding id past the vocabulary": (
        "llama",
        {"tokenizer.ggml.padding_token_id": (VOCAB, V.UINT32)},
        f"padding_token_id = {VOCAB} is outside the tokenizer's {VOCAB} tokens",
    ),
    "context 2**31 - 1": ("llama", {"llama.context_length": (2**31 - 1, V.UINT32)}, "limit of 16777216"),
    "context 2**31": ("llama", {"llama.context_length": (2**31, V.UINT64)}, "context_length = 2147483648"),
    "context 2**24 + 1 (gpt2)": ("gpt2", {"gpt2.context_length": (2**24 + 1, V.UINT32)}, "float32"),
    "context 4": ("llama", {"llama.context_length": (4, V.UINT32)}, "below 8 positions"),
    "rope base NaN": ("llama", {"llama.rope.freq_base": (NAN, V.FLOAT32)}, "freq_base = nan is out of range"),
    "rope base 0": ("llama", {"llama.rope.freq_base": (0.0, V.FLOAT32)}, "freq_base = 0.0"),
    "rope base negative": ("llama", {"llama.rope.freq_base": (-10000.0, V.FLOAT32)}, "above 0"),
    "rope base inf": ("llama", {"llama.rope.freq_base": (1e300, V.FLOAT64)}, "freq_base = inf"),
    "scaling factor NaN": ("llama", LINEAR | {"llama.rope.scaling.factor": (NAN, V.FLOAT32)}, "factor = nan"),
    "scaling factor 0": ("llama", LINEAR | {"llama.rope.scaling.factor": (0.0, V.FLOAT32)}, "factor = 0.0"),
    "scaling factor negative": ("llama", LINEAR | {"llama.rope.scaling.factor": (-2.0, V.FLOAT32)}, "factor = -2.0"),
    "epsilon NaN": ("llama", {"llama.attention.layer_norm_rms_epsilon": (NAN, V.FLOAT32)}, "epsilon = nan"),
    "epsilon 0": ("llama", {"llama.attention.layer_norm_rms_epsilon": (0.0, V.FLOAT32)}, "epsilon = 0.0"),
    "epsilon negative": ("llama", {"llama.attention.layer_norm_rms_epsilon": (-1e-5, V.FLOAT32)}, "above 0"),
    "epsilon 1": ("llama", {"llama.attention.layer_norm_rms_epsilon": (1.0, V.FLOAT32)}, "below 1"),
    "gpt2 epsilon NaN": ("gpt2", {"gpt2.attention.layer_norm_epsilon": (NAN, V.FLOAT32)}, "epsilon = nan"),
    "gpt2 epsilon string": ("gpt2", {"gpt2.attention.layer_norm_epsilon": ("1e-5", V.STRING)}, "single float"),
    "head count NaN": ("llama", {"llama.attention.head_count": (NAN, V.FLOAT32)}, "head_count should be a single"),
    "head count 4.0": ("llama", {"llama.attention.head_count": (4.0, V.FLOAT32)}, "not 4.0"),
    "head count 0": ("llama", {"llama.attention.head_count": (0, V.UINT32)}, "head_count = 0"),
    "head count negative": ("llama", {"llama.attention.head_count": (-4, V.INT32)}, "head_count = -4"),
    "kv heads do not divide heads": ("llama", {"llama.attention.head_count_kv": (3, V.UINT32)}, "not a multiple"),
    "layers list": ("llama", {"llama.block_count": ([2], V.ARRAY, V.UINT32)}, "block_count should be a single"),
    "odd rotary width": (
        "llama",
        {"llama.rope.dimension_count": (15, V.UINT32)},
        "rope.dimension_count 15 with heads of 15: edgelm rotates whole, even heads",
    ),
    "rotary width string": (
        "llama",
        {"llama.rope.dimension_count": ("16", V.STRING)},
        "metadata llama.rope.dimension_count should be a single int, not '16'",
    ),
    "unknown pre-tokenizer": (
        "gpt2",
        {"tokenizer.ggml.pre": ("no-such-bpe", V.STRING)},
        "tokenizer: unknown BPE pre-tokenizer 'no-such-bpe' (tokenizer.ggml.pre); known: [",
    ),
    "gpt2 width not a multiple of heads": ("gpt2", {"gpt2.attention.head_count": (5, V.UINT32)}, "not a multiple"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_metadata_is_a_one_line_error(name, tiny, tmp_path):
    arch, changes, expected = BAD[name]
    path = rewrite_gguf(tiny[arch], tmp_path / "bad.gguf", changes)
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith("bad.gguf: "), message
    assert expected in message, message


# tensor of the wrong rank: (architecture, tensor, its values' new shape from the old, what the error must say)
WRONG_RANK = {
    "1-D token_embd": ("llama", "token_embd.weight", lambda s: (-1,), f"token_embd.weight has shape ({VOCAB * 64},), "),
    "1-D gpt2 token_embd": ("gpt2", "token_embd.weight", lambda s: (-1,), "expected (vocabulary, 64)"),
    "3-D token_embd": ("llama", "token_embd.weight", lambda s: (1, *s), f"shape (1, {VOCAB}, 64), expected (vocab"),
    "1-D attn_q": ("llama", "blk.0.attn_q.weight", lambda s: (-1,), "blk.0.attn_q.weight has shape (4096,), expected"),
    "2-D norm": ("llama", "output_norm.weight", lambda s: (1, -1), "output_norm.weight has shape (1, 64), expected"),
    "2-D gpt2 position_embd": ("gpt2", "position_embd.weight", lambda s: (2, -1), "has shape (2, 32768), expected"),
}


@pytest.mark.parametrize("case", sorted(WRONG_RANK))
def test_tensor_of_the_wrong_rank_is_a_one_line_error(case, tiny, tmp_path):
    arch, name, shape, expected = WRONG_RANK[case]
    values = next(t for t in gguf.GGUFReader(tiny[arch]).tensors if t.name == name).data
    values = np.asarray(values, dtype=np.float32)
    path = rewrite_gguf(tiny[arch], tmp_path / "rank.gguf", {}, tensors={name: values.reshape(shape(values.shape))})
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_cli_one_dimensional_token_embd_exits_1(tiny, tmp_path, capsys):
    values = np.asarray(next(t for t in gguf.GGUFReader(tiny["llama"]).tensors if t.name == "token_embd.weight").data)
    path = rewrite_gguf(tiny["llama"], tmp_path / "flat.gguf", {}, tensors={"token_embd.weight": values.reshape(-1)})
    assert main(["export", str(path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert (
        err == f"edgelm export: error: flat.gguf: tensor token_embd.weight has shape ({values.size},), expected "
        "(vocabulary, 64)\n"
    )


# rope_freqs.weight (head_dim 16: 8 factors) -> what the one-line error must say
BAD_ROPE_FREQS = {
    "4 factors": (np.ones(4), "has shape (4,), expected (8,)"),
    "2-D": (np.ones((2, 8)), "has shape (2, 8), expected (8,)"),
    "a zero factor": (np.array([1, 0, 1, 1, 1, 1, 1, 1]), "not positive finite numbers"),
    "a negative factor": (np.array([1, 1, 1, 1, 1, 1, 1, -8]), "not positive finite numbers"),
    "a NaN factor": (np.array([1, 1, NAN, 1, 1, 1, 1, 1]), "not positive finite numbers"),
    "an infinite factor": (np.array([np.inf, 1, 1, 1, 1, 1, 1, 1]), "not positive finite numbers"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROPE_FREQS))
def test_bad_rope_freqs_is_a_one_line_error(case, tiny, tmp_path):
    factors, expected = BAD_ROPE_FREQS[case]
    add = lambda writer: writer.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))  # noqa: E731
    path = rewrite_gguf(tiny["llama"], tmp_path / "freqs.gguf", {}, add=add)
    with pytest.raises(GGUFError, match=r"^freqs\.gguf: tensor rope_freqs\.weight ") as info:
        read_gguf(path)
    assert expected in str(info.value)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_rope_freqs_outside_llama_files_is_an_unexpected_tensor(arch, tiny, tmp_path):
    """llama.cpp reads rope_freqs.weight in Llama files only (its Qwen2 and Gemma 3 ropes take no factors)."""
    from family_cases import Families

    if arch == "qwen2":
        source = write_gguf(tmp_path, "qwen2")
    else:
        source = Families(tmp_path).gguf("gemma3_text")
    add = lambda writer: writer.add_tensor("rope_freqs.weight", np.ones(16, np.float32))  # noqa: E731
    path = rewrite_gguf(source, tmp_path / "freqs.gguf", {}, add=add)
    with pytest.raises(GGUFError, match=f"unexpected tensor rope_freqs.weight for architecture {arch}"):
        read_gguf(path)


def test_tokenizer_larger_than_embedding_is_refused(tiny, tmp_path):
    path = rewrite_gguf(tiny["llama"], tmp_path / "bad.gguf", _tokens_plus(tiny["llama"], 3))
    with pytest.raises(GGUFError, match=f"the tokenizer has {VOCAB + 3} tokens but token_embd.weight only {VOCAB}"):
        read_gguf(path)


def test_tokenizer_smaller_than_embedding_is_padding(tiny, tmp_path):
    meta = read_header(tiny["llama"]).metadata
    tokens, types = meta["tokenizer.ggml.tokens"][:-8], meta["tokenizer.ggml.token_type"][:-8]
    merges = [m for m in meta["tokenizer.ggml.merges"] if "".join(m.split(" ")) in set(tokens)]
    changes = {
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (merges, V.ARRAY, V.STRING),
    }
    model = read_gguf(rewrite_gguf(tiny["llama"], tmp_path / "padded.gguf", changes))
    assert model.hf_config["vocab_size"] == VOCAB  # the embedding's rows, not the tokenizer's count


@pytest.mark.parametrize("key", ["llama.rope.scaling.factor", "llama.rope.scale_linear"])
def test_scaling_factor_without_a_type_is_linear(key, tiny, tmp_path):
    """llama.cpp's reading (its type defaults to linear): ignoring the factor would change the model silently."""
    model = read_gguf(rewrite_gguf(tiny["llama"], tmp_path / "scaled.gguf", {key: (4.0, V.FLOAT32)}))
    assert model.hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    none = {"llama.rope.scaling.type": ("none", V.STRING), key: (NAN, V.FLOAT32)}
    assert read_gguf(rewrite_gguf(tiny["llama"], tmp_path / "none.gguf", none)).hf_config["rope_scaling"] is None


def test_gpt2_end_of_turn_beside_eos_exports(tiny, tmp_path, capsys):
    """Two stop ids in a GPT-2 file: GPT2Config holds one, but the package keeps both (it was refused)."""
    path = rewrite_gguf(tiny["gpt2"], tmp_path / "eot.gguf", {"tokenizer.ggml.eot_token_id": (5, V.UINT32)})
    assert main(["export", str(path), str(tmp_path / "out")]) == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "edgelm.json").read_text())
    assert manifest["tokenizer"]["eos_token_ids"] == [0, 5]


def test_token_ids_kept_as_given(tiny):
    model = read_gguf(tiny["llama"])
    assert (model.bos_token_id, model.eos_token_ids, model.pad_token_id) == (0, [0], None)


@pytest.mark.parametrize(
    "case",
    ["eot id 1.5", "context 2**31 - 1", "rope base NaN", "scaling factor 0", "epsilon negative", "head count NaN"],
)
def test_cli_bad_metadata_exits_1_and_writes_nothing(case, tiny, tmp_path, capsys):
    arch, changes, expected = BAD[case]
    path = rewrite_gguf(tiny[arch], tmp_path / "bad.gguf", changes)
    before = set(tmp_path.iterdir())
    assert main(["export", str(path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("edgelm export: error: bad.gguf: ") and expected in err, err
    assert set(tmp_path.iterdir()) == before, "nothing written"


def test_cli_tokenizer_larger_than_embedding_exits_1(tiny, tmp_path, capsys):
    path = rewrite_gguf(tiny["gpt2"], tmp_path / "bad.gguf", _tokens_plus(tiny["gpt2"], 1))
    assert main(["export", str(path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer has" in err, err
    assert not (tmp_path / "out").exists()


def test_cli_context_whose_rotary_tables_do_not_fit_exits_1(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("edgelm.runtime.kvcache.available_memory_bytes", lambda: 1 << 20)  # a 1 MiB machine
    path = rewrite_gguf(tiny["llama"], tmp_path / "long.gguf", {"llama.context_length": (1 << 16, V.UINT32)})
    before = set(tmp_path.iterdir())
    assert main(["export", str(path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "out of memory: the rotary cos and sin tables" in err and "65536 positions" in err, err
    assert set(tmp_path.iterdir()) == before, "nothing written"


# --- SentencePiece vocabularies: merges rebuilt in time linear in the vocabulary ---------------------------------


def _spm_meta(*extra: tuple[str, int]) -> dict:
    """A small SentencePiece vocabulary (llama.cpp's `llama` tokenizer model) with `extra` (token, type) appended."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "a", "b", "ab", "\u2581a"]
    types = [2, 3, 3, *[6] * 256, 1, 1, 1, 1, 1]
    tokens += [token for token, _ in extra]
    types += [kind for _, kind in extra]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_spm_piece_of_a_megabyte_is_refused_at_once(tiny, tmp_path):
    meta = read_header(tiny["llama"]).metadata
    tokens = meta["tokenizer.ggml.tokens"][:-1] + ["ab" * 500_000]  # the last token becomes 1 MB long
    changes = {
        "tokenizer.ggml.model": ("llama", V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": ([-float(i) for i in range(len(tokens))], V.ARRAY, V.FLOAT32),
    }
    path = rewrite_gguf(tiny["llama"], tmp_path / "long.gguf", changes)
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=f"token {len(tokens) - 1} is an ordinary SentencePiece piece of 1000000 char"):
        read_gguf(path)
    assert time.perf_counter() - start < 30  # minutes before: every cut sliced the whole megabyte


def test_spm_long_special_tokens_need_no_merges():
    tokenizer = Tokenizer.from_str(build_tokenizer_json(_spm_meta(("<" + "x" * 1_000_000 + ">", 4))))
    assert tokenizer.get_vocab_size() == 265


def test_spm_merges_up_to_the_limit_are_kept():
    # "a" * k for k up to the limit: each splits k - 1 ways, all of them merges (the worst case per character)
    pieces = [("a" * k, 1) for k in range(2, MAX_MERGED_LENGTH + 1)]
    tokenizer = Tokenizer.from_str(build_tokenizer_json(_spm_meta(*pieces)))
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    assert len(merges) == 2 + sum(k - 1 for k in range(2, MAX_MERGED_LENGTH + 1))  # "ab", "▁a" and the a-runs
    # "▁a" outranks the runs (a higher score), then the runs merge up to the longest piece
    encoded = tokenizer.encode("a" * MAX_MERGED_LENGTH, add_special_tokens=False).tokens
    assert encoded == ["\u2581a", "a" * (MAX_MERGED_LENGTH - 1)]
    with pytest.raises(ValueError, match=f"piece of {MAX_MERGED_LENGTH + 1} characters"):
        build_tokenizer_json(_spm_meta(*pieces, ("a" * (MAX_MERGED_LENGTH + 1), 1)))


# --- the property: any value in any numeric or token-id key ------------------------------------------------------

ARCH_KEYS = {
    "llama": [
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "block_count",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "rope.dimension_count",
        "rope.freq_base",
        "rope.scaling.factor",
        "attention.layer_norm_rms_epsilon",
    ],
    "gpt2": [
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "block_count",
        "attention.head_count",
        "attention.layer_norm_epsilon",
    ],
}
TOKEN_KEYS = [f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "eot", "padding", "unknown")]


INT_TYPES = [V.INT64, V.INT32]  # the signed types that hold a value below 2**31, or only INT64 below 2**32


def _float_types(value: float) -> list:
    """FLOAT64 always; FLOAT32 too unless the value is finite but past its range (the writer cannot pack it)."""
    return [V.FLOAT64] + ([V.FLOAT32] if not 3e38 < abs(value) < float("inf") else [])


def _values():
    """(value, GGUF type) pairs: non-finite, zero, negative, huge, fractional, wrong types, and plausible values."""
    from hypothesis import strategies as st

    floats = st.one_of(
        st.sampled_from([NAN, float("inf"), float("-inf"), 0.0, -0.0, 1e-45, 1e-30, 1e30, 1e300, 1.5, -1e-5]),
        st.floats(1e-7, 0.999),
        st.floats(1.0, 1e7),
        st.floats(allow_nan=True, allow_infinity=True),
    )
    ints = st.one_of(
        st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 16, 2**24 + 1, 2**31 - 1, 2**31, 2**32 - 1]),
        st.integers(1, 4096),
    )
    return st.one_of(
        floats.flatmap(lambda v: st.tuples(st.just(v), st.sampled_from(_float_types(v)))),
        ints.flatmap(
            lambda v: st.tuples(st.just(v), st.sampled_from([V.UINT32, V.UINT64, *INT_TYPES[: 2 - v // 2**31]]))
        ),
        st.tuples(st.integers(-(2**31), -1), st.sampled_from([V.INT32, V.INT64])),
        st.tuples(st.booleans(), st.just(V.BOOL)),
        st.tuples(st.sampled_from(["1", "nan", "", "1e-5"]), st.just(V.STRING)),
        st.tuples(st.lists(st.integers(0, 100), min_size=1, max_size=3), st.just(V.ARRAY), st.just(V.UINT32)),
    )


@pytest.mark.parametrize("arch", sorted(ARCH_KEYS))
def test_any_metadata_value_gives_an_error_or_a_working_package(arch, tiny, tmp_path, capsys):
    """A one-line error, exit 1 and nothing written; or exit 0 and a package that loads and whose logits are
    finite. Never exit 0 with a package that cannot generate."""
    hypothesis = pytest.importorskip("hypothesis")
    from edgelm.runtime import load

    st = hypothesis.strategies
    key = st.one_of(st.sampled_from(ARCH_KEYS[arch]).map(lambda k: f"{arch}.{k}"), st.sampled_from(TOKEN_KEYS))
    counter = iter(range(10**6))

    @hypothesis.settings(max_examples=15, deadline=None, database=None)
    @hypothesis.given(changes=st.dictionaries(key, _values(), min_size=1, max_size=2), linear=st.booleans())
    def check(changes, linear):
        folder = tmp_path / str(next(counter))
        folder.mkdir()
        if linear and arch == "llama":  # the factor is read only with a type (or alone)
            changes = LINEAR | {"llama.rope.scaling.factor": (2.0, V.FLOAT32)} | changes
        path = rewrite_gguf(tiny[arch], folder / "fuzz.gguf", changes)
        capsys.readouterr()
        code = main(["export", str(path), str(folder / "out")])
        err = capsys.readouterr().err
        if code != 0:
            assert code == 1 and err.count("\n") == 1 and err.startswith("edgelm export: error: "), err
            assert sorted(p.name for p in folder.iterdir()) == ["fuzz.gguf"], "nothing written"
            return
        model = load(folder / "out")
        logits, _ = model.forward(np.array([[0, 5, 17, 300]], dtype=np.int64))
        assert np.isfinite(logits).all(), changes
        result = model.generate([5, 17, 300], 4, ignore_eos=True)
        assert len(result.token_ids) == 4

    check()


@pytest.mark.parametrize("score", [NAN, float("inf"), "1"])
def test_spm_scores_are_finite_numbers(score):
    meta = _spm_meta()
    meta["tokenizer.ggml.scores"][262] = score
    with pytest.raises(ValueError, match=r"tokenizer.ggml.scores\[262\] is .*, not a finite number"):
        build_tokenizer_json(meta)


def test_positive_but_denormal_scaling_factor_is_refused_when_frequencies_overflow(tiny, tmp_path, capsys):
    """Each value in range, the frequencies they make are not (1 / 1e-45 overflows float32): checked as built."""
    changes = LINEAR | {"llama.rope.scaling.factor": (1e-45, V.FLOAT32)}
    path = rewrite_gguf(tiny["llama"], tmp_path / "denormal.gguf", changes)
    assert read_gguf(path).hf_config["rope_scaling"]["factor"] == 1e-45
    assert main(["export", str(path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rotary frequencies are not finite" in err, err
    assert not (tmp_path / "out").exists()
