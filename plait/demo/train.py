"""The demo worker: Megatron dp=2 x tp=2 GPT training on the bundled corpus (run under plait run)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

import plait
from plait.testing.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss

logger = logging.getLogger("plait.demo")


def load_corpus() -> tuple[torch.Tensor, int]:
    text = (Path(__file__).parent / "corpus.txt").read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text]), len(chars)


def sample_batch(
    data: torch.Tensor, seq: int, batch: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    ids = torch.stack([data[s : s + seq] for s in starts])
    targets = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
    return ids, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=16, help="global batch size (sequences)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length (characters)")
    args = parser.parse_args()
    world = plait.init()
    data, vocab = load_corpus()
    torch.manual_seed(0)  # every rank builds the same initial model
    model = TinyGPT(GPTConfig(vocab=vocab, seq=args.seq, width=64, heads=4, layers=2))
    tp = 2 if world.world_size % 2 == 0 else 1
    annotate_megatron(model, tp)
    mesh = {"dp": world.world_size // tp, "tp": tp}
    job = plait.parallelize(
        model,
        plait.ParallelConfig(mode="semi_auto", mesh=mesh),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
        loss_fn=gpt_loss,
    )
    dp_size, dp_index = mesh["dp"], job.device_mesh.get_coordinate()[0]
    gen = torch.Generator().manual_seed(1234)  # same global batches on every rank
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(
        f"plait demo: GPT ({sum(p.numel() for p in model.parameters())} parameters) on mesh {mesh}, "
        f"{args.steps} steps of {args.batch} x {args.seq} characters"
    )
    first = last = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, targets = sample_batch(data, args.seq, args.batch, gen)
        local = (ids.chunk(dp_size)[dp_index], targets.chunk(dp_size)[dp_index])
        last = job.step(local)
        first = first if first is not None else last
        if step == 1 or step % 10 == 0:
            rate = step * args.batch * args.seq / (time.perf_counter() - start)
            say(f"step {step:4d}  loss {last:.4f}  {rate:,.0f} tokens/s")
    say(f"done: loss {first:.4f} -> {last:.4f} in {time.perf_counter() - start:.1f} s")
    if last >= first:
        raise SystemExit(f"the loss did not fall ({first:.4f} -> {last:.4f})")


if __name__ == "__main__":
    main()
