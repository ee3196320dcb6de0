"""The tensor-parallel target as seen from rank 0, and the loop the other ranks run.

Rank 0 drives: `TargetRunner.step(batch)` first broadcasts one small command to the worker
ranks, then runs rank 0's own shard. Workers sit in `serve_worker`, which accepts only the
commands below:

    STEP  a ForwardBatch (batch.py), packed as int64s  -> model.forward_batch
    STOP                                               -> return

Each command is one broadcast of HEADER int64s over the model's group (on its device, so NCCL
groups work too): [command, payload length, payload...], the payload inline when it fits (a
decode or verify step); a longer one (a prompt, a large batch) follows in a second broadcast.
Workers keep no per-sequence state: rank 0 owns the block tables and sequence lengths, so
rolling a sequence back sends nothing. A batch is checked on rank 0 before anything is sent,
so a bad call raises there and never desynchronises the workers. At world size 1 nothing is
sent and the runner simply calls the model.

The runner also drives rank 0's one-sequence view of the cache (`forward` / `truncate` /
`keep`, see one_sequence.py) through `step`, so the single-request paths run unchanged under
tensor parallelism.
"""

from __future__ import annotations

import enum
import logging

import torch

from hetero_run.runtime.models.batch import ForwardBatch
from hetero_run.runtime.models.decoder import TargetModel
from hetero_run.runtime.models.parallel import ParallelContext

log = logging.getLogger(__name__)


class Command(enum.IntEnum):
    STEP = 1
    STOP = 2


HEADER = 256  # int64s per command broadcast; payloads up to HEADER - 2 ride inline


class TargetRunner:
    """Rank 0's handle on the whole TP target: `step`, the one-sequence `forward` / `truncate` /
    `keep`, and `close`."""

    def __init__(self, model: TargetModel, ctx: ParallelContext | None = None):
        self.model = model
        self.ctx = ctx or model.ctx
        if not self.ctx.is_first:
            raise ValueError("TargetRunner runs on rank 0; the other ranks run serve_worker")
        self._header = torch.zeros(HEADER, dtype=torch.int64, device=self.ctx.device)
        self.closed = False
        self.sequence = model.sequence
        self.sequence.run = self.step  # rank 0's one-sequence forwards now reach the workers too

    @property
    def length(self) -> int:
        """Tokens in the one-sequence cache."""
        return self.sequence.length

    @property
    def max_tokens(self) -> int:
        return self.model.max_tokens

    @property
    def block_size(self) -> int:
        return self.model.kv.block_size

    @property
    def num_blocks(self) -> int:
        return self.model.kv.num_blocks

    def step(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Run `batch` on every rank -> the logits of its logits_rows (float32), or None when it
        asks for none."""
        if self.closed:
            raise RuntimeError("the target runner is closed")
        batch.check(self.model.kv.num_slots)
        if self.ctx.size > 1:
            payload = batch.to_tensor().to(self.ctx.device)
            n = payload.numel()
            header = self._header
            header[:2] = torch.tensor([int(Command.STEP), n])
            if n <= HEADER - 2:
                header[2:2 + n] = payload
            self.ctx.broadcast(header)
            if n > HEADER - 2:
                self.ctx.broadcast(payload)
        return self.model.forward_batch(batch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_logits: int | None = None,
                parents: list[int] | None = None) -> torch.Tensor:
        """ids, positions [n] -> logits [num_logits or n, vocab] (float32), appended to the
        one-sequence cache on every rank. Verifying k draft tokens: ids = [last accepted token,
        draft_1 .. draft_k]; a tree of candidates passes `parents` (OneSequence.forward)."""
        return self.sequence.forward(input_ids, positions, num_logits, parents)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of the one-sequence cache (e.g. the accepted prefix)."""
        self.sequence.truncate(length)

    def keep(self, rows: list[int]) -> None:
        """After a tree forward: keep row 0 and the accepted path `rows` (OneSequence.keep)."""
        self.sequence.keep(rows)

    def close(self) -> None:
        """Let the worker ranks leave `serve_worker`. Idempotent."""
        if not self.closed:
            self.closed = True
            self.sequence.run = self.model.forward_batch
            if self.ctx.size > 1:
                self._header[:2] = torch.tensor([int(Command.STOP), 0])
                self.ctx.broadcast(self._header)

    def __enter__(self) -> TargetRunner:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # workers should stop cleanly even when rank 0 fails, unless the group itself broke
            self.close()
        except Exception as close_exc:
            log.debug("could not send STOP after %s: %s", exc_type.__name__, close_exc)


def serve_worker(model: TargetModel, ctx: ParallelContext | None = None) -> int:
    """Run the commands rank 0 broadcasts until STOP; returns how many were served."""
    ctx = ctx or model.ctx
    header = torch.zeros(HEADER, dtype=torch.int64, device=ctx.device)
    served = 0
    while True:
        ctx.broadcast(header)
        command, n = header[:2].tolist()
        if command == Command.STEP:
            if n <= HEADER - 2:
                payload = header[2:2 + n].clone()
            else:
                payload = ctx.broadcast(torch.empty(n, dtype=torch.int64, device=ctx.device))
            model.forward_batch(ForwardBatch.from_tensor(payload.cpu()))
        elif command == Command.STOP:
            log.debug("worker served %d commands", served)
            return served
        else:
            raise RuntimeError(f"rank {ctx.rank} received unknown command {command} from rank 0")
        served += 1
