"""The drafter's view of the conversation, kept in step with the target's accepted text.

The drafter reads the conversation through its own chat template and its own tokens. After
every round the accepted text (target tokens, as bytes) is appended in drafter tokens: the
drafter's own draft tokens that spell a prefix of it are kept as they are (they are already
in its KV cache), the rest is re-tokenised with the look-behind window (`Retokenizer.extend`),
which may rewrite the last few drafter tokens when the new text merges with them. An
unfinished UTF-8 character waits in `pending` until the rest of it is accepted.

The KV cache is never re-filled: `cached` mirrors the tokens in the drafter's cache, and a
forward first rolls the cache back to where `cached` and `ids` diverge, then runs only the
tokens after that point.
"""

from __future__ import annotations

import time

import torch

from hetero_run.runtime.drafters.model import DraftModel
from hetero_run.runtime.drafters.threads import drafter_threads
from hetero_run.runtime.speculative.retokenize import Retokenizer, utf8_complete


class DraftContext:
    def __init__(self, model: DraftModel, retokenizer: Retokenizer, prompt_ids: list[int], same_vocab: bool = False,
                 threads: int | None = None):
        self.model = model
        self.threads = threads  # torch threads while the drafter runs (None: leave as is)
        self.retokenizer = retokenizer
        self.pieces = retokenizer.table.pieces
        self.same_vocab = same_vocab
        self.ids: list[int] = list(prompt_ids)  # the conversation in drafter tokens
        self.cached: list[int] = []  # the tokens in the drafter's KV cache, in order
        self.pending = b""  # accepted bytes not in `ids` yet (an unfinished character)
        self._valid = 0  # cached[:_valid] == ids[:_valid] is known
        self.last_catch_up = (0, 0.0)  # (tokens, seconds) of the latest catch-up forward
        model.truncate(0)

    @property
    def pending_tokens(self) -> int:
        """Tokens of the conversation the drafter's cache does not hold yet (about what the next
        draft's catch-up runs)."""
        return max(1, len(self.ids) - self._valid)

    @property
    def draft_ready(self) -> bool:
        """False while a character is unfinished: token-level drafts would start mid-character."""
        return not self.pending

    def _sync(self) -> int:
        """Roll the cache back to the common prefix of `cached` and `ids`; -> its length."""
        n = min(self._valid, len(self.cached), len(self.ids))
        limit = min(len(self.cached), len(self.ids))
        while n < limit and self.cached[n] == self.ids[n]:
            n += 1
        if n < len(self.cached):
            self.model.truncate(n)
            del self.cached[n:]
        self._valid = n
        return n

    def catch_up(self, head: torch.Tensor | None = None) -> torch.Tensor:
        """Run the tokens of `ids` the cache lacks -> logits [vocab] after the last one."""
        n = self._sync()
        if n == len(self.ids):  # everything cached: the last token's logits are needed again
            n -= 1
            self.model.truncate(n)
            del self.cached[n:]
        new = self.ids[n:]
        begin = time.perf_counter()
        with drafter_threads(self.threads):
            logits = self.model.forward(torch.tensor(new, dtype=torch.long), head=head, last=True)[-1]
        self.last_catch_up = (len(new), time.perf_counter() - begin)
        self.cached += new
        self._valid = len(self.cached)
        return logits

    def step(self, token: int, head: torch.Tensor | None = None) -> torch.Tensor:
        """Run one drafted token (cached, not part of `ids`) -> logits [vocab] after it."""
        with drafter_threads(self.threads):
            logits = self.model.forward(torch.tensor([token], dtype=torch.long), head=head)[-1]
        self.cached.append(token)
        return logits

    def draft(self, k: int, choose, head: torch.Tensor | None = None) -> tuple[list[int], list]:
        """k chained drafter steps from the end of `ids`. `choose(logits [vocab])` returns
        (token: 0-d tensor, anything to keep); the tokens stay on the device until the one host
        sync at the end -> (tokens, kept things). Drafted tokens are cached, not part of `ids`."""
        logits = self.catch_up(head)
        tokens, kept = [], []
        with drafter_threads(self.threads):
            for i in range(k):
                token, extra = choose(logits)
                tokens.append(token)
                kept.append(extra)
                if i + 1 < k:
                    logits = self.model.forward(token.view(1), head=head)[-1]
        ids = torch.stack(tokens).tolist() if tokens else []
        self.cached += ids[:-1]
        return ids, kept

    def tree(self, ids: list[int], parents: list[int]) -> torch.Tensor:
        """Tree nodes after the cache (see `drafters.model`) -> logits [n, vocab]."""
        with drafter_threads(self.threads):
            return self.model.forward(torch.tensor(ids, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def end_tree(self, chain: list[int]) -> None:
        """Close the tree, keeping its leading `chain` of nodes in the cache (those that ran)."""
        base = len(self.cached)
        kept = chain[: max(0, self.model.length - base)]
        self.model.truncate(base + len(kept))
        self.cached += kept

    def commit_ids(self, token_ids: list[int]) -> None:
        """Same vocabulary: the accepted target tokens are drafter tokens."""
        self.ids += token_ids

    def commit_text(self, drafts: list[int], text: bytes) -> None:
        """The round accepted `text`; `drafts` are this round's drafter tokens, in order."""
        data = self.pending + text
        used = kept = 0
        for token in drafts:
            piece = self.pieces[token]
            if not piece or not data.startswith(piece, used):
                break
            used += len(piece)
            kept += 1
        self.ids += drafts[:kept]
        rest = data[used:]
        complete = utf8_complete(rest)
        self.pending = rest[complete:]
        if complete:
            keep, new = self.retokenizer.extend(self.ids, rest[:complete], rewrite=True)
            if not new:  # text this vocabulary cannot spell: let its tokenizer do what it can
                keep, new = len(self.ids), self.retokenizer.encode(rest[:complete].decode("utf-8", "replace"))
            del self.ids[keep:]
            self._valid = min(self._valid, keep)
            self.ids += new

