"""Speculative decoding (runtime/speculative.py) on tiny random Llama packages (tests/chat_package.py).

Greedy output equals plain greedy output token for token: many prompts, both graphs, fp32 / int8 / int4, at the
context's end, with EOS, stop strings, a token budget that ends inside an accepted run, cancellation, a repetition
penalty, chat turns, and a draft package. The acceptance rule keeps the sampling distribution (chi-square against
the exact distribution computed from the model's logits); a seed reproduces a run; bad values raise one error.
The hybrid families (the "hybrid-state" cases of tests/family_cases.py), each graph: a rejected guess rolled back
to the state's snapshot, lookup and a draft give the plain greedy ids and sampling keeps the distribution."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_package import IM_END, make_chat_folder, make_chat_package
from family_cases import CASES, cases_with
from helpers import quiet

from edgelm.export.onnx_export import export_package
from edgelm.runtime import InvalidParameterError, load
from edgelm.runtime.sampling import SamplingParams, TokenPicker, dense, distribution
from edgelm.runtime.speculative import Lookup, check_guesses

REPO = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(7)
# prompts with repeats (lookup's guesses get accepted) and random ones (they get rejected or there are none)
PROMPTS = [list(RNG.integers(3, 2000, size=n)) * r for n, r in ((5, 3), (9, 2), (3, 6), (20, 1), (40, 1), (7, 4))]
PROMPTS += [list(RNG.integers(3, 60, size=30)) for _ in range(6)]


@pytest.fixture(scope="module", params=["fused", "standard"])
def graph_model(request, tmp_path_factory):
    out = make_chat_package(tmp_path_factory.mktemp("spec") / request.param, attention=request.param)
    return load(out, provider="cpu", threads=1)


@pytest.fixture(scope="module")
def fused_package(tmp_path_factory):
    return make_chat_package(tmp_path_factory.mktemp("spec") / "fused")


@pytest.fixture(scope="module")
def model(fused_package):
    return load(fused_package, provider="cpu", threads=1)


def same_greedy(model, prompt, max_new_tokens: int, speculative, **options):
    plain = model.generate(prompt, max_new_tokens, **options)
    fast = model.generate(prompt, max_new_tokens, speculative=speculative, **options)
    assert fast.token_ids == plain.token_ids, f"prompt {prompt[:8]}...: speculative output differs"
    assert (fast.text, fast.finish_reason) == (plain.text, plain.finish_reason)
    return fast


# ---- greedy: the plain output, token for token --------------------------------------------------------------


def test_lookup_greedy_equals_plain_on_many_prompts(graph_model):
    results = [same_greedy(graph_model, p, 48, "lookup", ignore_eos=True) for p in PROMPTS]
    proposed = sum(r.timings.proposed_tokens for r in results)
    accepted = sum(r.timings.accepted_tokens for r in results)
    assert 0 < accepted < proposed, "the prompts exercise both accepted and rejected guesses"


@pytest.mark.parametrize("mode", ["int8-weight-only", "int4"])
def test_lookup_greedy_equals_plain_quantized(fused_package, tmp_path, mode):
    from edgelm.quantize.quantize import quantize_package

    quantize_package(fused_package, tmp_path / mode, mode=mode, progress=quiet)
    quantized = load(tmp_path / mode, provider="cpu", threads=1)
    for prompt in PROMPTS:
        same_greedy(quantized, prompt, 40, "lookup", ignore_eos=True)


def test_the_budget_ends_inside_an_accepted_run(model):
    prompt = PROMPTS[2]
    full = model.generate(prompt, 60, ignore_eos=True, speculative="lookup")
    assert full.timings.accepted_tokens >= 4
    for n in range(1, 24):
        result = same_greedy(model, prompt, n, "lookup", ignore_eos=True)
        assert len(result.token_ids) == n and result.finish_reason == "length"


def test_the_context_end(graph_model):
    limit = graph_model.context_length
    for prompt in PROMPTS[:4]:
        long = (prompt * (limit // len(prompt) + 1))[: limit - 30]
        same_greedy(graph_model, long, 30, "lookup", ignore_eos=True)


def test_eos_inside_a_run(model, tmp_path):
    # with a frequent token as EOS, generation ends where plain decoding ends, guesses past it unused
    prompt = PROMPTS[0]
    tokens = model.generate(prompt, 40, ignore_eos=True).token_ids
    eos_model = load(tmp_path_package(model, tmp_path, eos=tokens[12]), provider="cpu", threads=1)
    result = same_greedy(eos_model, prompt, 40, "lookup")
    assert result.finish_reason == "eos" and len(result.token_ids) == tokens.index(tokens[12])


def tmp_path_package(model, tmp_path, *, eos: int):
    from helpers import copy_package, edit_manifest

    folder = copy_package(model.spec.folder, tmp_path, "eos")
    edit_manifest(folder, lambda m: m["tokenizer"].update(eos_token_ids=[int(eos), IM_END]))
    return folder


def test_stop_strings_and_streams(model):
    prompt = PROMPTS[2]
    text = model.generate(prompt, 40, ignore_eos=True).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    result = same_greedy(model, prompt, 40, "lookup", stop=stop)
    assert result.finish_reason == "stop"
    pieces = list(stream := model.stream(prompt, 40, stop=stop, speculative="lookup"))
    assert "".join(pieces) == result.text and stream.result.token_ids == result.token_ids


def test_cancel_mid_run(model):
    prompt = PROMPTS[2]
    outputs = []
    for speculative in (None, "lookup"):
        cancel = threading.Event()
        stream = model.stream(prompt, 40, ignore_eos=True, cancel=cancel, speculative=speculative)
        for i, _ in enumerate(stream):
            if i == 6:
                cancel.set()
        outputs.append((stream.result.token_ids, stream.result.finish_reason))
    assert outputs[0] == outputs[1] and outputs[1][1] == "cancelled"


@pytest.mark.parametrize("budget", [0, 3])
def test_both_loops_end_alike_before_the_first_token(model, budget):
    # generation.Ending decides for both loops: a zero budget is "length", a cancellation before the prompt runs
    # is "cancelled", with no token either way
    cancel = threading.Event()
    cancel.set()
    results = [model.generate(PROMPTS[0], budget, cancel=cancel, speculative=s) for s in (None, "lookup")]
    expected = ([], "length" if budget == 0 else "cancelled")
    assert [(r.token_ids, r.finish_reason) for r in results] == [expected, expected]


def test_repetition_penalty_applies_as_in_plain_decoding(graph_model):
    for prompt in PROMPTS[:6]:
        same_greedy(graph_model, prompt, 32, "lookup", ignore_eos=True, repetition_penalty=1.3)


def test_a_batch_decodes_plainly(model):
    plain = model.generate_batch(PROMPTS[:3], 20, ignore_eos=True)
    batched = model.generate_batch(PROMPTS[:3], 20, ignore_eos=True, speculative="lookup")
    assert [r.token_ids for r in batched] == [r.token_ids for r in plain]
    assert all(r.timings.proposed_tokens == 0 for r in batched)


def test_chat_turns_equal_plain_turns(graph_model):
    replies = []
    for speculative in (None, "lookup"):
        conv = graph_model.conversation(system="Repeat after me.")
        turns = ["say: the cat sat on the mat", "say it again: the cat sat on the mat", "once more, twice"]
        replies.append([conv.send(t, 40, speculative=speculative).token_ids for t in turns])
        again = graph_model.chat(conv.messages[:-1], 40, speculative=speculative)  # from the ids afresh
        assert again.token_ids == replies[-1][-1]
    assert replies[0] == replies[1]


# ---- a draft package ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_package(tmp_path_factory):
    return make_chat_package(tmp_path_factory.mktemp("spec") / "draft", layers=1, seed=3)


def test_a_draft_package_gives_the_plain_greedy_output(graph_model, draft_package):
    draft = load(draft_package, provider="cpu", threads=1)
    for prompt in PROMPTS[:6]:
        same_greedy(graph_model, prompt, 30, draft, ignore_eos=True)
    result = same_greedy(graph_model, PROMPTS[0], 30, str(draft_package), ignore_eos=True)  # a folder works too
    assert result.timings.proposed_tokens > 0
    same_greedy(graph_model, PROMPTS[1], 30, graph_model, ignore_eos=True)  # the model as its own draft


def test_a_draft_with_another_tokenizer_is_refused(model, package):
    other = load(package, provider="cpu", threads=1)  # tests/conftest.py's GPT-2, its own 320-token vocabulary
    with pytest.raises(InvalidParameterError, match="same tokenizer"):
        model.generate(PROMPTS[0], 5, speculative=other)


def test_a_draft_with_other_vocabulary_rows_is_refused_both_ways(model, fused_package, tmp_path):
    # the same tokenizer, 8 more embedding rows: as the draft it could guess ids the model lacks; as the model it
    # could choose ids the draft's embedding lacks (an ONNX Runtime index error mid-generation): both up front
    from chat_package import VOCAB

    padded = load(make_chat_package(tmp_path / "padded", layers=1, vocab=VOCAB + 8), provider="cpu", threads=1)
    for target, draft in ((model, padded), (padded, model)):
        with pytest.raises(InvalidParameterError, match="vocabulary rows"):
            target.generate(PROMPTS[0], 5, speculative=draft)
    with pytest.raises(InvalidParameterError, match="vocabulary rows"):
        padded.conversation().send("hi", 5, speculative=str(fused_package))


@pytest.mark.parametrize("value", [3, "lookup ", "/no/such/package", 1.5, ["lookup"]])
def test_invalid_values(model, value):
    with pytest.raises(InvalidParameterError, match="speculative must be"):
        model.generate(PROMPTS[0], 5, speculative=value)
    with pytest.raises(InvalidParameterError, match="speculative must be"):
        model.stream(PROMPTS[0], 5, speculative=value)
    with pytest.raises(InvalidParameterError, match="speculative must be"):
        model.conversation().send("hi", 5, speculative=value)


# ---- sampling: the distribution is plain sampling's ---------------------------------------------------------


def test_a_seed_reproduces_a_sampled_run(model, draft_package):
    for speculative in ("lookup", str(draft_package)):
        runs = [
            model.generate(PROMPTS[2], 30, temperature=0.9, top_k=20, seed=5, speculative=speculative).token_ids
            for _ in range(2)
        ]
        assert runs[0] == runs[1]


def probabilities(logits: np.ndarray, params: SamplingParams, seen: list[int]) -> np.ndarray:
    """The distribution plain sampling draws from, over the whole vocabulary (float64, summing to 1)."""
    ids, probs = distribution(logits, params, np.array(seen))
    full = dense(ids, probs.astype(np.float64), len(logits))
    return full / full.sum()


@pytest.mark.parametrize("q_kind", ["point", "draft"])
def test_the_acceptance_rule_keeps_p(q_kind):
    # one position: target logits p, a guess drawn from q (or fixed: lookup's point mass); the emitted token
    # must be distributed as p after the same transforms as plain sampling
    from scipy.stats import chisquare

    rng = np.random.default_rng(0)
    target, draft = rng.normal(size=(2, 12)) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.2)
    seen = [1, 4]
    p = probabilities(target, params, seen)
    q = probabilities(draft, params, seen)
    picker = TokenPicker([seen], params, 11)  # the one picker plain decoding uses
    counts = np.zeros(12)
    trials = 20_000
    for _ in range(trials):
        guess = 3 if q_kind == "point" else int(picker.rngs[0].choice(12, p=q / q.sum()))
        logits = np.stack([target, draft])  # the second row is the position after the guess
        accepted, token = check_guesses(picker, logits, [guess], None if q_kind == "point" else [q])
        counts[guess if accepted else token] += 1
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token the filters drop is never emitted"
    assert chisquare(counts[keep], p[keep] / p[keep].sum() * trials).pvalue > 1e-3


def test_sampled_tokens_follow_the_models_distribution(model, draft_package):
    # end to end with a draft package: the second token's guess is checked by the rule; the pair (t1, t2) is
    # compared with the exact distribution from the model's logits (chi-square, categories with >= 5 expected)
    from scipy.stats import chisquare

    prompt, params = PROMPTS[3], dict(temperature=1.0, top_k=4, repetition_penalty=1.1)
    sampling = SamplingParams(**params)
    first = probabilities(model.forward(np.array([prompt]))[0][0, -1], sampling, prompt)
    expected = {}
    for t1 in np.flatnonzero(first):
        second = probabilities(model.forward(np.array([prompt + [t1]]))[0][0, -1], sampling, prompt + [t1])
        for t2 in np.flatnonzero(second):
            expected[(int(t1), int(t2))] = first[t1] * second[t2]
    trials, counts = 3000, dict.fromkeys(expected, 0)
    draft = load(draft_package, provider="cpu", threads=1)
    proposed = 0
    for seed in range(trials):
        result = model.generate(prompt, 3, ignore_eos=True, seed=seed, speculative=draft, **params)
        counts[tuple(result.token_ids[:2])] += 1
        proposed += result.timings.proposed_tokens
    assert proposed == trials, "every run checked one guess for its second token"
    keys = sorted(expected)
    assert chisquare([counts[k] for k in keys], [expected[k] * trials for k in keys]).pvalue > 1e-3


def test_the_draft_length_grows_by_two_and_shrinks_to_one_past_the_accepted():
    from edgelm.runtime.speculative import FIRST_DRAFT, MAX_DRAFT, DraftLength

    length = DraftLength()
    assert length.k == FIRST_DRAFT == 4
    length.update(4, 4)
    assert length.k == 6
    length.update(6, 6)
    length.update(8, 8)
    assert length.k == MAX_DRAFT == 10
    length.update(10, 2)
    assert length.k == 3
    length.update(0, 0)  # no guesses: unchanged
    assert length.k == 3
    length.update(3, 0)
    assert length.k == 1


def test_lookup_index_proposes_what_followed_the_latest_match():
    lookup = Lookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 6])
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 3) == ([5, 6, 1], None)
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3, 7], 3) == ([], None)


# ---- a token mask (a grammar's) applies in the one picker -------------------------------------------------------


def test_a_token_mask_applies_to_plain_speculative_and_batched_decoding(model, draft_package):
    prompt = PROMPTS[2]
    allowed = np.zeros(model.vocab_size, dtype=bool)
    allowed[prompt[::2]] = True  # some of the prompt's tokens: lookup still finds guesses, some of them masked out
    calls = []

    def mask(row, ids, logits):
        calls.append((row, list(ids)))
        return np.where(allowed, logits, -np.inf)

    plain = model.generate(prompt, 30, ignore_eos=True, token_mask=mask)
    assert calls == [(0, plain.token_ids[:i]) for i in range(30)], "each position gets its row's ids so far"
    assert all(allowed[plain.token_ids]) and plain.token_ids != model.generate(prompt, 30, ignore_eos=True).token_ids
    draft = load(draft_package, provider="cpu", threads=1)
    for speculative in ("lookup", draft):
        fast = same_greedy(model, prompt, 30, speculative, ignore_eos=True, token_mask=mask)
        assert fast.timings.accepted_tokens > 0
    for speculative in (None, "lookup", draft):
        sampled = model.generate(
            prompt, 30, ignore_eos=True, temperature=1.0, seed=3, token_mask=mask, speculative=speculative
        )
        assert all(allowed[sampled.token_ids])
    calls.clear()
    rows = model.generate_batch([prompt, PROMPTS[0]], 8, ignore_eos=True, token_mask=mask)
    assert {row for row, _ in calls} == {0, 1} and all(allowed[r.token_ids].all() for r in rows)
    with pytest.raises(InvalidParameterError, match="token_mask must be"):
        model.generate(prompt, 4, token_mask="json")


# ---- packages whose multi-token steps compute other logits -------------------------------------------------


def test_a_package_whose_steps_disagree_decodes_plainly(fused_package, monkeypatch):
    # int4/int8 MatMulNBits (accuracy_level 4) quantize activations differently for one row than for several:
    # the logits of a verification step would not be plain decoding's, so such a package decodes plainly
    from edgelm.runtime import kvdrivers

    extend = kvdrivers.SharedCache.extend

    def noisy(self, ids, *, all_logits=False):
        logits = extend(self, ids, all_logits=all_logits)
        return logits + 0.5 * (np.arange(logits.shape[-1]) % 3) if all_logits else logits

    monkeypatch.setattr(kvdrivers.SharedCache, "extend", noisy)
    model = load(fused_package, provider="cpu", threads=1)  # a fresh model: the check runs once per model
    with pytest.warns(UserWarning, match="speculative decoding is off"):
        result = same_greedy(model, PROMPTS[0], 20, "lookup", ignore_eos=True)
    assert result.timings.proposed_tokens == 0


# ---- exact on every package: the bundled model, fp32 and quantized ----------------------------------------------


@pytest.fixture(scope="module")
def bundled(tmp_path_factory) -> dict[str, Path]:
    """models/shakespeare exported, and quantized int4 and int8-weight-only (MatMulNBits at accuracy_level 4), and
    the int4 package with accuracy_level 0 (fp32 activations)."""
    import shutil

    import onnx

    from edgelm.export.onnx_export import export_package
    from edgelm.quantize.quantize import quantize_package

    root = tmp_path_factory.mktemp("bundled")
    out = {"fp32": root / "fp32", "int4": root / "int4", "int8-weight-only": root / "int8-weight-only"}
    export_package(REPO / "models" / "shakespeare", out["fp32"], progress=quiet)
    for mode in ("int4", "int8-weight-only"):
        quantize_package(out["fp32"], out[mode], mode=mode, progress=quiet)
    out["int4 level 0"] = Path(shutil.copytree(out["int4"], root / "int4-level-0"))
    graph = onnx.load(str(out["int4 level 0"] / "model.onnx"), load_external_data=False)
    for node in graph.graph.node:
        for attribute in node.attribute:
            if attribute.name == "accuracy_level":
                attribute.i = 0
    onnx.save(graph, str(out["int4 level 0"] / "model.onnx"))  # loaded with verify=False: its sha256 changed
    return out


def heldout_prompts(tokenizer, count: int = 30, length: int = 40) -> list[list[int]]:
    ids = tokenizer.encode((REPO / "data" / "shakespeare-heldout.txt").read_text(encoding="utf-8")[:20_000])
    starts = np.random.default_rng(0).integers(0, len(ids) - length, size=count)
    return [ids[start : start + length] for start in starts]


@pytest.mark.parametrize("kind", ["fp32", "int4", "int8-weight-only", "int4 level 0"])
def test_lookup_gives_plain_greedy_on_the_bundled_model_quantized(bundled, kind):
    # int4/int8-weight-only at accuracy_level 4: one row and several are rounded by different kernels (here 2 of
    # these 30 prompts changed, with no warning, while a sampled step check passed); decided from the graph, those
    # decode plainly with a warning. fp32 and accuracy_level 0 keep speculative decoding, and its output.
    import warnings

    model = load(bundled[kind], provider="cpu", threads=1, verify=kind != "int4 level 0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [same_greedy(model, p, 40, "lookup", ignore_eos=True) for p in heldout_prompts(model.tokenizer)]
    accepted = sum(r.timings.accepted_tokens for r in results)
    said = [str(w.message) for w in caught if "speculative decoding is off" in str(w.message)]
    if kind in ("int4", "int8-weight-only"):
        assert accepted == 0 and len(said) == 1 and "MatMulNBits kernels run at accuracy_level 4" in said[0]
    else:
        assert accepted > 100 and not said


def test_the_graph_rule_names_row_dependent_operators(bundled, tmp_path):
    from edgelm.runtime.speculative import row_dependent_operator

    assert row_dependent_operator(bundled["fp32"] / "model.onnx") is None
    assert row_dependent_operator(bundled["int4 level 0"] / "model.onnx") is None
    assert "accuracy_level 4" in row_dependent_operator(bundled["int8-weight-only"] / "model.onnx")
    from edgelm.quantize.quantize import quantize_package

    quantize_package(bundled["fp32"], tmp_path / "dynamic", mode="dynamic", progress=quiet)
    assert "DynamicQuantizeLinear" in row_dependent_operator(tmp_path / "dynamic" / "model.onnx")


# ---- the command line ----------------------------------------------------------------------------------------


def test_cli_generate_and_bench_take_speculative(fused_package):
    import json

    from helpers import edgelm

    runs = []
    for extra in ([], ["--speculative", "lookup"]):
        run = edgelm(
            "generate", fused_package, "the cat sat on the mat, the cat", "--json", "--max-new-tokens", "24", *extra
        )
        assert run.returncode == 0, run.stderr
        runs.append(json.loads(run.stdout))
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert {"proposed_tokens", "accepted_tokens"} <= set(runs[1]["timings"])
    bench = edgelm("bench", fused_package, "--speculative", "lookup", "--repeats", "1", "--new-tokens", "8", "--json")
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["speculative"] == "lookup"


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_cli_refuses_a_bad_value_in_one_line(fused_package, command):
    from helpers import edgelm

    args = [command, fused_package] + (["hello"] if command == "generate" else []) + ["--speculative", "nope"]
    run = edgelm(*args)
    assert run.returncode != 0 and "--speculative nope: neither 'lookup' nor" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_cli_says_speculation_is_off_in_one_line(fused_package, monkeypatch, capsys):
    """The library's warning reaches the terminal as `edgelm generate: warning: ...`, one line, no source line."""
    from edgelm.cli import main
    from edgelm.runtime import kvdrivers

    extend = kvdrivers.SharedCache.extend
    monkeypatch.setattr(  # steps that disagree, as int4/int8 MatMulNBits' do on some CPUs
        kvdrivers.SharedCache,
        "extend",
        lambda self, ids, *, all_logits=False: extend(self, ids, all_logits=all_logits) + (0.5 if all_logits else 0),
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code = main(["generate", str(fused_package), "the cat sat", "--max-new-tokens", "4", "--speculative", "lookup"])
    err = capsys.readouterr().err
    assert code == 0
    warning, *rest = err.strip().splitlines()  # then generate's status line
    assert warning == (
        f"edgelm generate: warning: {Path(fused_package).name}: speculative decoding is off (plain decoding): a step "
        "of several tokens does not give the logits of single steps in this package (docs/speculative.md)"
    )
    assert len(rest) == 1 and "UserWarning" not in err and ".py:" not in err, err


# ---- hybrids (tests/family_cases.py's "hybrid-state" cases, each graph) ------------------------------------------
# A rejected guess leaves a state that folded it in, so the cache rolls back to the snapshot before the round and
# feeds the accepted tokens again (runtime/statecache.py _Snapshots). Prompt lookup and a draft (the target's
# weights with noise: a hybrid too, rolled back the same way, whose guesses are about half accepted) give the plain
# greedy ids token for token; sampled with that draft, the first three tokens (the third drawn after the second's
# guess was checked and, when rejected, rolled back) follow the distribution computed from the model's logits.

HYBRID_RNG = np.random.default_rng(11)
# lookup finds loops in these (the random models fall into one after a repeated or a one-token prompt) and
# nothing in the random ones
HYBRID_LOOKUP_PROMPTS = [
    [300, 12, 2001, 5] * 3,
    [300] * 8,
    [1500],
    list(HYBRID_RNG.integers(3, 2000, size=12)),
    [42, 7],
]
HYBRID_PROMPTS = [list(HYBRID_RNG.integers(3, 2000, size=n)) for n in (1, 2, 5, 20)]
HYBRIDS = [CASES[case].model_type for case in cases_with("hybrid-state")]  # tests/family_cases.py
HYBRID_TARGETS = [(family, graph) for family in HYBRIDS for graph in ("fused", "standard")]
NOISE = 0.05  # the draft's weights: the target's plus this much of each matrix's spread, as Gaussian noise


def noisy_copy(folder: Path, out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    generator = torch.Generator().manual_seed(1)
    state = load_file(out / "model.safetensors")
    for name, weight in state.items():
        if weight.ndim == 2:
            state[name] = weight + NOISE * weight.std() * torch.randn(weight.shape, generator=generator)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


class HybridPackages:
    """Per family: a 4-layer checkpoint, its packages of both graphs and its noisy draft, made when first asked."""

    def __init__(self, root: Path):
        self.root, self.models = root, {}

    def get(self, family: str, name: str):
        if (family, name) not in self.models:
            folder = self.root / family
            if not folder.exists():
                make_chat_folder(folder, family=family, layers=4)
            if name == "draft":
                folder = noisy_copy(folder, self.root / f"{family}-draft-checkpoint")
            out = self.root / f"{family}-{name}"
            export_package(folder, out, attention="standard" if name == "standard" else "fused", progress=quiet)
            self.models[family, name] = load(out, provider="cpu", threads=1)
        return self.models[family, name]


@pytest.fixture(scope="module")
def hybrid_packages(tmp_path_factory) -> HybridPackages:
    return HybridPackages(tmp_path_factory.mktemp("hybrid-spec"))


@pytest.mark.parametrize(("family", "graph"), HYBRID_TARGETS, ids=["-".join(t) for t in HYBRID_TARGETS])
def test_lookup_and_a_draft_give_a_hybrids_plain_greedy_ids(hybrid_packages, family, graph):
    model = hybrid_packages.get(family, graph)
    for speculative, prompts in (
        ("lookup", HYBRID_LOOKUP_PROMPTS),
        (hybrid_packages.get(family, "draft"), HYBRID_PROMPTS),
    ):
        results = [same_greedy(model, prompt, 60, speculative, ignore_eos=True) for prompt in prompts]
        proposed = sum(r.timings.proposed_tokens for r in results)
        accepted = sum(r.timings.accepted_tokens for r in results)
        assert 0 < accepted < proposed, "both accepted and rejected guesses (rolled back) are exercised"
    same_greedy(model, HYBRID_PROMPTS[2], 30, model, ignore_eos=True)  # the model as its own draft


@pytest.mark.parametrize("family", HYBRIDS)
def test_sampled_tokens_follow_a_hybrids_distribution(hybrid_packages, family):
    from scipy.stats import chisquare

    model, draft = hybrid_packages.get(family, "fused"), hybrid_packages.get(family, "draft")
    prompt, params = HYBRID_PROMPTS[2], dict(temperature=1.0, top_k=3)
    sampling = SamplingParams(**params)
    expected = {(): 1.0}
    for _ in range(3):  # every sequence of three tokens the filters allow, with its probability
        expected = {
            (*seen, int(token)): p * q
            for seen, p in expected.items()
            for q_all in [probabilities(model.forward(np.array([prompt + list(seen)]))[0][0, -1], sampling, [])]
            for token, q in enumerate(q_all)
            if q > 0
        }
    trials, counts = 1500, dict.fromkeys(expected, 0)
    proposed = accepted = 0
    for seed in range(trials):
        result = model.generate(prompt, 3, ignore_eos=True, seed=seed, speculative=draft, **params)
        drawn = tuple(result.token_ids)
        assert drawn in counts, f"{drawn}: a sequence the filters give no chance (a state not rolled back?)"
        counts[drawn] += 1
        proposed, accepted = proposed + result.timings.proposed_tokens, accepted + result.timings.accepted_tokens
    assert 0.1 * proposed < accepted < 0.9 * proposed, "guesses were often accepted and often rejected"
    common = [k for k in expected if expected[k] * trials >= 5]
    rare = [k for k in expected if k not in common]
    observed = [counts[k] for k in common] + ([sum(counts[k] for k in rare)] if rare else [])
    wanted = [expected[k] * trials for k in common] + ([sum(expected[k] for k in rare) * trials] if rare else [])
    assert chisquare(observed, wanted).pvalue > 1e-3
