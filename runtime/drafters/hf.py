"""Any transformers causal LM as a drafter, over transformers' own dynamic KV cache.

The generic path: it runs every architecture transformers knows (Gemma 3 among them), at
transformers' speed. Same-architecture drafters the runtime's own models cover go through
`runtime.drafters.fast` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_run.runtime.drafters.model import TreeState


class HFDraftModel:
    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model.eval()
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.head = model.get_output_embeddings().weight  # [vocab, hidden]
        self.vocab_size = int(self.head.shape[0])
        self.softcap = getattr(getattr(model.config, "get_text_config", lambda: model.config)(),
                               "final_logit_softcapping", None)
        self.cache = DynamicCache()  # full layers only: rollback works at any length
        self.length = 0
        self.device = self.head.device
        self.tree: TreeState | None = None
        self._pruned: dict = {}

    def prune_head(self, rows: torch.Tensor) -> torch.Tensor:
        key = (rows.numel(), hash(tuple(rows[:64].tolist())), int(rows.sum()))
        if key not in self._pruned:  # one copy per row set, reused by every generation
            self._pruned = {key: self.head.index_select(0, rows.to(self.device)).contiguous()}  # [len(rows), hidden]
        return self._pruned[key]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, parents: torch.Tensor | None = None,
                head: torch.Tensor | None = None) -> torch.Tensor:
        n = ids.numel()
        if parents is None:
            if self.tree is not None:
                raise ValueError("a chain forward inside an open tree: truncate first")
            positions = torch.arange(self.length, self.length + n)
            mask = None
        else:
            if self.tree is None:
                self.tree = TreeState(self.length)
            positions, mask = self.tree.add(parents.tolist())
            mask = mask[None, None].to(self.device)
        hidden = self.decoder(
            input_ids=ids.to(self.device)[None], position_ids=positions.to(self.device)[None],
            attention_mask=mask, cache=self.cache, use_cache=True,
        ).last_hidden_state[0]  # [n, hidden]
        self.length += n
        logits = F.linear(hidden, self.head if head is None else head).float()  # [n, vocab or rows]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a drafter cache of {self.length} tokens to {length}")
        self.cache.crop(length - self.length)  # a negative count removes that many tokens
        self.length = length
        self.tree = None
