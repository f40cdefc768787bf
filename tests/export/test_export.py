"""Export: ONNX Runtime against PyTorch (prompt and cached decode steps, padded batches, both graphs:
fused attention with a shared KV buffer, and standard ops; every export option), the tied embedding
stored once, the manifest, onnxruntime-genai running the package as it is, clean failures that leave
nothing behind, and the `edgelm export` command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import edgelm, genai_greedy, quiet

from conftest import TINY, make_hf_checkpoint
from edgelm.export.checkpoint import CheckpointError, combined_hash, source_hashes
from edgelm.export.families.gpt2 import load_checkpoint, save_checkpoint
from edgelm.export.models.gpt2 import GPT, GPTConfig
from edgelm.export.onnx_export import export_package
from edgelm.runtime.package import file_sha256, read_package

ONNX_TOLERANCE = 1e-4
DECODE_STEPS = 5
# A vocabulary big enough that a second copy of the embedding (2048 x 32 floats = 256 KB) could not
# hide in the size test's slack; initializer_range 0.3 so the random model does not just repeat its
# last token (GPT-2's 0.02 does), which makes greedy token parity worth checking.
VOCAB = 2048
SIZE_SLACK = 64 * 1024  # bytes of graph structure allowed on top of the weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "gpt2"
    return make_hf_checkpoint(folder, tokenizer=False, vocab_size=VOCAB, initializer_range=0.3)


@pytest.fixture(scope="module")
def reference(checkpoint) -> GPT:
    return load_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "pkg"
    export_package(checkpoint, out, progress=quiet)
    return out


@pytest.fixture(scope="module")
def exported_standard(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "standard"
    export_package(checkpoint, out, attention="standard", progress=quiet)
    return out


def max_onnx_difference(
    model: GPT,
    onnx_path: Path,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    last_token_logits: bool = False,
) -> float:
    """Feed the prompt, then DECODE_STEPS one-token steps, to ONNX Runtime and to PyTorch, each with
    its own cache; returns the largest |logit difference| over real (unpadded) positions."""
    config = model.config
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    layers = [(i, kv) for i in range(config.n_layer) for kv in ("key", "value")]
    past_names = [f"past_key_values.{i}.{kv}" for i, kv in layers]
    output_names = ["logits"] + [f"present.{i}.{kv}" for i, kv in layers]
    batch = input_ids.shape[0]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    empty = np.zeros((batch, config.n_head, 0, config.head_dim), dtype=np.float32)
    onnx_past = dict.fromkeys(past_names, empty)
    torch_past = None
    worst = 0.0
    with torch.no_grad():
        for _ in range(DECODE_STEPS + 1):
            feed = {
                "input_ids": input_ids.numpy(),
                "attention_mask": attention_mask.numpy(),
                "position_ids": position_ids.numpy(),
                **onnx_past,
            }
            onnx_logits, *present = session.run(output_names, feed)
            torch_logits, torch_past = model(
                input_ids, attention_mask, position_ids, torch_past, last_token_logits=last_token_logits
            )
            assert onnx_logits.shape == tuple(torch_logits.shape)  # compared without broadcasting
            real = attention_mask[:, -torch_logits.shape[1] :].bool().numpy()
            worst = max(worst, float(np.abs(onnx_logits - torch_logits.numpy())[real].max()))
            assert present[0].shape == (batch, config.n_head, attention_mask.shape[1], config.head_dim)
            onnx_past = dict(zip(past_names, present, strict=True))  # present.{i}.* feeds past_key_values.{i}.*
            input_ids = torch_logits[:, -1, :].argmax(-1, keepdim=True)  # both sides get the same next token
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            position_ids = position_ids[:, -1:] + 1
    return worst


def max_fused_difference(model: GPT, onnx_path: Path, lengths: list[int], *, seed: int = 0) -> float:
    """The fused graph as the runtime drives it: right-padded prompts of the given lengths, then
    DECODE_STEPS one-token steps, each cache tensor one buffer bound as both past and present; the
    prompt with every position's logits (num_logits_to_keep 0), decode steps with the last (1).
    PyTorch runs the same rows with its own growing, masked cache."""
    config = model.config
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    batch, width = len(lengths), max(lengths)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, width), generator=generator)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    buffers = [
        ort.OrtValue.ortvalue_from_numpy(
            np.zeros((batch, config.n_head, width + DECODE_STEPS, config.head_dim), np.float32)
        )
        for _ in range(2 * config.n_layer)
    ]
    binding = session.io_binding()
    binding.bind_output("logits")
    for i in range(config.n_layer):
        for j, kv in enumerate(("key", "value")):
            binding.bind_ortvalue_input(f"past_key_values.{i}.{kv}", buffers[2 * i + j])
            binding.bind_ortvalue_output(f"present.{i}.{kv}", buffers[2 * i + j])

    def run(ids, onnx_mask, positions, keep):
        binding.bind_cpu_input("input_ids", ids.numpy())
        binding.bind_cpu_input("attention_mask", onnx_mask.numpy())
        binding.bind_cpu_input("position_ids", positions.numpy())
        binding.bind_ortvalue_input("num_logits_to_keep", ort.OrtValue.ortvalue_from_numpy(np.array(keep)))
        binding.bind_output("logits")
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    with torch.no_grad():
        positions = torch.arange(width)[None, :] * mask
        torch_logits, torch_past = model(input_ids, mask, positions)
        onnx_logits = run(input_ids, mask, positions, 0)
        assert onnx_logits.shape == tuple(torch_logits.shape)
        worst = float(np.abs(onnx_logits - torch_logits.numpy())[mask.bool().numpy()].max())
        totals = torch.tensor(lengths)
        next_ids = torch_logits[torch.arange(batch), totals - 1].argmax(-1, keepdim=True)  # each row's last token
        torch_mask = mask
        for _ in range(DECODE_STEPS):
            positions = totals[:, None].clone()
            torch_mask = torch.cat([torch_mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            torch_logits, torch_past = model(next_ids, torch_mask, positions, torch_past)
            totals = totals + 1
            onnx_logits = run(
                next_ids, (torch.arange(int(totals.max()))[None, :] < totals[:, None]).long(), positions, 1
            )
            assert onnx_logits.shape == tuple(torch_logits.shape) == (batch, 1, config.vocab_size)
            worst = max(worst, float(np.abs(onnx_logits - torch_logits.numpy()).max()))
            next_ids = torch_logits[:, -1, :].argmax(-1, keepdim=True)
    return worst


def prompt_batch(model: GPT, *, batch: int, length: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts; row r is left-padded by 2r tokens (its mask starts with 2r zeros)."""
    input_ids = torch.randint(
        0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)
    )
    attention_mask = torch.ones_like(input_ids)
    for row in range(1, batch):
        attention_mask[row, : 2 * row] = 0
    return input_ids, attention_mask


def stored_bytes(onnx_path: Path) -> int:
    """model.onnx plus the bytes of the tensors it keeps in model.onnx.data, without the alignment padding."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    lengths = [int(e.value) for init in graph.initializer for e in init.external_data if e.key == "length"]
    return onnx_path.stat().st_size + sum(lengths)


def vocab_initializers(onnx_path: Path, config: GPTConfig) -> list[onnx.TensorProto]:
    shapes = {(config.n_embd, config.vocab_size), (config.vocab_size, config.n_embd)}
    graph = onnx.load(str(onnx_path)).graph
    return [init for init in graph.initializer if tuple(init.dims) in shapes]


# ONNX Runtime against PyTorch


@pytest.mark.parametrize("lengths", [[7], [7, 4, 6]], ids=["batch1", "batch3-right-padded"])
def test_fused_onnx_matches_pytorch(reference, exported, lengths):
    assert max_fused_difference(reference, exported / "model.onnx", lengths) < ONNX_TOLERANCE


@pytest.mark.parametrize("batch", [1, 2], ids=["batch1", "batch2-left-padded"])
def test_standard_onnx_matches_pytorch(reference, exported_standard, batch):
    input_ids, attention_mask = prompt_batch(reference, batch=batch)
    difference = max_onnx_difference(reference, exported_standard / "model.onnx", input_ids, attention_mask)
    assert difference < ONNX_TOLERANCE


def test_fused_graph_with_a_growing_cache(reference, exported):
    """Fed separate past arrays (no shared buffer), the fused graph also runs as the standard one does."""
    input_ids, attention_mask = prompt_batch(reference, batch=1)
    assert max_onnx_difference(reference, exported / "model.onnx", input_ids, attention_mask) < ONNX_TOLERANCE


def test_fused_graph_is_fused(exported, exported_standard):
    ops = [n.op_type for n in onnx.load(str(exported / "model.onnx")).graph.node]
    standard_ops = [n.op_type for n in onnx.load(str(exported_standard / "model.onnx")).graph.node]
    assert ops.count("GroupQueryAttention") == 2  # one per layer
    assert "Concat" not in ops and "Softmax" not in ops
    assert "GroupQueryAttention" not in standard_ops and "Softmax" in standard_ops
    assert len(ops) < len(standard_ops) / 2


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_onnx_graph_has_the_contract_io_names(reference, exported, exported_standard, graph):
    folder = exported if graph == "fused" else exported_standard
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    n_layer = reference.config.n_layer
    pairs = [(i, kv) for i in range(n_layer) for kv in ("key", "value")]
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i, kv in pairs
    ]
    assert [o.name for o in session.get_outputs()] == ["logits"] + [f"present.{i}.{kv}" for i, kv in pairs]
    assert session.get_outputs()[0].shape[2] == VOCAB
    optional = [i.name for i in session.get_overridable_initializers()]
    assert optional == (["num_logits_to_keep"] if graph == "fused" else [])


def test_last_token_logits_export(checkpoint, reference, tmp_path):
    manifest = export_package(
        checkpoint, tmp_path / "pkg", attention="standard", last_token_logits=True, progress=quiet
    )
    assert manifest["export"]["last_token_logits"] is True
    onnx_path = tmp_path / "pkg" / "model.onnx"
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    input_ids, attention_mask = prompt_batch(reference, batch=2)
    config = reference.config
    empty = np.zeros((2, config.n_head, 0, config.head_dim), dtype=np.float32)
    feed = {
        "input_ids": input_ids.numpy(),
        "attention_mask": attention_mask.numpy(),
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0).numpy(),
        **{f"past_key_values.{i}.{kv}": empty for i in range(config.n_layer) for kv in ("key", "value")},
    }
    (logits,) = session.run(["logits"], feed)
    assert logits.shape == (2, 1, VOCAB)
    difference = max_onnx_difference(reference, onnx_path, input_ids, attention_mask, last_token_logits=True)
    assert difference < ONNX_TOLERANCE


def test_untied_export(checkpoint, reference, exported, tmp_path):
    manifest = export_package(checkpoint, tmp_path / "pkg", untie=True, progress=quiet)
    onnx_path = tmp_path / "pkg" / "model.onnx"
    assert manifest["architecture"]["details"]["tie_word_embeddings"] is False
    assert manifest["export"]["tied_embedding_bytes_saved"] == 0
    assert len(vocab_initializers(onnx_path, reference.config)) == 2  # embedding and LM head, separately
    embedding_bytes = VOCAB * reference.config.n_embd * 4
    extra_bytes = stored_bytes(onnx_path) - stored_bytes(exported / "model.onnx")
    assert extra_bytes == pytest.approx(embedding_bytes, abs=4096)  # the second copy, and little else
    assert max_fused_difference(reference, onnx_path, [7, 5]) < ONNX_TOLERANCE
    manifest = export_package(checkpoint, tmp_path / "standard", attention="standard", untie=True, progress=quiet)
    assert len(vocab_initializers(tmp_path / "standard" / "model.onnx", reference.config)) == 2
    input_ids, attention_mask = prompt_batch(reference, batch=2)
    difference = max_onnx_difference(reference, tmp_path / "standard" / "model.onnx", input_ids, attention_mask)
    assert difference < ONNX_TOLERANCE


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_sinusoidal_positions_export(tmp_path, activation):
    torch.manual_seed(0)
    config = GPTConfig(**TINY, positional="sinusoidal", activation=activation, bos_token_id=0, eos_token_id=0)
    model = GPT(config).eval()
    save_checkpoint(model, tmp_path / "ckpt")
    manifest = export_package(tmp_path / "ckpt", tmp_path / "pkg", progress=quiet)
    assert manifest["architecture"]["details"]["positional"] == "sinusoidal"
    # compared with the model in memory: this also checks that the checkpoint kept its positional kind
    assert max_fused_difference(model, tmp_path / "pkg" / "model.onnx", [7, 3]) < ONNX_TOLERANCE
    export_package(tmp_path / "ckpt", tmp_path / "standard", attention="standard", progress=quiet)
    input_ids, attention_mask = prompt_batch(model, batch=2)
    difference = max_onnx_difference(model, tmp_path / "standard" / "model.onnx", input_ids, attention_mask)
    assert difference < ONNX_TOLERANCE


# Size: a tied embedding is stored once


def test_tied_embedding_stored_once(reference, exported):
    onnx_path = exported / "model.onnx"
    assert len(vocab_initializers(onnx_path, reference.config)) == 1
    assert stored_bytes(onnx_path) <= reference.num_parameters() * 4 + SIZE_SLACK
    # the weights are in model.onnx.data, padded only to align each tensor of a page or more
    data = exported / "model.onnx.data"
    assert onnx_path.stat().st_size < SIZE_SLACK
    assert data.stat().st_size <= stored_bytes(onnx_path) + SIZE_SLACK


# The manifest


def test_manifest(package, hf_checkpoint):
    manifest = json.loads((package / "edgelm.json").read_text())
    config = load_checkpoint(hf_checkpoint).config
    assert manifest["format"] == "edgelm-package"
    assert manifest["format_version"] == 2
    arch = manifest["architecture"]
    assert arch["type"] == "gpt2"
    assert (arch["vocab_size"], arch["n_layer"], arch["n_head"], arch["n_kv_head"], arch["details"]["n_embd"]) == (
        config.vocab_size,
        config.n_layer,
        config.n_head,
        config.n_head,
        config.n_embd,
    )
    assert arch["head_dim"] == config.n_embd // config.n_head
    assert arch["context_length"] == config.n_positions
    assert arch["details"]["tie_word_embeddings"] is True
    assert manifest["model_file"] == "model.onnx"
    assert manifest["io"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "position_ids": "position_ids",
        "logits": "logits",
        "past_key": "past_key_values.%d.key",
        "past_value": "past_key_values.%d.value",
        "present_key": "present.%d.key",
        "present_value": "present.%d.value",
        "logits_to_keep": "num_logits_to_keep",
        "kv_cache": "shared_buffer",
        "kv_dtype": "float32",
    }
    assert manifest["export"]["last_token_logits"] is False
    assert manifest["tokenizer"] == {
        "file": "tokenizer.json",
        "bos_token_id": 0,
        "eos_token_ids": [0],
        "pad_token_id": 0,
        "chat_template": None,
    }
    assert manifest["precision"] == "fp32"
    assert manifest["export"]["opset"] == 17
    assert manifest["export"]["external_data"] == "model.onnx.data"
    assert manifest["export"]["tied_embedding_bytes_saved"] == config.vocab_size * config.n_embd * 4
    assert manifest["source"]["sha256"] == combined_hash(source_hashes(hf_checkpoint))
    assert 0 <= manifest["parity"]["max_abs_logit_diff"] <= ONNX_TOLERANCE

    on_disk = {p.name for p in package.iterdir()}
    assert on_disk == set(manifest["files"]) | {"edgelm.json"}
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= on_disk
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == file_sha256(package / name), name
        assert entry["bytes"] == (package / name).stat().st_size, name
    assert read_package(package).kind == "edgelm"  # the runtime's reader accepts it, hashes verified


def test_genai_config(package, hf_checkpoint):
    config = load_checkpoint(hf_checkpoint).config
    genai = json.loads((package / "genai_config.json").read_text())
    decoder = genai["model"]["decoder"]
    assert decoder["filename"] == "model.onnx"
    assert decoder["num_hidden_layers"] == config.n_layer
    assert decoder["head_size"] == config.n_embd // config.n_head
    assert genai["model"]["context_length"] == config.n_positions
    assert genai["model"]["eos_token_id"] == 0


def test_source_hash_identifies_the_checkpoint(hf_checkpoint, tmp_path):
    copy = Path(shutil.copytree(hf_checkpoint, tmp_path / "copy"))
    assert combined_hash(source_hashes(copy)) == combined_hash(source_hashes(hf_checkpoint))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-6}))
    assert combined_hash(source_hashes(copy)) != combined_hash(source_hashes(hf_checkpoint))


# onnxruntime-genai runs the package as it is


@pytest.mark.parametrize("seed,graph", [(1, "fused"), (3, "fused"), (1, "standard")])
def test_onnxruntime_genai_greedy_matches_pytorch(reference, exported, exported_standard, seed, graph):
    exported = exported if graph == "fused" else exported_standard
    new_tokens = 32
    prompt = torch.randint(1, VOCAB, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    expected = reference.generate_greedy(torch.tensor([prompt]), new_tokens)[0].tolist()
    assert reference.config.eos_token_id not in expected  # else genai would stop early, by design
    assert len(set(expected)) > 4  # a model that repeats one token would make this test weak

    assert genai_greedy(exported, prompt, new_tokens) == expected


# Failures are clear and leave nothing behind


def test_existing_out_dir_needs_overwrite(checkpoint, tmp_path):
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for overwrite in (False, True):  # a folder of someone's files is never replaced, overwrite or not
        with pytest.raises(ValueError, match="not an edgelm package"):
            export_package(checkpoint, out, overwrite=overwrite, progress=quiet)
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]
    (out / "keep.txt").unlink()
    with pytest.raises(FileExistsError, match="overwrite"):
        export_package(checkpoint, out, progress=quiet)
    export_package(checkpoint, out, overwrite=True, progress=quiet)  # an empty folder
    export_package(checkpoint, out, overwrite=True, progress=quiet)  # a previous package
    assert (out / "edgelm.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


def test_out_dir_must_not_be_the_checkpoint(checkpoint, tmp_path):
    copy = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
    before = sorted(p.name for p in copy.iterdir())
    with pytest.raises(ValueError, match="must differ"):
        export_package(copy, copy, overwrite=True, progress=quiet)
    assert sorted(p.name for p in copy.iterdir()) == before


def test_failed_parity_leaves_nothing(checkpoint, tmp_path):
    parent = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disagree"):
        export_package(checkpoint, parent / "pkg", tolerance=-1.0, progress=quiet)
    assert not parent.exists()  # no package, no staging folder, not even the parent export made for it


def test_failed_load_leaves_nothing(checkpoint, tmp_path):
    bad = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    parent = tmp_path / "out"
    parent.mkdir()
    with pytest.raises(CheckpointError, match="falcon"):
        export_package(bad, parent / "pkg", progress=quiet)
    assert list(parent.iterdir()) == []


# The command line


def test_cli_export(checkpoint, tmp_path):
    result = edgelm("export", checkpoint, tmp_path / "pkg", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "max |logit difference|" in result.stdout
    assert read_package(tmp_path / "pkg").arch.n_layer == TINY["n_layer"]


@pytest.mark.parametrize("problem", ["missing-checkpoint", "unknown-family", "out-dir-exists"])
def test_cli_export_bad_input(checkpoint, tmp_path, problem):
    source, out = checkpoint, tmp_path / "pkg"
    if problem == "missing-checkpoint":
        source = tmp_path / "nowhere"
    elif problem == "unknown-family":
        source = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    else:
        out.mkdir()
    result = edgelm("export", source, out, cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("edgelm export: error:")
    assert out.exists() == (problem == "out-dir-exists")


def test_save_checkpoint_is_staged_and_refuses_what_export_refuses(tmp_path):
    """models/train_shakespeare.py's checkpoint goes through the package writer: a symlinked folder or file is
    never written through, existing files are replaced only with overwrite, and the extra files come along."""
    model = GPT(GPTConfig(**TINY, bos_token_id=0, eos_token_id=0)).eval()
    save_checkpoint(model, tmp_path / "ckpt", extra={"training.json": "{}\n"})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.json",
        "model.safetensors",
        "training.json",
    ]
    before = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        save_checkpoint(model, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == before
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="symlink"):
        save_checkpoint(model, tmp_path / "link", overwrite=True)
    (tmp_path / "ckpt" / "config.json").unlink()
    (tmp_path / "ckpt" / "config.json").symlink_to(tmp_path / "elsewhere" / "target.json")
    with pytest.raises(ValueError, match="symlink"):
        save_checkpoint(model, tmp_path / "ckpt", overwrite=True)
    assert not list((tmp_path / "elsewhere").iterdir())
    (tmp_path / "ckpt" / "config.json").unlink()
    save_checkpoint(model, tmp_path / "ckpt", overwrite=True)
    assert load_checkpoint(tmp_path / "ckpt").config.n_layer == model.config.n_layer
