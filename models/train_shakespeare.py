"""Train the bundled default model: a small GPT-2 on Tiny Shakespeare, on the CPU.

    python models/train_shakespeare.py --out models/shakespeare --overwrite

Data: data/tinyshakespeare.txt (sha256 checked). The first 90% of the characters train; the last
10% are held out, never seen by the tokenizer or the model. Tokenizer: byte-level BPE (GPT-2's
scheme) trained with `tokenizers` on the training split, with one end-of-text token.
Optimiser: AdamW, linear warm-up then cosine decay, evaluation on the held-out split.

The held-out figure is bits per byte: the cross-entropy of every held-out token (windows of the
context length that do not overlap), in bits, divided by the held-out text's UTF-8 bytes. Unlike
loss per token it does not depend on the tokenizer, so models with different vocabularies compare.
The result is written to the checkpoint folder (config.json, model.safetensors, tokenizer files)
with a TRAINING.md recording the command, seed, steps, wall time and held-out figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from edgelm.export.families.gpt2 import check_checkpoint_output, save_checkpoint
from edgelm.export.models.gpt2 import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent
OUT_FILES = ("tokenizer.json", "tokenizer_config.json", "training.json")  # beside config.json, model.safetensors
DATA = REPO / "data" / "tinyshakespeare.txt"
DATA_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
EOT = "<|endoftext|>"


def read_splits(path: Path = DATA) -> tuple[str, str]:
    """(train, held-out): the first 90% of the characters and the last 10%."""
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DATA_SHA256:
        raise SystemExit(f"{path} has sha256 {digest}, expected {DATA_SHA256}")
    text = raw.decode("utf-8")
    split = int(0.9 * len(text))
    return text[:split], text[split:]


def write_eval_files(train: str, heldout: str) -> None:
    """The held-out split, and a slice of the training split for static-quantization calibration,
    as files: quantize, eval, the demo and the tests read these instead of re-deriving the split."""
    (REPO / "data" / "shakespeare-heldout.txt").write_text(heldout, encoding="utf-8")
    (REPO / "data" / "shakespeare-calibration.txt").write_text(train[:100_000], encoding="utf-8")


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


@torch.no_grad()
def heldout_bits_per_byte(
    model: GPT, ids: np.ndarray, n_bytes: int, context: int, batch: int = 16
) -> tuple[float, float]:
    """(bits per byte, nats per token) over all held-out tokens, in non-overlapping windows."""
    model.eval()
    n_windows = (len(ids) - 1) // context
    starts = [i * context for i in range(n_windows)]
    if (len(ids) - 1) % context:
        starts.append(len(ids) - 1 - context)  # last partial window: score only its new tokens
    total_nats, total_tokens, scored_until = 0.0, 0, 0
    for b in range(0, len(starts), batch):
        chunk = starts[b : b + batch]
        x = torch.from_numpy(np.stack([ids[s : s + context] for s in chunk]).astype(np.int64))
        y = torch.from_numpy(np.stack([ids[s + 1 : s + 1 + context] for s in chunk]).astype(np.int64))
        logits, _ = model(x)
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none").view(y.shape)
        for row, s in enumerate(chunk):
            skip = max(0, scored_until - s)  # tokens an earlier window already scored
            total_nats += nll[row, skip:].sum().item()
            total_tokens += context - skip
            scored_until = s + context
    model.train()
    return total_nats / math.log(2) / n_bytes, total_nats / total_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "models" / "shakespeare"), help="checkpoint folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace the checkpoint's files in --out")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    # Training windows are the full context: a learned position embedding never trained on would
    # be random at evaluation (and in use) for the positions past the training length.
    parser.add_argument("--context", type=int, default=256, help="context length (n_positions) = training window")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args(argv)
    check_checkpoint_output(args.out, extra=OUT_FILES, overwrite=args.overwrite)  # before training, not after

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()

    train_text, heldout_text = read_splits()
    write_eval_files(train_text, heldout_text)
    tokenizer = train_tokenizer(train_text, args.vocab_size)
    eot_id = tokenizer.token_to_id(EOT)
    train_ids = np.array(tokenizer.encode(train_text).ids, dtype=np.int64)
    heldout_ids = np.array(tokenizer.encode(heldout_text).ids, dtype=np.int64)
    heldout_bytes = len(heldout_text.encode("utf-8"))
    print(f"tokens: train {len(train_ids):,}, held-out {len(heldout_ids):,} ({heldout_bytes:,} bytes)")

    config = GPTConfig(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=args.context,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        dropout=args.dropout,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
    )
    model = GPT(config)
    print(f"model: {model.num_parameters() / 1e6:.2f}M parameters, {config}")

    # Weight decay on matrices only (not on biases, LayerNorm gains or position tables).
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wpe" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "wpe" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))

    history = []
    best = (float("inf"), None)
    model.train()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            bpb, nats = heldout_bits_per_byte(model, heldout_ids, heldout_bytes, args.context)
            elapsed = time.perf_counter() - started
            history.append(
                {"step": step, "heldout_bits_per_byte": round(bpb, 4), "heldout_nats_per_token": round(nats, 4)}
            )
            print(
                f"step {step:5d}  held-out {bpb:.4f} bits/byte  {nats:.4f} nats/token  {elapsed / 60:.1f} min",
                flush=True,
            )
            if bpb < best[0]:
                best = (bpb, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if step == args.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        starts = rng.integers(0, len(train_ids) - args.context - 1, size=args.batch_size)
        x = torch.from_numpy(np.stack([train_ids[s : s + args.context] for s in starts]))
        y = torch.from_numpy(np.stack([train_ids[s + 1 : s + 1 + args.context] for s in starts]))
        logits, _ = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            print(f"step {step:5d}  train loss {loss.item():.4f}  lr {lr_at(step):.2e}", flush=True)

    wall = time.perf_counter() - started
    best_bpb, best_state = best
    model.load_state_dict(best_state)
    model.config.dropout = 0.0  # the saved model is for inference
    out = Path(args.out)
    tokenizer_config = (
        json.dumps(
            {
                "tokenizer_class": "GPT2TokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "unk_token": EOT,
                "model_max_length": args.context,
                "add_prefix_space": False,
            },
            indent=2,
        )
        + "\n"
    )
    command = "python models/train_shakespeare.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {
        "command": command.strip(),
        "seed": args.seed,
        "steps": args.steps,
        "wall_time_minutes": round(wall / 60, 1),
        "threads": args.threads,
        "parameters": model.num_parameters(),
        "heldout_bits_per_byte": round(best_bpb, 4),
        "history": history,
        "hyperparameters": vars(args),
    }
    files = {"tokenizer.json": tokenizer.to_str(pretty=True), "tokenizer_config.json": tokenizer_config,
             "training.json": json.dumps(record, indent=2) + "\n"}  # fmt: skip
    save_checkpoint(model, out, extra=files, overwrite=args.overwrite)
    print(f"wrote {out}: held-out {best_bpb:.4f} bits/byte, {wall / 60:.1f} min")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileExistsError) as e:  # an output refused before training: one line, no traceback
        sys.exit(f"error: {e}")
