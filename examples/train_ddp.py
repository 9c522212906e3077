"""A complete small DDP training job with StreamLoader and Checkpointer.

    torchrun --nproc_per_node=2 examples/train_ddp.py --data DATA --ckpt CKPT --steps 60

It resumes by itself from the newest complete checkpoint under --ckpt (model, optimizer,
loader cursor and RNG states), on any number of processes that divides the global batch.
Rank 0 appends one line per step to --step-log: the step, the global batch's loss and a digest of
the global batch's sample ids, so two runs can be compared step by step
(examples/kill_and_resume.sh does that). gloo on CPU, nccl on GPU.

``python examples/train_ddp.py --prepare --data DATA`` writes the synthetic dataset first.
Shards are cached under --cache-dir (default: streamcache's node cache, ~/.cache/streamcache
or $STREAMCACHE_CACHE_DIR); rank 0 prints where.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from streamcache import IndexNotFoundError, StreamDataset, StreamLoader, load_index
from streamcache.checkpoint import Checkpointer, ModelState


def prepare(url: str, samples: int = 20_000) -> None:
    from streamcache import Field, Schema, ShardWriter

    if os.path.exists(os.path.join(url, "index.json")):
        return
    rng = np.random.default_rng(0)
    schema = Schema([Field.tensor("tokens", "int32", (64,)), Field.tensor("label", "int64")])
    with ShardWriter(url, schema=schema, shard_size=1 << 20) as writer:
        for _ in range(samples):
            tokens = rng.integers(0, 1000, 64, dtype=np.int32)
            writer.write({"tokens": tokens, "label": int(tokens[:8].sum() % 4)})


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(1000, 32)
        # No dropout: per-rank random streams cannot match across world sizes, and this
        # example compares the loss curve of a run resumed on another number of processes.
        self.head = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                        torch.nn.Linear(32, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens.long()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--ckpt")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--step-log", help="file that rank 0 appends one line per step to")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="slow the loop down")
    parser.add_argument("--cache-dir", help="node cache folder (default: streamcache's)")
    parser.add_argument("--prepare", action="store_true", help="write the dataset and exit")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.data)
        return 0
    try:
        load_index(args.data)
    except IndexNotFoundError:
        parser.exit(2, f"train_ddp.py: error: no dataset at {args.data}; write one first with "
                       f"`python examples/train_ddp.py --prepare --data {args.data}`\n")

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.parallel.DistributedDataParallel(Model().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1000 + rank)  # per-rank RNG streams are saved and restored too
    dataset = StreamDataset(args.data, global_batch_size=args.global_batch, seed=42,
                            infinite=True, cache_dir=args.cache_dir)
    loader = StreamLoader(dataset, pin_memory=use_cuda)
    state = {"model": ModelState(model.module, optimizer), "loader": loader}
    with Checkpointer(args.ckpt, keep_last=2) as checkpointer:
        step = checkpointer.load(state) or 0
        if rank == 0:
            print(f"world size {world}: starting at step {step}; shards cached in "
                  f"{dataset.reader.store.cache.cache_dir}", flush=True)
        for batch in loader:
            if step >= args.steps:
                break
            logits = model(batch["tokens"].to(device, non_blocking=True))
            loss = torch.nn.functional.cross_entropy(logits, batch["label"].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            record(step, loss.detach(), batch["__id__"], rank, world, args.step_log)
            if step % args.save_every == 0:
                checkpointer.save(step, state)
            if args.step_sleep:
                import time

                time.sleep(args.step_sleep)
    dist.destroy_process_group()
    return 0


def record(step: int, loss: torch.Tensor, ids: torch.Tensor, rank: int, world: int,
           log: str | None) -> None:
    """Rank 0 logs the global batch's mean loss and a digest of its sample ids."""
    total = loss.float().cpu() * len(ids)
    dist.all_reduce(total)
    parts: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(parts, ids.tolist())
    if rank != 0:
        return
    global_ids = [i for part in parts for i in part]
    digest = hashlib.sha256(str(global_ids).encode()).hexdigest()[:16]
    line = f"step {step} loss {total.item() / len(global_ids):.6f} ids {digest}"
    print(line, flush=True)
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
