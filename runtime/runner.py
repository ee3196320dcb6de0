"""The tensor-parallel target as seen from rank 0, and the loop the other ranks run.

Rank 0 drives: every call on `TargetRunner` first broadcasts one small command to the worker
ranks, then runs rank 0's own shard. Workers sit in `serve_worker`, which accepts only the
commands below:

    FORWARD  n target ids and their positions, num_logits  -> model.forward
    TRUNCATE length                                         -> model.truncate
    STOP                                                    -> return

Each command is one broadcast of HEADER int64s over the model's group (on its device, so NCCL
groups work too): [command, n, arg, num_logits, ids..., positions...], the ids and positions
inline for up to INLINE tokens (a decode step, a verify step); a longer forward (a prompt)
sends them in a second broadcast of [2, n]. Arguments are checked on rank 0 before anything
is sent, so a bad call raises there and never desynchronises the workers. At world size 1
nothing is sent and the runner simply calls the model.
"""

from __future__ import annotations

import enum
import logging

import torch

from hetero_run.runtime.models.decoder import TargetModel
from hetero_run.runtime.models.parallel import ParallelContext

log = logging.getLogger(__name__)


class Command(enum.IntEnum):
    FORWARD = 1
    TRUNCATE = 2
    STOP = 3


INLINE = 16  # tokens whose ids and positions ride in the header
HEADER = 4 + 2 * INLINE


class TargetRunner:
    """Rank 0's handle on the whole TP target: `forward`, `truncate`, `close`."""

    def __init__(self, model: TargetModel, ctx: ParallelContext | None = None):
        self.model = model
        self.ctx = ctx or model.ctx
        if not self.ctx.is_first:
            raise ValueError("TargetRunner runs on rank 0; the other ranks run serve_worker")
        self._header = torch.zeros(HEADER, dtype=torch.int64, device=self.ctx.device)
        self.closed = False

    @property
    def length(self) -> int:
        """Tokens in the target's KV cache."""
        return self.model.length

    @property
    def max_tokens(self) -> int:
        return self.model.max_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                num_logits: int | None = None) -> torch.Tensor:
        """ids, positions [n] -> logits [num_logits or n, vocab] (float32), appended to the cache
        on every rank. Verifying k draft tokens: ids = [last accepted token, draft_1 .. draft_k]."""
        n = input_ids.shape[0]
        if n < 1 or input_ids.shape != positions.shape or not 1 <= (num_logits or n) <= n:
            raise ValueError(f"bad forward: ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)}, "
                             f"num_logits {num_logits}")
        self.model.kv.check_room(n)
        if self.ctx.size > 1:
            tokens = torch.stack([input_ids, positions]).to(device=self.ctx.device, dtype=torch.int64)  # [2, n]
            self._send(Command.FORWARD, n, 0, num_logits or 0, tokens if n <= INLINE else None)
            if n > INLINE:
                self.ctx.broadcast(tokens)
        return self.model.forward(input_ids, positions, num_logits)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of the cache (e.g. the accepted prefix)."""
        if not 0 <= length <= self.model.length:
            raise ValueError(f"cannot truncate a cache of {self.model.length} tokens to {length}")
        if self.ctx.size > 1:
            self._send(Command.TRUNCATE, 0, length, 0)
        self.model.truncate(length)

    def close(self) -> None:
        """Let the worker ranks leave `serve_worker`. Idempotent."""
        if not self.closed:
            self.closed = True
            if self.ctx.size > 1:
                self._send(Command.STOP, 0, 0, 0)

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

    def _send(self, command: Command, n: int, arg: int, num_logits: int, tokens: torch.Tensor | None = None) -> None:
        header = self._header
        header[:4] = torch.tensor([int(command), n, arg, num_logits])
        if tokens is not None:
            header[4:4 + n] = tokens[0]
            header[4 + INLINE:4 + INLINE + n] = tokens[1]
        self.ctx.broadcast(header)


def serve_worker(model: TargetModel, ctx: ParallelContext | None = None) -> int:
    """Run the commands rank 0 broadcasts until STOP; returns how many were served."""
    ctx = ctx or model.ctx
    header = torch.zeros(HEADER, dtype=torch.int64, device=ctx.device)
    served = 0
    while True:
        ctx.broadcast(header)
        command, n, arg, num_logits = header[:4].tolist()
        if command == Command.FORWARD:
            if n <= INLINE:
                ids, positions = header[4:4 + n].clone(), header[4 + INLINE:4 + INLINE + n].clone()
            else:
                ids, positions = ctx.broadcast(torch.empty(2, n, dtype=torch.int64, device=ctx.device))
            model.forward(ids, positions, num_logits or None)
        elif command == Command.TRUNCATE:
            model.truncate(arg)
        elif command == Command.STOP:
            log.debug("worker served %d commands", served)
            return served
        else:
            raise RuntimeError(f"rank {ctx.rank} received unknown command {command} from rank 0")
        served += 1
