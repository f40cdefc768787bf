"""A PEFT adapter's config read as PEFT reads it, and refused in one line where it cannot be: which modules it
adapts (target_modules as names, a regex, "all-linear" or PEFT's default; layers_to_transform, layers_pattern,
exclude_modules) compared with PEFT itself on random configs (hypothesis) and, merged and exported, against
PEFT's logits; untrusted rank_pattern / alpha_pattern keys (no backtracking blowup, one-line errors for bad
ones); bad numbers (alpha_pattern strings, null, lists, NaN, inf, 0, negatives, true; rank 0); an lm_head
adapter on a tied base; an adapter record nested 100,000 deep."""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import LORA_BASES, edgelm, quiet, save_lora_base, save_peft_adapter, save_random_model

from edgelm.export.lora import SlotSpec, convert_adapter
from edgelm.export.onnx_export import export_package
from edgelm.export.peft_adapter import read_peft_adapter
from edgelm.runtime import AdapterError, load

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 99, 1200, 7, 640, 33]
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """Tiny Llama bases (tied and untied), a PEFT adapter on every linear of the untied one (rank 4), and a
    package with slots for every linear."""
    root = tmp_path_factory.mktemp("lora-config")
    tied = save_lora_base(root / "tied", "llama")
    classes, config = LORA_BASES["llama"]
    untied = save_random_model(root / "untied", classes, {**config, "tie_word_embeddings": False})
    save_peft_adapter(untied, root / "every", r=4, targets=LINEARS)
    export_package(root / "untied", root / "pkg", lora_slots=SlotSpec(["all"], 8), progress=quiet)
    return {"root": root, "tied": tied, "untied": untied}


def _variant(setup: dict, folder: Path, **changes) -> Path:
    """The every-linear adapter with some adapter_config.json values changed (None: removed)."""
    shutil.copytree(setup["root"] / "every", folder)
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    path.write_text(json.dumps(config))
    return folder


BAD_CONFIGS = {  # name: (adapter_config.json changes, message)
    **{f"alpha_pattern {value!r}": ({"alpha_pattern": {"q_proj": value}}, "alpha_pattern.*positive finite number")
       for value in ("8", None, [8], float("nan"), float("inf"), 0, -2, True)},
    **{f"rank_pattern {value!r}": ({"rank_pattern": {"q_proj": value}}, "rank_pattern.*positive integer")
       for value in (0, 2.5, True, "4", None)},
    "r 0": ({"r": 0}, "r must be a positive integer"),
    "lora_alpha nan": ({"lora_alpha": float("nan")}, "lora_alpha must be a positive number"),
    "rank_pattern (": ({"rank_pattern": {"(": 4}}, "not a valid regular expression"),
    "alpha_pattern a)|(b": ({"alpha_pattern": {"q_proj)|(": 2}}, "not a valid regular expression"),
    "rank_pattern lookahead": ({"rank_pattern": {"(?=q)q_proj": 4}}, "not supported"),
    "rank_pattern a list": ({"rank_pattern": [["q_proj", 4]]}, "rank_pattern must be an object"),
    "target_modules (": ({"target_modules": "("}, "target_modules pattern"),
    "target_modules 5": ({"target_modules": 5}, "target_modules must be a list"),
    "exclude_modules [": ({"exclude_modules": "[a"}, "exclude_modules pattern"),
    "layers_to_transform '0'": ({"layers_to_transform": "0"}, "layer index"),
    "layers_pattern a regex": ({"layers_to_transform": [0], "layers_pattern": "(.*)*"}, "must be the name"),
    "layers_pattern alone": ({"layers_pattern": "layers"}, "needs layers_to_transform"),
    "layers with a regex": ({"target_modules": ".*q_proj", "layers_to_transform": 0}, "cannot be used"),
    "target_parameters": ({"target_parameters": ["mlp.experts"]}, "target_parameters"),
    "targets nothing": ({"target_modules": ["nothing"]}, "select none"),
    "patterns too large together": ({"rank_pattern": {f"(x|y){{{n}}}": 4 for n in range(100, 140)}}, "too large"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_configs_are_one_line_errors(setup, tmp_path, case):
    changes, message = BAD_CONFIGS[case]
    folder = _variant(setup, tmp_path / "adapter", **changes)
    with pytest.raises(AdapterError, match=message):
        convert_adapter(folder, setup["root"] / "pkg", tmp_path / "a.onnx_adapter")
    assert not (tmp_path / "a.onnx_adapter").exists()


def test_cli_bad_values_are_one_line(setup, tmp_path):
    root = setup["root"]
    nan = _variant(setup, tmp_path / "nan", alpha_pattern={"q_proj": float("nan")})
    for args in (
        ("adapter", "convert", nan, root / "pkg", tmp_path / "a.onnx_adapter"),
        ("adapter", "convert", root / "every", root / "pkg", tmp_path / "a.onnx_adapter", "--scale", "nan"),
        ("export", root / "untied", tmp_path / "out", "--lora", f"{nan}:1"),
    ):
        done = edgelm(*args)
        assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
    assert not (tmp_path / "a.onnx_adapter").exists() and not (tmp_path / "out").exists()


def test_backtracking_patterns_finish(setup, tmp_path):
    """PEFT runs these keys with re, which never finishes on `(.*)*x` (a module path is 30 characters); edgelm
    gives PEFT's answer (no match: the default rank and alpha) at once."""
    folder = _variant(setup, tmp_path / "hostile", rank_pattern={"(.*)*x": 8}, alpha_pattern={"(a|aa)*(.*)*y": 3})
    done = edgelm("adapter", "convert", folder, setup["root"] / "pkg", tmp_path / "a.onnx_adapter", timeout=120)
    assert done.returncode == 0, done.stderr
    plain = convert_adapter(setup["root"] / "every", setup["root"] / "pkg", tmp_path / "plain.onnx_adapter")
    assert (tmp_path / "a.onnx_adapter").read_bytes() == plain.read_bytes()


def test_many_plain_keys_are_quick(setup, tmp_path):
    """A rank_pattern naming every module of a large model (as AdaLoRA and EVA write them) matches at re's speed."""
    parts = [f"{'mlp' if name in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{name}" for name in LINEARS]
    keys = {f"model.layers.{i}.{part}": 4 for i in range(80) for part in parts}
    folder = _variant(setup, tmp_path / "many", rank_pattern=keys, alpha_pattern={k: 3 for k in keys})
    start = time.process_time()
    adapter = read_peft_adapter(folder)
    adapter.select_by_name(model_type="llama")
    assert time.process_time() - start < 5
    assert {w.scale for w in adapter.modules.values()} == {0.75}


def test_nested_record_is_one_line(setup, tmp_path):
    out = convert_adapter(setup["root"] / "every", setup["root"] / "pkg", tmp_path / "a.onnx_adapter")
    Path(f"{out}.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AdapterError, match="not valid JSON"):
        load(setup["root"] / "pkg", provider="cpu", threads=1).load_adapter(out)


def test_lm_head_adapter_on_a_tied_base_unties_it(setup, tmp_path):
    """Merging into a tied LM head would change the input embedding as well (one tensor): the head is untied
    first, so the package gives PEFT's logits (PEFT's forward adds the LoRA to the head alone)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    reference = get_peft_model(copy.deepcopy(setup["tied"]), config).eval()
    reference.save_pretrained(tmp_path / "head", save_embedding_layers=False)  # A and B only, no base weights
    export_package(setup["root"] / "tied", tmp_path / "out", lora=[(tmp_path / "head", 1.0)], progress=quiet)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    logits, _ = load(tmp_path / "out", provider="cpu", threads=1).forward(np.array([PROMPT]))
    assert np.abs(logits[0] - expected).max() < 1e-4  # a changed input embedding would move every position


# ---- targeting against PEFT ----------------------------------------------------------------------------

NAMES = [*LINEARS, "self_attn.q_proj", "mlp.down_proj", "layers.1.mlp.up_proj", "model.layers.0.self_attn.k_proj",
         "lm_head", "attn.q_proj", "nothing"]  # fmt: skip
REGEXES = [r".*\.(q|k)_proj", r"model\.layers\.[01]\.mlp\.(up|down)_proj", r".*_proj", r".*layers\.1\..*(v|o)_proj",
           r"lm_head|.*v_proj", r"(.*\.)*gate_proj", r".*\.q"]  # fmt: skip
# no (.*)*x: PEFT never finishes
KEYS = [*NAMES[:6], r"layers\.0\..*", r"q_proj|v_proj", r"mlp\.\w+", r"model.layers.1.self_attn.o_proj"]


def _configs():
    """Random LoraConfig arguments; about one in six is one PEFT refuses (layers with a string target_modules,
    targets matching no module)."""
    from hypothesis import strategies as st

    names = st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True)
    layers = st.one_of(st.integers(0, 2), st.lists(st.integers(0, 2), max_size=2, unique=True))
    pattern = st.sampled_from([None, "layers", ["h", "layers"], "model.layers", "h"])

    @st.composite
    def config(draw) -> dict:
        targets = draw(st.one_of(st.none(), st.just("all-linear"), names, names, st.sampled_from(REGEXES)))
        by_layer = draw(st.integers(0, 5)) >= (5 if isinstance(targets, str) else 3)  # PEFT refuses it with a str
        chosen = {
            "r": draw(st.integers(1, 4)), "lora_alpha": draw(st.integers(1, 16)), "use_rslora": draw(st.booleans()),
            "target_modules": targets,
            "exclude_modules": draw(st.one_of(st.none(), st.none(), names, st.sampled_from(REGEXES))),
            "rank_pattern": draw(st.dictionaries(st.sampled_from(KEYS), st.integers(1, 6), max_size=2)),
            "alpha_pattern": draw(st.dictionaries(st.sampled_from(KEYS), st.integers(1, 20), max_size=2)),
        }  # fmt: skip
        if by_layer:
            chosen["layers_to_transform"] = draw(layers)
            chosen["layers_pattern"] = draw(pattern)
        return chosen

    return config()


def _peft_choice(hf, config: dict) -> dict[str, tuple[int, float]] | None:
    """PEFT's own answer: module path -> (rank, scaling) of every module it adapts; None when it refuses."""
    from peft import LoraConfig, get_peft_model

    try:
        peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(**config))
    except ValueError:
        return None
    prefix = "base_model.model."
    return {
        name[len(prefix) :]: (module.r["default"], module.scaling["default"])
        for name, module in peft_model.named_modules()
        if hasattr(module, "lora_A") and "default" in module.lora_A
    }


def _file_for_every_linear(hf, folder: Path, config: dict, ranks: dict[str, int]) -> Path:
    """An adapter folder with `config` and A/B weights for every linear of hf (lm_head included) at the given
    ranks (the config's r elsewhere): more modules than the config selects."""
    from safetensors.numpy import save_file

    generator = np.random.default_rng(0)
    tensors = {}
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            rank = ranks.get(name, config["r"])
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = generator.standard_normal((rank, module.in_features), np.float32)
            tensors[f"{key}.lora_B.weight"] = generator.standard_normal((module.out_features, rank), np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return folder


def test_targeting_matches_peft_on_random_configs(setup, tmp_path_factory):
    """Random target_modules (names, regexes, all-linear, PEFT's default), layers_to_transform, layers_pattern,
    exclude_modules, rank_pattern and alpha_pattern: edgelm adapts the modules PEFT adapts, with PEFT's ranks and
    scales, and refuses (AdapterError) exactly the configs PEFT refuses."""
    from hypothesis import HealthCheck, given, settings

    from edgelm.export.peft_adapter import read_peft_adapter

    hf = setup["untied"]
    modules = {name: isinstance(module, torch.nn.Linear) for name, module in hf.named_modules()}
    root = tmp_path_factory.mktemp("targeting")
    count = iter(range(10**6))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_configs())
    def check(config):
        config = {key: value for key, value in config.items() if value is not None}
        expected = _peft_choice(hf, config)
        folder = root / str(next(count))
        ranks = {name: rank for name, (rank, _) in (expected or {}).items()}
        _file_for_every_linear(hf, folder, config, ranks)
        if expected is None:
            with pytest.raises(AdapterError):
                read_peft_adapter(folder).select(modules, model_type="llama")
            return
        adapter = read_peft_adapter(folder)
        adapter.select(modules, model_type="llama")
        assert set(adapter.modules) == set(expected), config
        for name, (rank, scaling) in expected.items():
            assert adapter.modules[name].rank == rank and adapter.modules[name].scale == pytest.approx(scaling)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check()


PARITY = {  # name: adapter_config.json changes to the every-linear adapter (whose file keeps all its weights)
    "layers_to_transform": {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1],
                            "layers_pattern": "layers"},
    "regex and exclude": {"target_modules": r".*\.(k|o|up)_proj", "exclude_modules": r".*layers\.0\..*o_proj"},
    "default targets": {"target_modules": None, "exclude_modules": ["model.layers.1.self_attn.v_proj"]},
    "all-linear": {"target_modules": "all-linear", "exclude_modules": ["gate_proj"],
                   "rank_pattern": {}, "alpha_pattern": {r"layers\.1\..*": 3}},
}  # fmt: skip


@pytest.fixture(scope="module")
def peft_references(setup, tmp_path_factory) -> dict:
    """case -> (adapter folder, PEFT's logits for PROMPT with the adapter loaded by PeftModel.from_pretrained)."""
    from peft import PeftModel

    root = tmp_path_factory.mktemp("parity")
    out = {}
    for case, changes in PARITY.items():
        folder = _variant(setup, root / case.replace(" ", "-"), **changes)
        peft_model = PeftModel.from_pretrained(copy.deepcopy(setup["untied"]), folder).eval()
        with torch.no_grad():
            out[case] = (folder, peft_model(torch.tensor([PROMPT])).logits[0].numpy())
    return out


@pytest.mark.parametrize("case", PARITY)
def test_merged_export_equals_peft(setup, peft_references, tmp_path, case):
    """Merged at export: PEFT's logits (the file's weights for unselected modules would move them by far more)."""
    folder, expected = peft_references[case]
    export_package(setup["root"] / "untied", tmp_path / "pkg", lora=[(folder, 1.0)], progress=quiet)
    logits, _ = load(tmp_path / "pkg", provider="cpu", threads=1).forward(np.array([PROMPT]))
    assert np.abs(logits[0] - expected).max() < 1e-4
    _, every = peft_references["all-linear"] if case != "all-linear" else peft_references["default targets"]
    assert np.abs(every - expected).max() > 1e-2  # the cases differ: targeting matters


def test_converted_adapter_equals_peft(setup, peft_references, tmp_path):
    """Converted for slots: the same selection, PEFT's logits."""
    folder, expected = peft_references["regex and exclude"]
    out = convert_adapter(folder, setup["root"] / "pkg", tmp_path / "a.onnx_adapter")
    model = load(setup["root"] / "pkg", provider="cpu", threads=1)
    model.load_adapter(out)
    logits, _ = model.forward(np.array([PROMPT]), adapter="a")
    assert np.abs(logits[0] - expected).max() < 1e-4


def test_lm_head_adapter_on_an_untied_base(setup, tmp_path):
    """PEFT saves an LM head's own weight beside its LoRA (save_embedding_layers): the model's own weight is
    accepted and the merge gives PEFT's logits; another weight (a resized vocabulary) is refused."""
    from safetensors.numpy import load_file, save_file

    reference = save_peft_adapter(setup["untied"], tmp_path / "head", r=4, targets=["q_proj", "lm_head"])
    weights = tmp_path / "head" / "adapter_model.safetensors"
    assert "base_model.model.lm_head.base_layer.weight" in load_file(str(weights))
    export_package(setup["root"] / "untied", tmp_path / "pkg", lora=[(tmp_path / "head", 1.0)], progress=quiet)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    logits, _ = load(tmp_path / "pkg", provider="cpu", threads=1).forward(np.array([PROMPT]))
    assert np.abs(logits[0] - expected).max() < 1e-4
    tensors = load_file(str(weights))
    tensors["base_model.model.lm_head.base_layer.weight"][0, 0] += 1
    save_file(tensors, str(weights))
    with pytest.raises(AdapterError, match="differs from this model's"):
        export_package(setup["root"] / "untied", tmp_path / "other", lora=[(tmp_path / "head", 1.0)], progress=quiet)
    with pytest.raises(AdapterError, match="has no LoRA slot"):
        convert_adapter(tmp_path / "head", setup["root"] / "pkg", tmp_path / "a.onnx_adapter")
