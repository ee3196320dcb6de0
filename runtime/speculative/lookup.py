"""Prompt lookup (`ngram`): draft the tokens that followed the longest earlier occurrence of the
text's last n tokens, prompt_lookup_min <= n <= prompt_lookup_max (the names vLLM uses).

The sequence is the prompt and every token generated so far, in the target's vocabulary, so
no drafter is involved: an answer that quotes its input (edit this code, summarise this text,
answer from this passage) finds the quoted span and proposes its continuation. `TokenIndex`
keeps the position of every token and token pair as the sequence grows (O(1) per token), so
a lookup examines only the earlier occurrences of the last one or two tokens (most recent
first, at most `scan`), extends each match backwards up to the longest length wanted, and
keeps the longest (the most recent of equals). Worked example, prompt_lookup_min 2:

    tokens   a b c d x a b c          last 3 tokens "a b c" occurred at 0..2
    lookup   -> match length 3, proposes "d x a ..." (what followed it)
"""

from __future__ import annotations

from hetero_run.runtime.speculative.tree import NGRAM, Candidates


class TokenIndex:
    """A growing token list with the positions after each token and token pair: position i is
    listed under (tokens[i - 2], tokens[i - 1]) and under tokens[i - 1]."""

    def __init__(self, tokens=(), unigrams: bool = True):
        self.tokens: list[int] = []
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.singles: dict[int, list[int]] | None = {} if unigrams else None
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new) -> None:
        tokens, pairs, singles = self.tokens, self.pairs, self.singles
        for token in new:
            tokens.append(token)
            end = len(tokens)
            if singles is not None:
                singles.setdefault(token, []).append(end)
            if end >= 2:
                pairs.setdefault((tokens[-2], token), []).append(end)

    def matches(self, context: list[int], limit: int, scan: int, min_len: int = 2,
                exclude: int | None = None) -> list[tuple[list[int], int, int]]:
        """(self.tokens, position, match length) of earlier occurrences of the end of `context`
        (`end_matches`); positions equal to `exclude` are skipped."""
        tokens = self.tokens
        return end_matches(context, self.pairs, self.singles, lambda pos: None if pos == exclude else (tokens, pos),
                           limit, scan, min_len)


def end_matches(context: list[int], pairs: dict, singles: dict | None, locate, limit: int, scan: int,
                min_len: int) -> list[tuple[list[int], int, int]]:
    """(tokens, position, match length) of earlier occurrences of the end of `context`, most
    recent first, at most `scan`: those of its last two tokens (`pairs`), each extended backwards
    up to `limit` tokens; where there is none and min_len is 1, those of its last token
    (`singles`, length 1). `locate` turns an index entry into (tokens, position), or None to
    skip it (the prompt lookup's own position, an evicted generation)."""
    out = []
    if len(context) >= 2:
        for entry in reversed(pairs.get((context[-2], context[-1]), ())):
            found = locate(entry)
            if found is not None:
                tokens, pos = found
                out.append((tokens, pos, match_length(tokens, pos, context, limit)))
                if len(out) >= scan:
                    return out
    if not out and min_len <= 1 and singles is not None and context:
        for entry in reversed(singles.get(context[-1], ())):
            found = locate(entry)
            if found is not None:
                out.append((*found, 1))
                if len(out) >= scan:
                    break
    return out


def match_length(tokens: list[int], pos: int, context: list[int], limit: int) -> int:
    """How many tokens before `pos` in `tokens` equal the last tokens of `context` (at most `limit`)."""
    n = 0
    while n < limit and n < pos and n < len(context) and tokens[pos - 1 - n] == context[-1 - n]:
        n += 1
    return n


class PromptLookup:
    """One sequence's prompt-lookup state: the index over its prompt and generated tokens."""

    source = NGRAM

    def __init__(self, prompt_ids: list[int], min_len: int, max_len: int, scan: int = 32):
        self.index = TokenIndex(prompt_ids, unigrams=min_len <= 1)
        self.min_len, self.max_len, self.scan = min_len, max_len, scan
        self.last_match = 0

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def propose(self, k: int) -> Candidates:
        """Up to k tokens after the longest match; bucket = the match length."""
        out = Candidates(NGRAM)
        tokens = self.index.tokens
        best_pos, best_len = -1, 0
        for _, pos, length in self.index.matches(tokens, self.max_len, self.scan, self.min_len, exclude=len(tokens)):
            if length > best_len:
                best_pos, best_len = pos, length
                if length >= self.max_len:
                    break
        self.last_match = best_len
        if best_len < self.min_len or k <= 0:
            return out
        parent = -1
        for token in tokens[best_pos:best_pos + k]:
            parent = out.add(token, parent, 1.0, best_len)
        return out
