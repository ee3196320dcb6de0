"""How a drafter's tokenizer relates to the target's, worked out once per engine.

Everything here is rank-0 only: tokenizers and drafters never leave the driver rank.
"""

from __future__ import annotations

import logging
from functools import cached_property

from hetero_run.runtime.speculative.retokenize import Retokenizer
from hetero_run.runtime.speculative.vocab import Intersection, TokenTable, same_vocabulary, special_map

log = logging.getLogger("hetero_run.runtime.speculative.pairing")

STOP_CONTENTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<eos>", "</s>")


class Pairing:
    def __init__(self, target_tokenizer, drafter_tokenizer=None, window: int = 8):
        self.target_tokenizer = target_tokenizer
        self.target_table = TokenTable.from_tokenizer(target_tokenizer)
        self.target_retokenizer = Retokenizer(target_tokenizer, self.target_table, window)
        self.drafter_tokenizer = drafter_tokenizer
        self.drafter_table = self.drafter_retokenizer = None
        self.same_vocab = False
        if drafter_tokenizer is not None:
            self.drafter_table = TokenTable.from_tokenizer(drafter_tokenizer)
            self.drafter_retokenizer = Retokenizer(drafter_tokenizer, self.drafter_table, window)
            self.same_vocab = same_vocabulary(self.target_table, self.drafter_table)
            log.info("drafter vocabulary: %s (%d tokens; target %d)",
                     "same as the target's" if self.same_vocab else "different from the target's",
                     len(self.drafter_table.vocab), len(self.target_table.vocab))

    @cached_property
    def intersection(self) -> Intersection:
        shared = Intersection.build(self.drafter_table, self.target_table)
        log.info("TLI: %d shared tokens (%.1f%% of the drafter's vocabulary)", len(shared),
                 100 * len(shared) / max(1, len(self.drafter_table.vocab)))
        return shared

    @cached_property
    def target_by_bytes(self) -> dict[bytes, int]:
        """Target token strings -> id (the lowest id when several spell the same bytes)."""
        out: dict[bytes, int] = {}
        for i, piece in enumerate(self.target_table.pieces):
            if piece:
                out.setdefault(piece, i)
        return out

    @cached_property
    def target_strings(self) -> list[bytes]:
        """Every target token string, sorted: prefix queries by bisection."""
        return sorted(self.target_by_bytes)

    @cached_property
    def drafter_to_target_specials(self) -> dict[int, int]:
        return special_map(self.drafter_table, self.target_table)

    def stop_ids(self) -> set[int]:
        """Target tokens that end a generation: the tokenizer's EOS and the usual end-of-turn tokens."""
        ids = {self.target_table.specials[c] for c in STOP_CONTENTS if c in self.target_table.specials}
        eos = getattr(self.target_tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(eos)
        return ids
