"""The training token stream: train shards in sorted order, wrapping around, split across ranks.

Validation tokens are never read here: only the evaluators load them (trainer/finish.py, eval/).
"""

import torch

from primitives.env import BUNDLE_KIND
from shards.format import list_shards, load_data_shard, read_shard_header


class DistributedTokenLoader:
    """The train token stream: shards in sorted order, wrapping around, split across ranks.

    `next_batch` takes one span of local_tokens + 1 tokens per rank (official layout), so world size
    W with accumulation A sees the same tokens in the same order as 1 rank with W*A micro steps: DDP
    and grad accumulation are interchangeable. In the package, every shard header is validated up front and each
    shard's ids against `vocab_size` when it is loaded (ValueError naming the file; a record's train_gpt.py has
    checked every train shard's header and ids before the clock, trainer/checks.py check_train_tokens). The position
    (`shard_index`, `offset`) is checkpointable through `seek`. `opened` is the set of shard paths
    loaded so far (warmup steps included): the evidence for compliance.val_not_seen_in_training.
    """

    def __init__(self, data_path: str, vocab_size: int, rank: int = 0, world_size: int = 1, device="cpu"):
        self.files = list_shards(data_path, "train")
        if BUNDLE_KIND == "package":  # a record's file has read every train shard's header and ids before the clock
            for path in self.files:
                read_shard_header(path)
            self.vocab_size = vocab_size
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.shard_index, self.opened = -1, set()
        self.seek(0, 0)

    def seek(self, shard_index: int, offset: int) -> None:
        if shard_index != self.shard_index:
            self.opened.add(self.files[shard_index])
            self.tokens = load_data_shard(self.files[shard_index])
            if BUNDLE_KIND == "package":  # a record's file checks every train shard's ids before the clock only
                top = int(self.tokens.numpy().max()) if self.tokens.numel() else 0  # (trainer/checks.py)
                if top >= self.vocab_size:
                    raise ValueError(f"{self.files[shard_index]}: token id {top} >= VOCAB_SIZE={self.vocab_size}")
        self.shard_index, self.offset = shard_index, offset

    def take(self, n: int) -> torch.Tensor:
        """The next n tokens of the stream, int64 [n]."""
        parts = []
        while n > 0:
            if self.offset >= self.tokens.numel():
                self.seek((self.shard_index + 1) % len(self.files), 0)
                continue
            parts.append(self.tokens[self.offset:self.offset + n])
            self.offset += len(parts[-1])
            n -= len(parts[-1])
        return torch.cat(parts).long()

    def next_batch(self, local_tokens: int, seq_len: int):
        """x, y: int64 [local_tokens // seq_len, seq_len] on the device, y = x shifted by one.

        On CUDA the batch is copied from pinned memory with non_blocking=True: a copy from pageable
        memory synchronizes the stream (CUDA runtime API, "API synchronization behavior"), which
        would stall the host once per micro-step instead of letting it queue the next kernels.
        """
        span = local_tokens + 1
        local = self.take(span * self.world_size)[self.rank * span:(self.rank + 1) * span]
        if self.device.type == "cuda":
            local = local.pin_memory().to(self.device, non_blocking=True)
        return local[:-1].reshape(-1, seq_len), local[1:].reshape(-1, seq_len)
