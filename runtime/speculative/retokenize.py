"""Incremental re-tokenisation: the tokens that continue a known token sequence with new text.

Tokenizers are not injective and fragments tokenise differently than in context, so new text
is never tokenised alone. A look-behind window of the last few known tokens is decoded, the
new bytes are appended, the whole is tokenised again and aligned byte by byte with the known
tokens; only what follows the alignment point is new. Worked example (byte-level BPE):

    known  [..., "Ġhel"]    new b"lo world"
    window "Ġhel" + "lo world" -> ["Ġhello", "Ġworld"]: "Ġhello" straddles the boundary
    rewrite allowed (drafter): drop "Ġhel", append ["Ġhello", "Ġworld"]
    rewrite not allowed (target: its tokens are committed): spell "lo" alone -> ["lo", "Ġworld"]

A re-encoded window may start with an inserted BOS (encoding adds no special tokens here) or a
dummy-prefix space (SentencePiece normalisers): the bytes are aligned from the end, so such a
prefix is skipped. Text that ends inside a UTF-8 character is never tokenised: callers keep
the incomplete tail back (`utf8_complete`) until the rest arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from hetero_run.runtime.speculative.vocab import TokenTable


def utf8_complete(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 character.

    Invalid bytes in the middle count as complete (they never will be); only a valid but
    unfinished multi-byte sequence at the very end is held back.
    """
    end = len(data)
    for back in range(1, min(4, end) + 1):
        byte = data[end - back]
        if byte < 0x80:
            return end
        if byte >= 0xC0:  # lead byte: how long its character is (0xF5 and up never lead)
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4 if byte < 0xF5 else 0
            return end - back if need > back else end
    return end


def _continues_a_character(piece: bytes | None) -> bool:
    return bool(piece) and piece[0] & 0xC0 == 0x80


class Retokenizer:
    """Continues token sequences of one tokenizer with new bytes (see the module docstring)."""

    def __init__(self, tokenizer, table: TokenTable, window: int = 8):
        self.backend = tokenizer.backend_tokenizer
        self.table = table
        self.window = window

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the special tokens a tokenizer would add around it."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def bare(self, data: bytes) -> list[int] | None:
        """Tokens spelling exactly `data` with no context, or None if they cannot.

        Bytes that are not text on their own (the tail of a split character) become one-byte
        tokens where the vocabulary has them (byte-level BPE, byte fallback).
        """
        ids: list[int] = []
        while data:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                if e.start > 0:
                    head = self.bare(data[: e.start])
                    if head is None:
                        return None
                    ids += head
                    data = data[e.start:]
                    continue
                byte_id = self.table.byte_ids.get(data[0])
                if byte_id is None:
                    return None
                ids.append(byte_id)
                data = data[1:]
                continue
            enc = self.encode(text)
            if self.table.decode(enc) != data:
                return None
            return ids + enc
        return ids

    def extend(self, context: Sequence[int], new: bytes, rewrite: bool) -> tuple[int, list[int]]:
        """Tokens continuing `context` with `new` -> (keep, ids): context[:keep] + ids spells
        context's bytes + new. keep == len(context) unless `rewrite` allowed merging across the
        boundary. Returns (len(context), []) when no consistent tokenisation is found.
        """
        if not new:
            return len(context), []
        pieces = self.table.pieces
        start = len(context)
        while start > 0 and len(context) - start < self.window and pieces[context[start - 1]] is not None:
            start -= 1
        while start < len(context) and _continues_a_character(pieces[context[start]]):
            start += 1  # the window must begin at a character boundary to be decodable
        head = self.table.decode(context[start:])
        data = head + new
        try:
            enc = self.encode(data.decode("utf-8"))
        except UnicodeDecodeError:
            return self._without_window(context, new)
        spelled = [pieces[i] if pieces[i] is not None else b"" for i in enc]
        total = b"".join(spelled)
        offset = len(total) - len(data)
        if offset < 0 or total[offset:] != data:
            return self._without_window(context, new)
        ends = [e - offset for e in accumulate(len(p) for p in spelled)]  # byte end of each token in data
        first = next(j for j, e in enumerate(ends) if e > len(head))  # first token holding new bytes
        begin = ends[first - 1] if first > 0 else -offset
        if begin == len(head):
            return len(context), enc[first:]
        if rewrite:
            known = {e: start + j + 1 for j, e in enumerate(accumulate(len(pieces[i]) for i in context[start:]))}
            known[0] = start
            shared = [(e, j + 1) for j, e in enumerate(ends[:first]) if e in known and e <= begin]
            if offset == 0:
                shared.append((0, 0))
            if shared:
                boundary, j = max(shared)
                return known[boundary], enc[j:]
        tail = self.bare(data[len(head): ends[first]])
        if tail is None:
            return len(context), []
        return len(context), tail + enc[first + 1:]

    def _without_window(self, context: Sequence[int], new: bytes) -> tuple[int, list[int]]:
        ids = self.bare(new)
        return len(context), ids or []
