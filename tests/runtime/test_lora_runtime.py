"""LoRA adapters at run time: a base exported with LoRA slots runs unchanged without an adapter, and with an
adapter converted by `edgelm adapter convert` gives transformers + peft's logits (1e-4) and greedy ids, on fp32,
int8 and int4 bases; adapters alternate with the base on one model and 8 threads with different adapters get what
each request gets alone; a conversation's cache belongs to its adapter; generate and chat take --adapter."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from helpers import edgelm, lora_targets, quiet, save_lora_base, save_peft_adapter, torch_greedy

from edgelm.export.lora import SlotSpec, convert_adapter
from edgelm.export.onnx_export import export_package
from edgelm.quantize.quantize import quantize_package
from edgelm.runtime import load

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 99, 1200, 7, 640, 33, 1800, 412]
NEW_TOKENS = 12
ADAPTERS = {  # name: (rank, attention + MLP, rsLoRA, seed)
    "r16-mlp-rslora": (16, True, True, 1),
    "r8-attention": (8, False, False, 2),
    "r1-mlp": (1, True, False, 3),
}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def case(request, tmp_path_factory) -> dict:
    """A base with slots for every linear at rank 16, its adapters (PeftModels) converted for it."""
    base = request.param
    root = tmp_path_factory.mktemp(f"lora-slots-{base}")
    hf = save_lora_base(root / "base", base)
    package = root / "slots"
    export_package(root / "base", package, lora_slots=SlotSpec(["all"], 16), progress=quiet)
    references, files = {}, {}
    for name, (rank, mlp, rslora, seed) in ADAPTERS.items():
        targets = lora_targets(base, mlp=mlp)
        references[name] = save_peft_adapter(hf, root / name, r=rank, targets=targets, rslora=rslora, seed=seed)
        files[name] = convert_adapter(root / name, package, root / f"{name}.onnx_adapter")
    return {"base": base, "hf": hf, "root": root, "package": package, "references": references, "files": files}


def _loaded(case: dict, package: Path | None = None):
    model = load(package or case["package"], provider="cpu", threads=1)
    for name, path in case["files"].items():
        model.load_adapter(path, name=name)
    return model


def _logits(reference) -> np.ndarray:
    with torch.no_grad():
        return reference(torch.tensor([PROMPT])).logits[0].numpy()


def test_adapters_equal_peft_and_base_is_unchanged(case):
    model = _loaded(case)
    base_logits, _ = model.forward(np.array([PROMPT]))
    assert np.abs(base_logits[0] - _logits(case["hf"])).max() < 1e-4
    assert model.generate(PROMPT, NEW_TOKENS, ignore_eos=True).token_ids == torch_greedy(case["hf"], PROMPT, NEW_TOKENS)
    for name, reference in case["references"].items():
        expected = _logits(reference)
        logits, _ = model.forward(np.array([PROMPT]), adapter=name)
        assert np.abs(logits[0] - expected).max() < 1e-4, name
        assert np.abs(base_logits[0] - expected).max() > 1e-2, f"{name} should change the logits"
        result = model.generate(PROMPT, NEW_TOKENS, ignore_eos=True, adapter=name)
        assert result.token_ids == torch_greedy(reference, PROMPT, NEW_TOKENS), name


def test_slots_record_and_graph(case):
    manifest = json.loads((case["package"] / "edgelm.json").read_text())
    slots = manifest["lora"]["slots"]
    assert slots["max_rank"] == 16 and len(slots["base_sha256"]) == 64
    record = json.loads(Path(f"{case['files']['r8-attention']}.json").read_text())
    assert record["base_sha256"] == slots["base_sha256"] and record["source"]["ranks"] == [8]
    graph = onnx.load(str(case["package"] / "model.onnx"), load_external_data=False).graph
    lora_inputs = [i for i in graph.input if "lora_" in i.name]
    from edgelm.runtime.lora_contract import parse_slots

    shapes = parse_slots(manifest["lora"], "edgelm.json").shapes()  # A and B of 4 linears in 2 layers
    assert len(lora_inputs) == len(shapes) == 2 * 4 * 2
    assert {i.name for i in lora_inputs} == set(shapes)


def test_alternating_adapters_equal_each_alone(case):
    model = _loaded(case)
    alone = {name: model.generate(PROMPT, NEW_TOKENS, ignore_eos=True, adapter=name).token_ids
             for name in [None, *ADAPTERS]}  # fmt: skip
    order = [None, "r16-mlp-rslora", "r8-attention", None, "r8-attention", "r16-mlp-rslora", "r1-mlp", None]
    for name in order:
        assert model.generate(PROMPT, NEW_TOKENS, ignore_eos=True, adapter=name).token_ids == alone[name], name
    assert len({tuple(ids) for ids in alone.values()}) == len(alone)  # every adapter answers differently


def test_eight_threads_with_different_adapters(case):
    model = _loaded(case)
    names = [None, *ADAPTERS]
    prompts = [PROMPT[: 4 + i % 4] for i in range(8)]
    jobs = [(prompts[i], names[i % len(names)]) for i in range(8)]
    alone = [model.generate(p, NEW_TOKENS, ignore_eos=True, adapter=a).token_ids for p, a in jobs]
    results: list = [None] * 8
    barrier = threading.Barrier(8)

    def work(index: int) -> None:
        barrier.wait()
        prompt, adapter = jobs[index]
        results[index] = model.generate(prompt, NEW_TOKENS, ignore_eos=True, adapter=adapter).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == alone


def test_stream_and_batch_take_the_adapter(case):
    model = _loaded(case)
    expected = model.generate(PROMPT, NEW_TOKENS, ignore_eos=True, adapter="r1-mlp").token_ids
    batch = model.generate_batch([PROMPT, PROMPT[:5]], NEW_TOKENS, ignore_eos=True, adapter="r1-mlp")
    assert batch[0].token_ids == expected
    assert batch[1].token_ids == model.generate(PROMPT[:5], NEW_TOKENS, ignore_eos=True, adapter="r1-mlp").token_ids
    stream = model.stream(PROMPT, NEW_TOKENS, ignore_eos=True, adapter="r1-mlp")
    "".join(stream)
    assert stream.result.token_ids == expected


def test_conversation_cache_belongs_to_its_adapter(case):
    model = _loaded(case)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    conv = model.conversation(template=template, adapter="r8-attention")
    first = conv.send("hello there", 6)
    assert conv.last_turn.adapter == "r8-attention" and not conv.last_turn.adapter_switched
    conv.send("and again", 6)
    assert conv.last_turn.path in ("prefix", "rewind") and conv.last_turn.reused_tokens > 0  # the cache was kept
    switched = conv.send("one more", 6, adapter="r16-mlp-rslora")
    turn = conv.last_turn
    assert turn.adapter_switched and turn.path == "full" and turn.reused_tokens == 0
    assert conv.adapter == "r16-mlp-rslora"
    fresh = model.conversation(template=template, adapter="r16-mlp-rslora")
    fresh._history = conv.messages[:-2]  # the same history, replayed with the new adapter from scratch
    assert fresh.send("one more", 6).token_ids == switched.token_ids
    assert first.token_ids == model.chat([{"role": "user", "content": "hello there"}], 6, template=template,
                                         adapter="r8-attention").token_ids  # fmt: skip


@pytest.mark.parametrize("mode", ["int4", "dynamic", "int8-weight-only"])
def test_quantized_bases_keep_slots_fp32(mode, case, tmp_path):
    out = tmp_path / mode
    quantize_package(case["package"], out, mode=mode, progress=quiet)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    lora = [i.name for i in graph.input if "lora_" in i.name]
    assert lora and all(inits[name].data_type == onnx.TensorProto.FLOAT for name in lora)
    model = _loaded(case, out)
    fp32 = _loaded(case)
    for name in ADAPTERS:
        logits, _ = model.forward(np.array([PROMPT]), adapter=name)
        expected, _ = fp32.forward(np.array([PROMPT]), adapter=name)
        agreement = (logits[0].argmax(-1) == expected[0].argmax(-1)).mean()
        assert agreement >= 0.5, f"{mode} + {name}: top-1 agreement {agreement:.2f}"


def test_cli_convert_generate_and_errors(case, tmp_path):
    out = tmp_path / "cli.onnx_adapter"
    done = edgelm("adapter", "convert", case["root"] / "r8-attention", case["package"], out)
    assert done.returncode == 0, done.stderr
    run = edgelm("generate", case["package"], "hello", "--max-new-tokens", "8", "--adapter", out, "--json")
    assert run.returncode == 0, run.stderr
    model = _loaded(case)
    expected = model.generate("hello", 8, adapter="r8-attention")
    assert json.loads(run.stdout)["token_ids"] == expected.token_ids
    bad = edgelm("generate", case["package"], "hello", "--adapter", tmp_path / "missing.onnx_adapter")
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_onnxruntime_genai_runs_the_converted_adapter(case):
    """genai's own adapters API (og.Adapters, set_active_adapter) on the slotted package: edgelm's ids."""
    og = pytest.importorskip("onnxruntime_genai")
    genai_model = og.Model(str(case["package"]))
    adapters = og.Adapters(genai_model)
    adapters.load(str(case["files"]["r16-mlp-rslora"]), "r16")
    model = _loaded(case)
    for adapter in (None, "r16-mlp-rslora"):
        params = og.GeneratorParams(genai_model)
        params.set_search_options(max_length=len(PROMPT) + NEW_TOKENS, do_sample=False)
        generator = og.Generator(genai_model, params)
        if adapter is not None:
            generator.set_active_adapter(adapters, "r16")
        generator.append_tokens(np.array([PROMPT], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        ids = [int(t) for t in generator.get_sequence(0)][len(PROMPT) :]
        expected = model.generate(PROMPT, NEW_TOKENS, ignore_eos=True, adapter=adapter).token_ids
        assert ids and ids == expected[: len(ids)], adapter  # genai stops at EOS (id 0); edgelm ignored it


def test_speculative_decoding_runs_with_an_adapter(case):
    """An adapter's runner is the target of speculative decoding: prompt lookup and a draft package (the slotted
    package itself, given as a folder) give the plain greedy ids with that adapter, in generate and in a chat."""
    model = _loaded(case)
    repetitive = PROMPT + PROMPT  # a prompt that repeats itself, so lookup finds guesses
    plain = model.generate(repetitive, NEW_TOKENS, ignore_eos=True, adapter="r16-mlp-rslora")
    for speculative in ("lookup", str(case["package"])):
        fast = model.generate(
            repetitive, NEW_TOKENS, ignore_eos=True, adapter="r16-mlp-rslora", speculative=speculative
        )
        assert fast.token_ids == plain.token_ids
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    expected = model.conversation(template=template, adapter="r8-attention").send("say it twice: hello hello", 6)
    conv = model.conversation(template=template, adapter="r8-attention")
    got = conv.send("say it twice: hello hello", 6, speculative=str(case["package"]))
    assert got.token_ids == expected.token_ids


def test_speculative_checks_run_once_per_model_not_per_adapter_request(case, monkeypatch):
    """An adapter's runner is made per request; the step check and the draft's vocabulary check are the model's."""
    from edgelm.runtime import speculative

    calls = {"steps": 0, "tokens": 0}
    steps, tokens = speculative._steps_agree, speculative._compare_tokens
    monkeypatch.setattr(
        speculative, "_steps_agree", lambda r: calls.__setitem__("steps", calls["steps"] + 1) or steps(r)
    )
    monkeypatch.setattr(
        speculative, "_compare_tokens", lambda *a: calls.__setitem__("tokens", calls["tokens"] + 1) or tokens(*a)
    )
    model = _loaded(case)
    draft = load(case["package"], provider="cpu", threads=1)
    for adapter in ("r1-mlp", "r8-attention", "r1-mlp"):
        model.generate(PROMPT, 4, ignore_eos=True, adapter=adapter, speculative=draft)
    assert calls == {"steps": 1, "tokens": 1}


def test_a_constraint_holds_with_an_adapter(case):
    pytest.importorskip("llguidance")
    model = _loaded(case)
    if model.tokenizer is None:
        pytest.skip("the base package has no tokenizer")
    free = model.generate(PROMPT, NEW_TOKENS, adapter="r1-mlp")
    result = model.generate(PROMPT, NEW_TOKENS, regex="[0-9]{2,5}", adapter="r1-mlp")
    assert result.text.isdigit() and 2 <= len(result.text) <= 5 and result.token_ids != free.token_ids
    batch = model.generate_batch([PROMPT, PROMPT], NEW_TOKENS, regex=["[0-9]{2,5}", None], adapter="r1-mlp")
    assert batch[0].token_ids == result.token_ids and batch[1].token_ids == free.token_ids
