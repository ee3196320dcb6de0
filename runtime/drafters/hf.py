"""Any transformers causal LM as a drafter, over transformers' own dynamic KV cache.

The generic path: it runs every architecture transformers knows (Gemma 3 among them), at
transformers' speed. Same-architecture drafters the runtime's own models cover go through
`runtime.drafters.fast` instead. `HFDraftNetwork` gives it sequence slots with the interface
of `network.DraftNetwork`: one cache per slot (one `HFDraftModel` each, sharing the model),
and a batched forward that runs the slots one after another.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from hetero_run.runtime.drafters.model import TreeState


class HFDraftModel:
    def __init__(self, model, pruned: dict | None = None):
        from transformers import DynamicCache

        self.model = model.eval()
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.head = model.get_output_embeddings().weight  # [vocab, hidden]
        self.vocab_size = int(self.head.shape[0])
        self.softcap = getattr(getattr(model.config, "get_text_config", lambda: model.config)(),
                               "final_logit_softcapping", None)
        self.cache = DynamicCache()  # full layers only: rollback works at any length
        self._cache_arg = cache_argument(self.decoder)
        self.length = 0
        self.device = self.head.device
        self.tree: TreeState | None = None
        self._pruned: dict = {} if pruned is None else pruned  # shared by the slots of one network

    def prune_head(self, rows: torch.Tensor) -> torch.Tensor:
        return _pruned_head(self.head, self._pruned, rows)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, parents: torch.Tensor | None = None,
                head: torch.Tensor | None = None, last: bool = False) -> torch.Tensor:
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
            attention_mask=mask, use_cache=True, **{self._cache_arg: self.cache},
        ).last_hidden_state[0]  # [n, hidden]
        self.length += n
        if last:
            hidden = hidden[-1:]
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


def cache_argument(decoder) -> str:
    """The name the decoder's forward takes its KV cache by: `cache` in recent transformers,
    `past_key_values` before. Both versions accept any keyword (`**kwargs`), so the wrong name
    would be dropped without an error and every forward would run without the cache."""
    parameters = inspect.signature(decoder.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(f"{type(decoder).__name__}.forward takes neither `cache` nor `past_key_values`: "
                    "this transformers model cannot draft")


def _pruned_head(head: torch.Tensor, pruned: dict, rows: torch.Tensor) -> torch.Tensor:
    key = (rows.numel(), hash(tuple(rows[:64].tolist())), int(rows.sum()))
    if key not in pruned:  # one copy per row set, reused by every generation
        pruned.clear()
        pruned[key] = head.index_select(0, rows.to(head.device)).contiguous()  # [len(rows), hidden]
    return pruned[key]


class HFDraftNetwork:
    """Sequence slots over one transformers model, with the interface of `network.DraftNetwork`."""

    def __init__(self, model, slots: int = 1, max_tokens: int = 4096):
        from hetero_run.runtime.drafters.slots import SlotTable

        self.model = model.eval()
        self.table = SlotTable(slots, max_tokens)
        self._pruned: dict = {}
        self._caches: list[_SlotModel | None] = [None] * slots
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])

    @property
    def num_slots(self) -> int:
        return self.table.count

    @property
    def free_slots(self) -> int:
        return self.table.free

    @property
    def max_tokens(self) -> int:
        return self.table.max_tokens

    def acquire(self) -> int:
        slot = self.table.acquire()
        self._caches[slot] = _SlotModel(self, slot)
        return slot

    def release(self, slot: int) -> None:
        self.table.release(slot)
        self._caches[slot] = None  # its cache goes with it

    def length(self, slot: int) -> int:
        return self.table.lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        self.view(slot).truncate(length)

    def view(self, slot: int) -> HFDraftModel:
        self.table.check(slot)
        return self._caches[slot]

    def prune_head(self, rows: torch.Tensor) -> torch.Tensor:
        return _pruned_head(self.model.get_output_embeddings().weight, self._pruned, rows)

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor | None = None,
                head: torch.Tensor | None = None) -> torch.Tensor:
        """As `DraftNetwork.forward`; the rows of each slot run as one transformers forward."""
        from hetero_run.runtime.models.kv_cache import KVCacheFull

        ids = ids.reshape(-1).long()
        slot_list = slots.reshape(-1).tolist()
        if len(slot_list) != ids.numel() or not slot_list:
            raise ValueError(f"need n >= 1 rows with one slot each, got {ids.numel()} ids and {len(slot_list)} slots")
        _, spans = self.table.plan(slot_list, None if positions is None else positions.reshape(-1).tolist())
        for slot, (_, end) in spans.items():
            if end > self.table.max_tokens:
                raise KVCacheFull(f"drafter slot {slot} would reach {end} tokens but its KV cache holds "
                                  f"{self.table.max_tokens}", field="max_tokens")
        out: list[torch.Tensor | None] = [None] * len(slot_list)
        for slot, (first, _) in spans.items():
            rows = [r for r, s in enumerate(slot_list) if s == slot]
            cache = self._caches[slot]
            cache.truncate(first)
            for r, logits in zip(rows, cache.forward(ids[rows], head=head), strict=True):
                out[r] = logits
        return torch.stack(out)


class _SlotModel(HFDraftModel):
    """One slot's cache over the network's model; the slot's length follows it."""

    def __init__(self, network: HFDraftNetwork, slot: int):
        super().__init__(network.model, network._pruned)
        self.network, self.slot, self.generation = network, slot, network.table.generation[slot]

    def forward(self, ids, parents=None, head=None, last=False):
        self.network.table.check(self.slot, self.generation)
        logits = super().forward(ids, parents, head, last)
        self.network.table.lengths[self.slot] = self.length
        return logits

    def truncate(self, length: int) -> None:
        self.network.table.check(self.slot, self.generation)
        super().truncate(length)
        self.network.table.lengths[self.slot] = self.length
