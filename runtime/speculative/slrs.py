"""`slrs`: string-level rejection sampling (after Timor et al. 2025, Algorithm 3), exact.

The drafter proposes target tokens through strings. At each target position, from the
drafter's current node z, a tree of drafter continuations is grown level by level (one
batched tree forward per level, `slrs_width` most probable nodes per level, at most
`slrs_depth` levels and `slrs_max_nodes` nodes): a node is kept only while its string is a
prefix of some target token's string. A node whose string *is* a target token's string is a
candidate. The proposal is a walk: draw drafter tokens from q along the tree until the draw
leaves it; the proposed target token is the last candidate passed, or none.

Because the tree depends on z alone, the proposal probability of every target token is
computable exactly:

    psi(t) = sum over candidate nodes n spelling t of  reach(n) * stay(n)
    reach(n) = product of q along the path to n (one term per drafter segmentation of t)
    stay(n)  = P(the walk from n passes no further candidate)
             = 1 - sum_{c child of n} q_n(c) + sum_{c non-candidate child} q_n(c) * stay(c)

psi is a sub-distribution: the rest, stay(root), is the walk proposing nothing. Verification
is standard rejection sampling with q = psi: accept t with probability min(1, p(t)/psi(t)),
else draw from norm(max(0, p - psi)); a position where the walk proposed nothing is drawn from
that same residual (RoundPlan row k), which is what keeps it lossless. Worked example: tree
"he" (q .5) -> "y" (q .4 under "he"), "hey" (q .3), with "he" and "hey" target tokens:
psi("hey") = .5 * .4 + .3 = .50, psi("he") = .5 * (1 - .4) = .30, nothing: .20.

The cap bounds the work; when the tree would grow past it the position proposes from the
smaller tree (still exact: psi is always the proposal actually drawn from) and the event is
counted in `counters["capped"]`; positions where the walk proposed nothing (the target's own
token then comes from the residual) are counted in `counters["unmatched"]`.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

import torch

from hetero_run.kernels.sampling import logits_to_probs, sample
from hetero_run.runtime.speculative.proposer import Proposer
from hetero_run.runtime.speculative.round import RoundPlan

TOPK_SCAN = 64  # drafter tokens examined per node when growing the tree


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)  # -1: child of the root
    text: list[bytes] = field(default_factory=list)  # string from the position's start
    reach: list[float] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q at the node [drafter vocab]
    target: list[int | None] = field(default_factory=list)  # candidate's target id
    leaf: list[bool] = field(default_factory=list)  # special token: nothing grows below
    children: dict[int, dict[int, int]] = field(default_factory=dict)  # node (-1 root) -> token -> node

    def add(self, token: int, parent: int, text: bytes, reach: float, target: int | None, leaf: bool) -> int:
        self.tokens.append(token)
        self.parent.append(parent)
        self.text.append(text)
        self.reach.append(reach)
        self.target.append(target)
        self.leaf.append(leaf)
        self.children.setdefault(parent, {})[token] = len(self.tokens) - 1
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """Drafter tokens from the root down to `node`."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parent[node]
        return out[::-1]


def proposal(tree: Tree, target_vocab: int) -> torch.Tensor:
    """psi: the exact probability that `walk` proposes each target id [target_vocab]; the
    missing mass is the walk proposing nothing."""
    stay = [1.0] * len(tree.tokens)
    for n in reversed(range(len(tree.tokens))):
        out = 1.0
        for token, child in tree.children.get(n, {}).items():
            q = float(tree.probs[n][token])
            out -= q if tree.target[child] is not None else q * (1.0 - stay[child])
        stay[n] = out
    psi = torch.zeros(target_vocab)
    for n, target in enumerate(tree.target):
        if target is not None:
            psi[target] += tree.reach[n] * stay[n]
    return psi


def walk(tree: Tree, root_probs: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """Draw the proposal: follow drafter draws down the tree; -> the last candidate passed."""
    node, probs, last = -1, root_probs, None
    while True:
        token = int(sample(probs[None], generator)[0])
        child = tree.children.get(node, {}).get(token)
        if child is None:
            return last
        node = child
        if tree.target[node] is not None:
            last = node
        if node not in tree.children:
            return last
        probs = tree.probs[node]


def keyed_walk(tree: Tree, psi: torch.Tensor, draw) -> int | None:
    """Keyed verification's proposal: the target id drawn from psi with the position's keyed
    noise (so it agrees with the target's draw as often as psi and p allow), reached through
    its likeliest node; None when psi is empty. The keyed verifier reads no q, so any rule that
    picks a node is exact; this one keeps the draft coupled to the target's noise."""
    if not float(psi.sum()) > 0:
        return None
    target = int(draw(psi))
    nodes = [n for n, t in enumerate(tree.target) if t == target]
    return max(nodes, key=lambda n: tree.reach[n]) if nodes else None


class SlrsProposer(Proposer):
    name = "slrs"

    def __init__(self, session, config):
        super().__init__(session, config)
        pairing = session.pairing
        self.by_bytes = pairing.target_by_bytes
        self.strings = pairing.target_strings
        self.pieces = pairing.drafter_table.pieces
        self.specials = {d: t for d, t in pairing.drafter_to_target_specials.items() if t < session.target_vocab}
        self.counters = {"positions": 0, "capped": 0, "unmatched": 0}

    def _is_prefix(self, text: bytes, longer: bool = False) -> bool:
        """Some target token string starts with `text` (and is longer, if `longer`)."""
        i = (bisect_right if longer else bisect_left)(self.strings, text)
        return i < len(self.strings) and self.strings[i].startswith(text)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.session.draft_sampling)  # [n, drafter vocab]

    def propose(self, k: int, start: int) -> RoundPlan:
        context = self.session.context
        if k == 0 or not context.draft_ready:
            return self.empty(start)
        root_probs = self._probs(context.catch_up()[None])[0]
        chain: list[int] = []  # the last position's path: re-run as the next tree's trunk
        drafts, rows, path_tokens = [], [], []
        keyed = self.session.keyed_seed is not None and self.session.generator is not None
        draw = self.session.drawer(start)
        for _ in range(k):
            tree = self._grow(root_probs, chain)
            psi = proposal(tree, self.session.target_vocab)
            node = keyed_walk(tree, psi, draw) if keyed else walk(tree, root_probs, self.session.generator)
            context.end_tree(chain)
            rows.append(psi)
            self.counters["positions"] += 1
            if node is None:
                self.counters["unmatched"] += 1
                break
            drafts.append(tree.target[node])
            chain = tree.path(node)
            path_tokens += chain
            root_probs = tree.probs[node]
            if tree.leaf[node]:
                rows.append(torch.zeros_like(psi))
                break
        else:
            rows.append(torch.zeros_like(rows[0]))  # every position proposed: the bonus comes from p
        return RoundPlan(torch.tensor(drafts, dtype=torch.long), torch.stack(rows), start, extras=path_tokens)

    def _grow(self, root_probs: torch.Tensor, chain: list[int]) -> Tree:
        """The position's tree, level by level; each level is one batched tree forward.

        The first forward also runs `chain` (the previous position's path) as the trunk the
        tree hangs from: model tree node numbers are offset by len(chain).
        """
        tree, config = Tree(), self.config
        offset = len(chain)
        level = self._children(tree, -1, root_probs, b"", 1.0, at_root=True)
        capped = False
        for depth in range(1, config.slrs_depth + 1):
            room = config.slrs_max_nodes - len(tree.tokens)
            if len(level) > room:
                capped, level = True, level[:room]
            if not level:
                break
            first = len(tree.tokens)
            for token, parent, text, reach, target, leaf in level:
                tree.add(token, parent, text, reach, target, leaf)
            trunk = list(range(-1, offset - 1)) if first == 0 else []
            parents = trunk + [offset + p if p >= 0 else offset - 1 for p in tree.parent[first:]]
            logits = self.session.context.tree((chain if first == 0 else []) + tree.tokens[first:], parents)
            tree.probs += list(self._probs(logits[len(trunk):]))
            if depth < config.slrs_depth:
                level = [c for n in range(first, len(tree.tokens)) if not tree.leaf[n]
                         for c in self._children(tree, n, tree.probs[n], tree.text[n], tree.reach[n])]
                level = sorted(level, key=lambda c: -c[3])[:config.slrs_width]
        self.counters["capped"] += capped
        return tree

    def _children(self, tree: Tree, node: int, probs: torch.Tensor, text: bytes, reach: float,
                  at_root: bool = False) -> list[tuple]:
        """Drafter tokens below `node` whose string stays a target-token prefix, most probable first."""
        if not at_root and not self._is_prefix(text, longer=True):
            return []
        values, tokens = torch.topk(probs, min(TOPK_SCAN, probs.numel()))
        out = []
        for q, token in zip(values.tolist(), tokens.tolist(), strict=True):
            if q <= 0 or len(out) == self.config.slrs_width:
                break
            piece = self.pieces[token]
            if piece is None:
                if at_root and token in self.specials:
                    out.append((token, node, b"", reach * q, self.specials[token], True))
                continue
            extended = text + piece
            if piece and self._is_prefix(extended):
                out.append((token, node, extended, reach * q, self.by_bytes.get(extended), False))
        return out

    def commit(self, plan: RoundPlan, emitted: list[int]) -> int:
        self._commit_text(plan.extras, emitted)
        return len(emitted) - 1
