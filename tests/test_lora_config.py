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
from pathlib import Path

import pytest
from helpers import LORA_BASES, edgelm, quiet, save_lora_base, save_peft_adapter, save_random_model

from edgelm.export.lora import SlotSpec, convert_adapter
from edgelm.export.onnx_export import export_package
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


def test_nested_record_is_one_line(setup, tmp_path):
    out = convert_adapter(setup["root"] / "every", setup["root"] / "pkg", tmp_path / "a.onnx_adapter")
    Path(f"{out}.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AdapterError, match="not valid JSON"):
        load(setup["root"] / "pkg", provider="cpu", threads=1).load_adapter(out)


def test_tied_lm_head_is_refused(setup, tmp_path):
    """Merging into a tied LM head would change the input embedding as well (the same tensor): refused."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(setup["tied"]), config)
    peft_model.save_pretrained(tmp_path / "head", save_embedding_layers=False)  # A and B only, no base weights
    with pytest.raises(AdapterError, match="shares its weight with model.embed_tokens"):
        export_package(setup["root"] / "tied", tmp_path / "out", lora=[(tmp_path / "head", 1.0)], progress=quiet)
    assert not (tmp_path / "out").exists()
