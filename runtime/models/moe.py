"""Qwen3-MoE's sparse block: a replicated router and experts sharded on the intermediate dim.

Every rank holds the full router and computes the same routing (its input is the same
all-reduced residual stream), so all ranks run the same experts, each over its slice of
every expert's intermediate dimension. The weighted partial outputs of all chosen experts are
summed locally and then over the group with a single all-reduce.

Each token sums its experts' outputs in ascending expert id, whatever the other tokens chose,
and the router is a batch-invariant product (batch_invariance.py): a token gets the same bits
in a forward of one token as in a verify forward of several.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetero_run.kernels.dense_linear import dense_linear
from hetero_run.runtime.models.linear import Weight
from hetero_run.runtime.models.parallel import ParallelContext


@dataclass
class Expert:
    gate_up: Weight  # [2 * moe_intermediate_local, hidden]: gate rows, then up rows
    down: Weight  # [hidden, moe_intermediate_local]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [m, hidden] -> [m, hidden], partial sum
        gate, up = self.gate_up.matmul(x).chunk(2, dim=-1)
        return self.down.matmul(F.silu(gate, inplace=True).mul_(up))


class SparseMoE:
    def __init__(self, router: torch.Tensor, experts: list[Expert], top_k: int, norm_topk_prob: bool,
                 ctx: ParallelContext):
        self.router = router  # [num_experts, hidden], replicated
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.ctx = ctx

    @property
    def nbytes(self) -> int:
        return self.router.nbytes + sum(e.gate_up.nbytes + e.down.nbytes for e in self.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, top_k] in x's dtype, expert ids [n, top_k])."""
        probs = dense_linear(x, self.router).softmax(dim=-1, dtype=torch.float32)  # [n, num_experts]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        weights, ids = self.route(x)
        chosen = ids.tolist()  # the one host sync of the block
        routed: dict[int, tuple[list[int], list[int]]] = {}  # expert -> (its tokens, their top-k slots)
        for token, row in enumerate(chosen):
            for slot, e in enumerate(row):
                routed.setdefault(e, ([], []))[0].append(token)
                routed[e][1].append(slot)
        out = torch.zeros_like(x)
        for e in sorted(routed):
            tokens, slots = (torch.tensor(t, device=x.device) for t in routed[e])
            y = self.experts[e](x[tokens]) * weights[tokens, slots, None]  # [m, hidden]
            out.index_add_(0, tokens, y)
        return self.ctx.all_reduce(out)
