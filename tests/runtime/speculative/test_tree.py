"""Draft trees: merging proposers' candidates as a trie, reach estimates, chains out of trees."""

from __future__ import annotations

from hetero_run.runtime.speculative.cost import reach_order
from hetero_run.runtime.speculative.tree import MODEL, NGRAM, SUFFIX, Candidates, DraftTree


def chain(source: int, tokens: list[int], prob: float = 0.5) -> Candidates:
    out, parent = Candidates(source), -1
    for t in tokens:
        parent = out.add(t, parent, prob)
    return out


def test_the_docstring_example_merges_agreeing_paths():
    tree = DraftTree()
    tree.add_model_chain([10, 11, 12], 0.5)  # a b c
    tree.add_candidates(chain(NGRAM, [10, 11, 13]))  # a b d
    tree.add_candidates(chain(SUFFIX, [14]))  # e
    assert tree.tokens[1:] == [10, 11, 12, 13, 14]
    assert tree.parents == [-1, 0, 1, 2, 2, 0]
    assert tree.depth == [0, 1, 2, 3, 3, 1]
    assert tree.model_rows == [0, 1, 2, 3]
    assert tree.sources[1] == MODEL | NGRAM and tree.sources[3] == MODEL and tree.sources[5] == SUFFIX
    assert tree.reach[1] == 1 - 0.5 * 0.5  # the model and a copy agreeing: either being right is enough
    assert not tree.is_chain


def test_model_free_proposers_agreeing_keep_the_likelier_estimate():
    tree = DraftTree()
    tree.add_candidates(chain(NGRAM, [10, 11], 0.6))
    tree.add_candidates(chain(SUFFIX, [10, 12], 0.5))
    assert tree.sources[1] == NGRAM | SUFFIX
    assert tree.reach[1] == 0.6  # both copy the same earlier text: not two pieces of evidence
    assert tree.reach[2] == 0.6 * 0.6 and tree.reach[3] == 0.6 * 0.5  # children hang from the merged row


def test_best_chain_follows_the_most_expected_tokens():
    tree = DraftTree()
    tree.add_candidates(chain(NGRAM, [1, 2, 3], 0.9))
    tree.add_candidates(chain(SUFFIX, [4, 5], 0.95))
    assert [tree.tokens[r] for r in tree.best_chain()] == [1, 2, 3]  # .9 + .81 + .73 > .95 + .90
    small = tree.restricted(tree.best_chain())
    assert small.is_chain and small.tokens[1:] == [1, 2, 3]


def test_restricted_and_graft_keep_parents_and_cells():
    tree = DraftTree()
    tree.add_model_chain([1, 2], 0.7)
    found = Candidates(SUFFIX)
    root = found.add(5, -1, 0.6, bucket=6)
    found.add(6, root, 0.5, bucket=5)
    other = DraftTree()
    other.add_candidates(found)
    tree.graft(other, [1, 2])
    assert tree.tokens[1:] == [1, 2, 5, 6] and tree.parents == [-1, 0, 1, 0, 3]
    assert tree.cells[3] == [(SUFFIX, 6)] and tree.cells[4] == [(SUFFIX, 5)]
    assert abs(tree.reach[4] - 0.3) < 1e-9
    cut = tree.restricted([1, 3, 4])
    assert cut.tokens[1:] == [1, 5, 6] and cut.parents == [-1, 0, 0, 2] and cut.model_rows == [0, 1]


def test_agreeing_proposers_never_make_a_row_likelier_than_its_parent():
    """Two proposers agreeing on a whole chain raise both rows' reach; the child must not pass its
    parent, or a prefix of the reach order would keep a row without its parent."""
    copies = DraftTree()  # the two model-free proposers: the likelier estimate, the child capped too
    copies.add_candidates(chain(NGRAM, [7, 8], 0.5))
    copies.add_candidates(Candidates(SUFFIX, [7, 8], [-1, 0], [0.4, 1.0], [5, 9]))
    assert copies.reach[2] <= copies.reach[1] == 0.5
    tree = DraftTree()
    tree.add_model_chain([7, 8], 0.5)
    tree.add_candidates(Candidates(SUFFIX, [7, 8], [-1, 0], [0.5, 1.0], [5, 9]))
    assert tree.reach[2] <= tree.reach[1] == 1 - 0.5 * 0.5
    order = reach_order(tree)
    assert order == [1, 2]
    for m in range(len(order) + 1):  # every prefix grafts: each kept row's parent is kept
        other = DraftTree()
        other.graft(tree, order[:m])
        assert other.tokens[1:] == [7, 8][:m]
