"""Who holds which embedding rows: the balancing rule, the memory reports it reads, the loader's
checks, and that an uneven split changes nothing a forward computes (TP=2 runs: test_tensor_parallel.py)."""

import pytest
import torch
from tiny_models import tiny_checkpoint

from hetero_run.runtime.checkpoint import Checkpoint, CheckpointError
from hetero_run.runtime.models.balance import RankMemory, balanced_rows, committed
from hetero_run.runtime.models.embedding import VocabParallelEmbedding
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.topology.errors import ConfigError

MiB = 1 << 20


def _levels(rows, used, row_bytes):
    return [u + r * row_bytes for u, r in zip(used, rows, strict=True)]


def test_equal_ranks_split_evenly():
    assert balanced_rows(151936, 1792, [500 * MiB, 500 * MiB]) == [75968, 75968]


def test_the_fuller_rank_holds_fewer_rows_until_the_ranks_are_level():
    row = 1792  # Qwen2.5-0.5B in bf16
    used = [408 * MiB, 277 * MiB]  # rank 0 also holds the tokenizer
    rows = balanced_rows(151936, row, used)
    assert sum(rows) == 151936 and rows[0] < rows[1]
    assert all(r % 64 == 0 for r in rows[:1])
    levels = _levels(rows, used, row)
    assert abs(levels[0] - levels[1]) <= 64 * row  # level to within one quantum of rows


def test_a_rank_fuller_than_the_embedding_can_make_up_gets_no_rows():
    used = [900 * MiB, 100 * MiB, 100 * MiB]  # rank 0's drafter outweighs the whole embedding
    rows = balanced_rows(1000, 1024, used)
    assert rows[0] == 0 and sum(rows) == 1000 and abs(rows[1] - rows[2]) <= 64


def test_leftover_rows_go_where_they_are_most_short():
    rows = balanced_rows(130, 1, [0, 0, 0])  # 130 rows, quanta of 64: two ranks get one quantum each
    assert sum(rows) == 130 and sorted(rows) == [2, 64, 64]


def test_one_rank_holds_everything():
    assert balanced_rows(320, 256, [123]) == [320]


def test_ranks_on_one_node_are_compared_by_what_they_hold():
    # rank 1 reported the node's available memory before rank 0 loaded its tokenizer: the lower
    # (later) report is the one that counts, so only the resident difference separates them
    reports = [RankMemory("a", 400 * MiB, 10_000 * MiB, 0), RankMemory("a", 280 * MiB, 10_120 * MiB, 0)]
    used = committed(reports)
    assert used[0] - used[1] == 120 * MiB


def test_ranks_on_two_nodes_are_compared_by_what_each_node_has_left():
    # the same resident memory, but node b has 2 GiB less available: its rank counts as fuller
    reports = [RankMemory("a", 300 * MiB, 8192 * MiB, 50 * MiB), RankMemory("b", 300 * MiB, 6144 * MiB, 0)]
    used = committed(reports)
    assert used[1] - used[0] == 2048 * MiB - 50 * MiB


def _ctx(rank: int, size: int) -> ParallelContext:
    return ParallelContext(group=object() if size > 1 else None, rank=rank, size=size)  # no collective runs


@pytest.mark.parametrize("rows", [[80, 240], [0, 320], [320, 0]])
def test_each_rank_loads_exactly_its_rows(rows):
    path = tiny_checkpoint("llama", "bf16")
    full = Checkpoint.open(path).read("model.embed_tokens.weight")
    first = 0
    for rank in range(2):
        model = load_model(path, _ctx(rank, 2), max_tokens=16, embedding_split=rows)
        embed = model.embed
        assert (embed.first, embed.rows) == (first, rows[rank])
        assert torch.equal(embed.weight, full[first:first + rows[rank]].to(embed.weight.dtype))
        first += rows[rank]


def test_a_rank_without_rows_adds_zeros():
    ctx = ParallelContext(group=object(), rank=1, size=2)
    sums = []
    object.__setattr__(ctx, "all_reduce", lambda x: sums.append(x.clone()) or x)  # record instead of summing
    out = VocabParallelEmbedding(torch.empty(0, 8), ctx, first=320)(torch.tensor([1, 5, 7]))
    assert out.shape == (3, 8) and not out.any() and len(sums) == 1


@pytest.mark.parametrize("rows, message", [
    ([100, 100], "2 non-negative row counts summing to vocab_size 320"),
    ([400, -80], "non-negative row counts"),
    ([320], "needs 2 non-negative row counts"),
])
def test_bad_row_counts_name_the_setting(rows, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_model(tiny_checkpoint("llama", "bf16"), _ctx(0, 2), max_tokens=16, embedding_split=rows)
    assert err.value.field == "embedding_split"


def test_a_tied_head_keeps_the_even_split():
    path = tiny_checkpoint("qwen2", "bf16", tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="tied lm_head shares the embedding"):
        load_model(path, _ctx(0, 2), max_tokens=16, embedding_split=[80, 240])
    assert load_model(path, _ctx(0, 2), max_tokens=16, embedding_split=[160, 160]).embed.rows == 160


def test_unknown_split_names_are_refused():
    with pytest.raises(ConfigError, match="expected even or balanced or row counts, got 'lopsided'"):
        load_model(tiny_checkpoint("llama", "bf16"), _ctx(0, 2), max_tokens=16, embedding_split="lopsided")


def test_checkpoint_reads_a_row_range_and_refuses_one_outside_the_tensor():
    ckpt = Checkpoint.open(tiny_checkpoint("llama", "bf16"))
    full = ckpt.read("model.embed_tokens.weight")
    assert torch.equal(ckpt.read("model.embed_tokens.weight", dim=0, span=(10, 74)), full[10:74])
    with pytest.raises(CheckpointError, match="dimension 0 has size 320, no range 300..400"):
        ckpt.read("model.embed_tokens.weight", dim=0, span=(300, 400))
