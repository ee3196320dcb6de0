"""Suffix decoding (`suffix`, after SuffixDecoding, Oliaro et al. 2025): a small tree of the most
frequent continuations of the text's longest suffix that occurred before, in this request
(prompt and generation so far) or in earlier generations of this process.

Two objects, so that a server can share what earlier requests taught while each sequence
keeps its own state:

- `SuffixCache`: the earlier generations, shared by every request of the process, owned by
  one thread (the engine's; any other thread's call raises). Bounded: at most
  `max_generations` generations of at most `max_tokens` tokens each, the oldest evicted first.
- `SuffixState`: one request's prompt and generated tokens, and its lookups; `finish()` hands
  the generation to the cache.

Both answer the question a depth-capped suffix tree answers, "where did the last tokens occur
before, and what followed", from a `TokenIndex` (positions after every token and token pair):
the match length of each occurrence is extended backwards up to `max_depth`, the occurrences of
the longest match (in the request and the earlier generations together; the last token alone
when no pair recurs) form the tree's root, and their continuations are counted into a trie on
demand. Memory is O(tokens) rather than a suffix trie's O(tokens * depth) nodes, and eviction
drops one generation's index entries lazily. The speculation tree grows best-first by estimated
probability (the product of count ratios along the path), keeps only nodes above
`min_token_prob`, at most `max_depth` deep and at most ceil(`spec_factor` * match length +
`spec_offset`) nodes (a longer match earns a larger tree), as SuffixDecoding does.
Worked example: the last tokens "x y" occurred three times, followed by "z a", "z a", "z b":
root count 3, node z 3/3 = 1.0, z -> a 2/3, z -> b 1/3.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import OrderedDict

from hetero_run.runtime.speculative.lookup import TokenIndex, end_matches
from hetero_run.runtime.speculative.tree import SUFFIX, Candidates

POS_BITS = 32  # an index entry is generation id << POS_BITS | position
UNIGRAM_BUCKETS = 10  # calibration cells of trees grown from a one-token match: 10 + tenths of the estimate


class SuffixCache:
    """Earlier generations of this process, shared by all requests; thread-confined."""

    def __init__(self, max_generations: int = 256, max_tokens: int = 4096):
        if max_generations < 0 or max_tokens < 1:
            raise ValueError("max_generations must be >= 0 and max_tokens >= 1")
        self.max_generations, self.max_tokens = max_generations, max_tokens
        self.owner: int | None = None  # the first thread that uses it (an engine builds it, then its thread runs it)
        self.generations: OrderedDict[int, list[int]] = OrderedDict()
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.singles: dict[int, list[int]] = {}
        self.entries = 0  # index entries, live and evicted
        self.live = 0  # index entries of cached generations
        self.next_id = 0
        self.update_seconds = 0.0

    def _check_thread(self) -> None:
        if self.owner is None:
            self.owner = threading.get_ident()
        elif threading.get_ident() != self.owner:
            raise RuntimeError("SuffixCache belongs to the thread that first used it (the engine's); "
                               "give each other thread its own or call it from the owner")

    @property
    def tokens(self) -> int:
        return sum(len(g) for g in self.generations.values())

    def add(self, tokens: list[int]) -> None:
        """Cache one finished generation (its first max_tokens tokens); evict the oldest beyond
        max_generations."""
        self._check_thread()
        begin = time.perf_counter()
        if self.max_generations == 0 or len(tokens) < 2:
            return
        tokens = list(tokens[: self.max_tokens])
        gid = self.next_id
        self.next_id += 1
        self.generations[gid] = tokens
        for end in range(1, len(tokens) + 1):
            self.singles.setdefault(tokens[end - 1], []).append(gid << POS_BITS | end)
            if end >= 2:
                self.pairs.setdefault((tokens[end - 2], tokens[end - 1]), []).append(gid << POS_BITS | end)
        self.entries += 2 * len(tokens) - 1
        self.live += 2 * len(tokens) - 1
        while len(self.generations) > self.max_generations:
            _, old = self.generations.popitem(last=False)
            self.live -= 2 * len(old) - 1
        if self.entries > 2 * max(self.live, 1024):
            self._compact()
        self.update_seconds += time.perf_counter() - begin

    def clear(self) -> None:
        """Forget every cached generation."""
        self._check_thread()
        self.generations.clear()
        self.pairs.clear()
        self.singles.clear()
        self.entries = self.live = 0

    def _compact(self) -> None:
        """Drop the index entries of evicted generations."""
        alive = self.generations
        for index in (self.pairs, self.singles):
            for key in list(index):
                kept = [e for e in index[key] if (e >> POS_BITS) in alive]
                if kept:
                    index[key] = kept
                else:
                    del index[key]
        self.entries = self.live

    def matches(self, context: list[int], limit: int, scan: int, min_len: int = 2) -> list[tuple[list[int], int, int]]:
        """(generation tokens, position, match length) of the end of `context` in cached
        generations (`lookup.end_matches`)."""
        self._check_thread()
        generations, mask = self.generations, (1 << POS_BITS) - 1

        def locate(entry: int) -> tuple[list[int], int] | None:
            tokens = generations.get(entry >> POS_BITS)
            return None if tokens is None else (tokens, entry & mask)

        return end_matches(context, self.pairs, self.singles, locate, limit, scan, min_len)


def speculation_tree(occurrences: list[tuple[list[int], int]], max_nodes: int, max_depth: int,
                     min_prob: float) -> Candidates:
    """The best-first tree over the continuations of these occurrences (sequence, position)."""
    out = Candidates(SUFFIX)
    if not occurrences or max_nodes < 1:
        return out
    # continuation trie: node -> [count, children {token: node}]
    counts, children = [len(occurrences)], [{}]
    depth_cap = min(max_depth, max_nodes)
    for tokens, pos in occurrences:
        node = 0
        for token in tokens[pos:pos + depth_cap]:
            nxt = children[node].get(token)
            if nxt is None:
                nxt = len(counts)
                counts.append(0)
                children.append({})
                children[node][token] = nxt
            counts[nxt] += 1
            node = nxt
    heap = [(-counts[c] / counts[0], c, token, -1, 1) for token, c in children[0].items()]
    heapq.heapify(heap)
    while heap and len(out) < max_nodes:
        neg, node, token, parent, depth = heapq.heappop(heap)
        prob = -neg
        if prob < min_prob:
            break
        row = out.add(token, parent, 0.0, 0)
        out.probs[row] = prob  # cumulative for now; turned into conditional below
        if depth < max_depth:
            for t, c in children[node].items():
                heapq.heappush(heap, (-(prob * counts[c] / counts[node]), c, t, row, depth + 1))
    reach = out.probs  # cumulative so far: make each a conditional estimate and bucket it
    out.probs = [reach[i] / (reach[p] if p >= 0 else 1.0) for i, p in enumerate(out.parents)]
    out.buckets = [min(9, int(cond * 10)) for cond in out.probs]
    return out



class SuffixState:
    """One request's suffix-decoding state over its own prompt and generated tokens."""

    source = SUFFIX

    def __init__(self, cache: SuffixCache | None, prompt_ids: list[int], max_depth: int = 24,
                 spec_factor: float = 1.0, min_token_prob: float = 0.1, scan: int = 64, spec_offset: float = 0.0,
                 min_match: int = 1):
        self.cache = cache
        self.index = TokenIndex(prompt_ids, unigrams=min_match <= 1)
        self.prompt_len = len(prompt_ids)
        self.max_depth, self.spec_factor, self.min_prob, self.scan = max_depth, spec_factor, min_token_prob, scan
        self.spec_offset, self.min_match = spec_offset, min_match
        self.update_seconds = 0.0
        self.last_match = 0
        self.finished = False

    def extend(self, tokens: list[int]) -> None:
        begin = time.perf_counter()
        self.index.extend(tokens)
        self.update_seconds += time.perf_counter() - begin

    def propose(self, max_nodes: int) -> Candidates:
        context = self.index.tokens
        found = self.index.matches(context, self.max_depth, self.scan, self.min_match, exclude=len(context))
        if self.cache is not None:
            found += self.cache.matches(context, self.max_depth, self.scan, self.min_match)
        longest = max((n for _, _, n in found), default=0)
        self.last_match = longest if longest >= self.min_match else 0
        if not self.last_match:
            return Candidates(SUFFIX)
        # one tree over the longest match's occurrences, in this request and earlier generations alike
        cap = min(max_nodes, math.ceil(self.spec_factor * longest + self.spec_offset))
        tree = speculation_tree([(t, p) for t, p, n in found if n == longest], cap, self.max_depth, self.min_prob)
        if longest == 1:  # one matched token predicts less than a longer match of the same count estimate
            tree.buckets = [UNIGRAM_BUCKETS + b for b in tree.buckets]
        return tree

    def finish(self) -> None:
        """Hand this generation (not its prompt) to the shared cache, once."""
        if self.cache is not None and not self.finished:
            self.cache.add(self.index.tokens[self.prompt_len:])
        self.finished = True

