"""Speculative decoding on the hybrid families (LFM2, Qwen3.5), each graph: a rejected guess leaves a state that
folded it in, so the cache rolls back to the snapshot before the round and feeds the accepted tokens again
(runtime/statecache.py _Snapshots). Prompt lookup and a draft (the target's weights with noise: a hybrid too, rolled
back the same way, whose guesses are about half accepted) give the plain greedy ids token for token; sampled with
that draft, the first three tokens (the third drawn after the second's guess was checked and, when rejected,
rolled back) follow the distribution computed from the model's logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_package import make_chat_folder
from helpers import quiet
from test_speculative import probabilities, same_greedy

from edgelm.export.onnx_export import export_package
from edgelm.runtime import load
from edgelm.runtime.sampling import SamplingParams

RNG = np.random.default_rng(11)
# lookup finds loops in these (the random models fall into one after a repeated or a one-token prompt) and
# nothing in the random ones
LOOKUP_PROMPTS = [[300, 12, 2001, 5] * 3, [300] * 8, [1500], list(RNG.integers(3, 2000, size=12)), [42, 7]]
PROMPTS = [list(RNG.integers(3, 2000, size=n)) for n in (1, 2, 5, 20)]
TARGETS = [(family, graph) for family in ("lfm2", "qwen3_5_text") for graph in ("fused", "standard")]
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


class Packages:
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
def packages(tmp_path_factory) -> Packages:
    return Packages(tmp_path_factory.mktemp("hybrid-spec"))


@pytest.mark.parametrize(("family", "graph"), TARGETS, ids=["-".join(t) for t in TARGETS])
def test_lookup_and_a_draft_give_the_plain_greedy_ids(packages, family, graph):
    model = packages.get(family, graph)
    for speculative, prompts in (("lookup", LOOKUP_PROMPTS), (packages.get(family, "draft"), PROMPTS)):
        results = [same_greedy(model, prompt, 60, speculative, ignore_eos=True) for prompt in prompts]
        proposed = sum(r.timings.proposed_tokens for r in results)
        accepted = sum(r.timings.accepted_tokens for r in results)
        assert 0 < accepted < proposed, "both accepted and rejected guesses (rolled back) are exercised"
    same_greedy(model, PROMPTS[2], 30, model, ignore_eos=True)  # the model as its own draft


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5_text"])
def test_sampled_tokens_follow_the_models_distribution(packages, family):
    from scipy.stats import chisquare

    model, draft = packages.get(family, "fused"), packages.get(family, "draft")
    prompt, params = PROMPTS[2], dict(temperature=1.0, top_k=3)
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
