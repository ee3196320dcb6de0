"""A round's draft tree: the rows one target forward verifies, from every proposer of the round.

Row 0 is the last committed token; every other row is a draft token whose parent row comes
before it, so the rows of a chain are simply 0 -> 1 -> 2 ... Candidates from several proposers
(the model drafter's chain, prompt lookup, the suffix tree) are merged as a trie: two
candidates that agree on a path share its rows, so every row is one distinct path. Worked
example, model chain [a, b, c], lookup chain [a, b, d], suffix branch [e]:

    row      0  1  2  3  4  5          parents -1  0  1  2  2  0
    token    .  a  b  c  d  e          depth    0  1  2  3  3  1

The model drafter's chain always comes first (rows 1..c), so its q rows line up with rows
0..c as in a chain round. `reach[r]` is the estimated probability that the verifier gets to
row r (the product of the conditional acceptance estimates along its path): what pruning and
the cost model read. Where the model drafter and a model-free proposer agree on a row, either
being right is enough (1 - (1 - p)(1 - q)); where the two model-free proposers agree, they mostly
copy the same earlier text, and the likelier estimate stands (max(p, q)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL, NGRAM, SUFFIX = 1, 2, 4  # which proposers put a row there (bits)
SOURCE_NAMES = {MODEL: "model", NGRAM: "ngram", SUFFIX: "suffix"}


@dataclass
class Candidates:
    """A model-free proposer's small tree below the committed text: node i has token tokens[i],
    parent parents[i] (-1: the root) and conditional acceptance estimate probs[i];
    `buckets[i]` says which calibration cell measures that estimate."""

    source: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, prob: float, bucket: int = 0) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.probs.append(prob)
        self.buckets.append(bucket)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)


class DraftTree:
    def __init__(self):
        self.tokens: list[int] = [-1]  # row 0: the last committed token (its id lives with the driver)
        self.parents: list[int] = [-1]
        self.depth: list[int] = [0]
        self.reach: list[float] = [1.0]
        self.sources: list[int] = [0]
        self.cells: list[list[tuple[int, int]]] = [[]]  # (source, bucket) measured at this row
        self.children: list[dict[int, int]] = [{}]
        self.model_rows: list[int] = [0]  # row of the model chain's node j (j = 0: the root)

    def __len__(self) -> int:
        """Rows, row 0 included."""
        return len(self.tokens)

    @property
    def nodes(self) -> int:
        return len(self.tokens) - 1

    def _row(self, parent: int, token: int, source: int, cond: float, cell: tuple[int, int] | None) -> int:
        row = self.children[parent].get(token)
        if row is None:
            row = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.reach.append(self.reach[parent] * cond)
            self.sources.append(source)
            self.cells.append([])
            self.children.append({})
            self.children[parent][token] = row
        else:  # two proposers agree
            mine = self.reach[parent] * cond
            if (self.sources[row] | source) & MODEL:  # a model's guess and a copy: either one being right is enough
                either = 1.0 - (1.0 - self.reach[row]) * (1.0 - mine) if mine < 1.0 else mine
            else:
                # prompt lookup and the suffix tree agreeing mostly copy the same earlier text: no
                # second piece of evidence, so the likelier estimate stands (counted as independent,
                # `auto` priced the merged trees of a Zen 5 host above what they yielded: grounded
                # greedy 1.32x against 1.42x, docs/algorithms.md)
                either = max(self.reach[row], mine)
            self.sources[row] |= source
            # the verifier gets to a row only through its parent: never likelier than the parent,
            # so ordering rows by reach keeps every parent before its children (cost.reach_order)
            self.reach[row] = min(either, self.reach[parent])
        if cell is not None:
            self.cells[row].append(cell)
        return row

    def add_model_chain(self, tokens: list[int], cond: float) -> None:
        """The model drafter's chain (first, before any other candidate)."""
        if self.nodes:
            raise ValueError("the model chain goes into an empty tree")
        row = 0
        for token in tokens:
            row = self._row(row, token, MODEL, cond, (MODEL, 0))
            self.model_rows.append(row)

    def add_candidates(self, cands: Candidates, under: int = 0, keep: set[int] | None = None) -> None:
        """Merge a model-free tree below row `under` (only its nodes in `keep`, when given: a
        subtree, parents included)."""
        rows: dict[int, int] = {}
        for i, (token, parent, prob, bucket) in enumerate(zip(cands.tokens, cands.parents, cands.probs,
                                                               cands.buckets, strict=True)):
            if keep is not None and i not in keep:
                continue
            base = under if parent < 0 else rows[parent]
            rows[i] = self._row(base, token, cands.source, prob, (cands.source, bucket))

    def graft(self, other: DraftTree, rows: list[int]) -> None:
        """Merge these rows of another tree (each with its parent, or the root) into this one."""
        mapped = {0: 0}
        for row in sorted(rows):
            parent = mapped[other.parents[row]]
            cond = other.reach[row] / max(other.reach[other.parents[row]], 1e-12)
            new = self._row(parent, other.tokens[row], other.sources[row], cond, None)
            self.cells[new].extend(other.cells[row])
            mapped[row] = new

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def draft_tokens(self) -> list[int]:
        return self.tokens[1:]

    def path(self, row: int) -> list[int]:
        """Rows from the root's first child down to `row`."""
        out = []
        while row > 0:
            out.append(row)
            row = self.parents[row]
        return out[::-1]

    def best_chain(self) -> list[int]:
        """The path with the most expected accepted tokens (sum of reach along it): what a
        target without tree forwards verifies."""
        best, value = [0], [0.0] * len(self)
        leaf, leaf_value = 0, 0.0
        for row in range(1, len(self)):
            value[row] = value[self.parents[row]] + self.reach[row]
            if value[row] > leaf_value:
                leaf, leaf_value = row, value[row]
        best = self.path(leaf)
        return best

    def restricted(self, rows: list[int]) -> DraftTree:
        """The tree of these rows only (each row's parent included or 0), renumbered in order."""
        out, new = DraftTree(), {0: 0}
        keep = sorted(set(rows) - {0})
        for row in keep:
            parent = new[self.parents[row]]
            r = len(out.tokens)
            out.tokens.append(self.tokens[row])
            out.parents.append(parent)
            out.depth.append(out.depth[parent] + 1)
            out.reach.append(self.reach[row])
            out.sources.append(self.sources[row])
            out.cells.append(list(self.cells[row]))
            out.children.append({})
            out.children[parent][self.tokens[row]] = r
            new[row] = r
        out.model_rows = [new[r] for r in self.model_rows if r in new]
        return out
