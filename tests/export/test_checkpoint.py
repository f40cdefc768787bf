"""Loading Hugging Face GPT-2 checkpoints into the reference model: logits identical to transformers'
GPT2LMHeadModel (prompt, cached decode steps, left-padded batches), both weight formats, and a clear
error for every kind of bad folder (including a pickle that would run code)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_hf_checkpoint
from edgelm.export.checkpoint import CheckpointError
from edgelm.export.families.gpt2 import load_checkpoint
from edgelm.export.lazy_weights import materialize

HF_TOLERANCE = 1e-5
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # initializer_range 0.3 instead of GPT-2's 0.02: a tiny random model with small weights just repeats
    # its last token; larger weights give varied logits, so a wrong mask or position would show.
    return make_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "gpt2", tokenizer=False, initializer_range=0.3)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(checkpoint).eval()


def compare_with_transformers(hf_model, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> float:
    """Prompt, then DECODE_STEPS one-token steps, each side feeding its own cache. Returns the largest
    |logit difference| over real (unpadded) positions."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens start at 0
    hf_past, past = None, None
    worst = 0.0
    with torch.no_grad():
        for _ in range(DECODE_STEPS + 1):
            hf_out = hf_model(
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=hf_past,
                use_cache=True,
            )
            logits, past = model(input_ids, attention_mask, position_ids, past)
            real = attention_mask[:, -input_ids.shape[1] :].bool()  # (B, T)
            worst = max(worst, (hf_out.logits - logits).abs()[real].max().item())
            hf_past = hf_out.past_key_values
            input_ids = logits[:, -1, :].argmax(-1, keepdim=True)  # both sides get the same next token
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            position_ids = position_ids[:, -1:] + 1
    return worst


def test_logits_match_transformers_prompt_and_decode(checkpoint, hf_model):
    model = load_checkpoint(checkpoint)
    input_ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    worst = compare_with_transformers(hf_model, model, input_ids, torch.ones_like(input_ids))
    assert worst < HF_TOLERANCE


def test_logits_match_transformers_left_padded_batch(checkpoint, hf_model):
    model = load_checkpoint(checkpoint)
    input_ids = torch.randint(0, model.config.vocab_size, (3, 8), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # three pad tokens on the left
    attention_mask[2, :7] = 0  # a one-token prompt
    worst = compare_with_transformers(hf_model, model, input_ids, attention_mask)
    assert worst < HF_TOLERANCE


def test_padding_does_not_change_the_real_rows(checkpoint):
    """A left-padded row gives the logits of the same prompt alone (so the mask and positions matter)."""
    model = load_checkpoint(checkpoint)
    prompt = torch.tensor([[5, 17, 42, 99]])
    padded = torch.cat([torch.full((1, 3), 7), prompt], dim=1)
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone, _ = model(prompt)
        with_padding, _ = model(padded, attention_mask, position_ids)
        unmasked, _ = model(padded)
    torch.testing.assert_close(with_padding[:, 3:], alone, rtol=0, atol=1e-5)
    assert (unmasked[:, 3:] - alone).abs().max() > 1e-3  # the padding would matter without the mask


def write_pickle_checkpoint(source: Path, folder: Path, *, legacy_names: bool) -> Path:
    """The same weights as a pytorch_model.bin. legacy_names: the layout of the original GPT-2
    uploads (no `transformer.` prefix, the causal-mask buffers `attn.bias` / `attn.masked_bias` stored)."""
    from safetensors.torch import load_file

    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    state = load_file(str(source / "model.safetensors"))
    if legacy_names:
        state = {name.removeprefix("transformer."): tensor for name, tensor in state.items()}
        n_positions = json.loads((source / "config.json").read_text())["n_positions"]
        for i in range(json.loads((source / "config.json").read_text())["n_layer"]):
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n_positions, n_positions)).view(1, 1, n_positions, -1)
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("legacy_names", [False, True], ids=["hf-names", "legacy-gpt2-names"])
def test_pytorch_model_bin_loads_identically(checkpoint, tmp_path, legacy_names):
    folder = write_pickle_checkpoint(checkpoint, tmp_path / "bin", legacy_names=legacy_names)
    assert not (folder / "model.safetensors").exists()
    from_safetensors, from_pickle = load_checkpoint(checkpoint), load_checkpoint(folder)
    materialize(from_safetensors)  # its weights are read when used (export/lazy_weights.py): all of them now
    expected = from_safetensors.state_dict()
    loaded = from_pickle.state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    input_ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(from_pickle(input_ids)[0], from_safetensors(input_ids)[0])


def test_untied_checkpoint_keeps_its_own_head(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "untied", tokenizer=False, tie_word_embeddings=False)
    from transformers import GPT2LMHeadModel

    hf_model = GPT2LMHeadModel.from_pretrained(folder).eval()
    model = load_checkpoint(folder)
    assert model.lm_head.weight is not model.transformer.wte.weight
    materialize(model)
    assert torch.equal(model.lm_head.weight, hf_model.lm_head.weight)
    assert not torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    input_ids = torch.tensor([[1, 2, 3, 4]])
    assert compare_with_transformers(hf_model, model, input_ids, torch.ones_like(input_ids)) < HF_TOLERANCE


# Bad folders: each gives an exception that says what is wrong.


@pytest.fixture
def bad(checkpoint, tmp_path) -> Path:
    """A writable copy of the good checkpoint, to break."""
    return Path(shutil.copytree(checkpoint, tmp_path / "bad"))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_missing_config(bad):
    (bad / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(bad)


def test_missing_weights(bad):
    (bad / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors, .* or pytorch_model\.bin"):
        load_checkpoint(bad)


def test_config_not_json(bad):
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(bad)


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", None])
def test_other_architecture_is_refused(bad, model_type):
    edit_config(bad, model_type=model_type)
    with pytest.raises(CheckpointError, match=f"unsupported model_type {model_type!r}"):
        load_checkpoint(bad)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(bad, damage):
    path = bad / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(bad)


def test_truncated_pytorch_model_bin(checkpoint, tmp_path):
    folder = write_pickle_checkpoint(checkpoint, tmp_path / "bin", legacy_names=False)
    path = folder / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        load_checkpoint(folder)


def test_tensor_shape_differs_from_config(bad):
    edit_config(bad, n_positions=32)  # the file's position table has 64 rows
    with pytest.raises(CheckpointError, match=r"'transformer\.wpe\.weight' has shape \(64, 32\).*expects \(32, 32\)"):
        load_checkpoint(bad)


def test_missing_tensor(bad):
    from safetensors.torch import load_file, save_file

    state = load_file(str(bad / "model.safetensors"))
    del state["transformer.h.1.mlp.c_fc.bias"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*h\.1\.mlp\.c_fc\.bias"):
        load_checkpoint(bad)


class RunsCode:
    """Unpickling this runs a shell command: what a malicious pytorch_model.bin does."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("container", ["torch.save", "raw-pickle"])
def test_malicious_pickle_is_refused_not_run(bad, tmp_path, container):
    marker = tmp_path / "PWNED"
    payload = {"transformer.wte.weight": torch.zeros(2), "evil": RunsCode(f"touch {marker}")}
    (bad / "model.safetensors").unlink()
    path = bad / "pytorch_model.bin"
    if container == "torch.save":
        torch.save(payload, path)  # the zip container torch and transformers write
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))  # a bare pickle: torch.load's legacy path

    with pytest.raises(CheckpointError, match="refused to unpickle"):
        load_checkpoint(bad)
    assert not marker.exists()

    # The payload is live: a full unpickle does run it. This is what the loader must never do.
    if container == "torch.save":
        torch.load(path, weights_only=False)
    else:
        pickle.loads(path.read_bytes())
    assert marker.exists()


def test_pickle_holding_no_state_dict(bad):
    (bad / "model.safetensors").unlink()
    torch.save([torch.zeros(2)], bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="state dict"):
        load_checkpoint(bad)
