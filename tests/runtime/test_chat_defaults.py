"""Chat sampling defaults: a folder's generation_config.json carried into the package (the manifest's `sampling`,
validated), used by `edgelm chat` when it says do_sample: true, else edgelm's chat defaults; --greedy for exact runs;
`edgelm generate` stays greedy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pytest
from chat_package import make_chat_folder
from helpers import edgelm, edit_manifest, quiet

from edgelm.runtime import PackageError, load
from edgelm.runtime.chat_defaults import CHAT_SAMPLING, FROM_EDGELM, FROM_MODEL, chat_sampling
from edgelm.runtime.contract import Sampling

RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 20}


@pytest.fixture(scope="module")
def recommending(tmp_path_factory):
    """A chat package exported from a folder whose generation_config.json recommends sampling (and one value the
    sampler cannot take), with the warnings export gave."""
    from edgelm.export.onnx_export import export_package

    folder = make_chat_folder(tmp_path_factory.mktemp("sampling") / "checkpoint")
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | RECOMMENDED | {"repetition_penalty": -2}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = export_package(folder, folder.parent / "pkg", progress=quiet)
    return folder.parent / "pkg", manifest, [str(w.message) for w in caught]


def test_export_records_the_recommended_sampling(recommending):
    package, manifest, warned = recommending
    assert manifest["sampling"] == RECOMMENDED | {"min_p": None, "repetition_penalty": None}
    assert any("repetition_penalty must be a finite number > 0" in w and "left out" in w for w in warned), warned
    assert load(package, provider="cpu").spec.manifest.sampling == Sampling(**RECOMMENDED)


def test_a_folder_without_sampling_records_none(package):
    assert "sampling" not in json.loads((package / "edgelm.json").read_text())
    assert load(package, provider="cpu").spec.manifest.sampling is None


def test_chat_sampling_rules():
    assert chat_sampling(None) == (CHAT_SAMPLING, FROM_EDGELM)
    # without do_sample: true, transformers decodes greedily: no recommendation
    assert chat_sampling(Sampling(temperature=0.3)) == (CHAT_SAMPLING, FROM_EDGELM)
    assert chat_sampling(Sampling(do_sample=False, temperature=0.3)) == (CHAT_SAMPLING, FROM_EDGELM)
    options, origin = chat_sampling(Sampling(do_sample=True, temperature=0.6, top_p=0.9))
    assert origin == FROM_MODEL  # transformers' own defaults for what the file leaves out: top-k 50
    assert options == {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0}


@pytest.mark.parametrize(
    ("record", "mentions"),
    [
        ({"temperature": -1}, "temperature must be a finite number >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"do_sample": "yes"}, "do_sample must be true, false or null"),
        ({"temprature": 0.5}, "unknown key(s) temprature"),
    ],
)
def test_a_bad_sampling_record_does_not_load(recommending, tmp_path, record, mentions):
    folder = tmp_path / "pkg"
    shutil.copytree(recommending[0], folder)
    edit_manifest(folder, lambda data: data.__setitem__("sampling", record))
    with pytest.raises(PackageError) as caught:
        load(folder, provider="cpu")
    assert str(caught.value).startswith(f"edgelm.json sampling: {mentions}")


def chat(package, *args: str, message: str = "Hello there") -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "edgelm", "chat", str(package), "--provider", "cpu", "--threads", "1", *args]
    return subprocess.run(command, input=message + "\n", capture_output=True, text=True, encoding="utf-8", timeout=120)


def test_chat_samples_as_the_model_recommends_and_greedy_on_request(recommending):
    package = recommending[0]
    model = load(package, provider="cpu", threads=1)
    recommended, _ = chat_sampling(model.spec.manifest.sampling)
    done = chat(package, "--seed", "3", "--max-new-tokens", "24")
    assert done.returncode == 0, done.stderr
    assert "sampling: temperature 0.6, top-k 20, top-p 0.8, min-p 0 (the model's generation_config.json" in done.stderr
    expected = model.conversation().send("Hello there", 24, seed=3, **recommended).text
    greedy = model.conversation().send("Hello there", 24).text
    assert expected != greedy, "the tiny model samples something else than its greedy reply"
    assert f"> {expected}\n" in done.stdout

    done = chat(package, "--greedy", "--max-new-tokens", "24")
    assert done.returncode == 0 and "sampling: greedy." in done.stderr, done.stderr
    assert f"> {greedy}\n" in done.stdout
    # a flag replaces its one value; the others stay the model's
    done = chat(package, "--seed", "3", "--top-k", "5", "--max-new-tokens", "24")
    assert "temperature 0.6, top-k 5, top-p 0.8" in done.stderr
    expected = model.conversation().send("Hello there", 24, seed=3, **recommended | {"top_k": 5}).text
    assert f"> {expected}\n" in done.stdout


def test_chat_without_a_recommendation_uses_edgelm_defaults_and_generate_stays_greedy(recommending, tmp_path):
    folder = tmp_path / "pkg"
    shutil.copytree(recommending[0], folder)
    edit_manifest(folder, lambda data: data.pop("sampling"))
    done = chat(folder, "--seed", "1", "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr
    assert "sampling: temperature 0.7, top-p 0.9, min-p 0.05, repetition-penalty 1.1 (edgelm's chat defaults" in (
        done.stderr
    )
    model = load(recommending[0], provider="cpu", threads=1)
    generated = edgelm("generate", recommending[0], "Hello", "--max-new-tokens", "8", "--json")
    assert json.loads(generated.stdout)["token_ids"] == model.generate("Hello", 8).token_ids


def test_greedy_takes_no_sampling_flag(recommending):
    done = chat(recommending[0], "--greedy", "--temperature", "0.5", "--top-p", "0.5")
    assert done.returncode == 1 and done.stderr.splitlines() == [
        "edgelm chat: error: --greedy always takes the most likely token; drop --temperature, --top-p or --greedy"
    ]
