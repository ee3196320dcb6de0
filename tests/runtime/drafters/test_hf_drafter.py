"""The generic transformers drafter: chains, trees over several forwards, rollback, pruned head."""

from __future__ import annotations

import pytest
import speculative_support as support
import torch

from hetero_run.runtime.drafters.hf import HFDraftModel, cache_argument
from hetero_run.runtime.drafters.load import load_drafter
from hetero_run.runtime.drafters.model import leading_chain
from hetero_run.topology.errors import UserError

PREFIX = [1, 5, 9, 20, 33]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return support.tiny_model(support.sentencepiece(), request.param, seed=3)


def chain_logits(model, tokens: list[int]) -> torch.Tensor:
    return HFDraftModel(model).forward(torch.tensor(PREFIX + tokens))[len(PREFIX):]


def test_tree_nodes_see_only_their_ancestors(model):
    drafter = HFDraftModel(model)
    drafter.forward(torch.tensor(PREFIX))
    # nodes: 0:a  1:b(<-a)  2:c(<-a)  3:d(<-c)  then, in a second forward, 4:e(<-b)
    first = drafter.forward(torch.tensor([40, 41, 42, 43]), torch.tensor([-1, 0, 0, 2]))
    second = drafter.forward(torch.tensor([44]), torch.tensor([1]))
    torch.testing.assert_close(first[1], chain_logits(model, [40, 41])[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[3], chain_logits(model, [40, 42, 43])[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], chain_logits(model, [40, 41, 44])[2], atol=1e-4, rtol=1e-4)


def test_truncate_after_a_tree_keeps_its_leading_chain(model):
    drafter = HFDraftModel(model)
    drafter.forward(torch.tensor(PREFIX))
    parents = [-1, 0, 0, 2]
    assert leading_chain(parents) == 2
    drafter.forward(torch.tensor([40, 41, 42, 43]), torch.tensor(parents))
    drafter.truncate(len(PREFIX) + 2)
    after = drafter.forward(torch.tensor([50]))
    torch.testing.assert_close(after[0], chain_logits(model, [40, 41, 50])[2], atol=1e-4, rtol=1e-4)


def test_rollback_then_continue_matches_a_fresh_run(model):
    drafter = HFDraftModel(model)
    drafter.forward(torch.tensor(PREFIX + [7, 8, 9]))
    drafter.truncate(len(PREFIX) + 1)
    assert drafter.length == len(PREFIX) + 1
    logits = drafter.forward(torch.tensor([11, 12]))
    torch.testing.assert_close(logits, chain_logits(model, [7, 11, 12])[1:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        drafter.truncate(drafter.length + 1)


def test_pruned_head_gives_the_selected_rows(model):
    drafter = HFDraftModel(model)
    rows = torch.tensor([3, 17, 5])
    pruned = drafter.forward(torch.tensor(PREFIX), head=drafter.prune_head(rows))
    torch.testing.assert_close(pruned, HFDraftModel(model).forward(torch.tensor(PREFIX))[:, rows])


def test_loads_a_model_directory_with_its_tokenizer(tmp_path):
    tokenizer = support.sentencepiece()
    support.tiny_model(tokenizer, "llama", seed=4).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    drafter = load_drafter(tmp_path, dtype=torch.float32)
    assert drafter.name == tmp_path.name
    assert drafter.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert drafter.model.forward(torch.tensor([1, 2, 3])).shape == (3, drafter.model.vocab_size)


def test_bad_drafter_paths_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_drafter(tmp_path / "missing")
    with pytest.raises(UserError, match="no config.json"):
        load_drafter(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UserError, match=r"\.gguf file"):
        load_drafter(tmp_path / "weights.bin")
    with pytest.raises(UserError, match="slots: a drafter needs at least one slot"):
        load_drafter(tmp_path, slots=0)
    with pytest.raises(UserError, match="drafter_weights: drafter weights must be dense or nvfp4"):
        load_drafter(tmp_path, weights="int8")


def test_forwards_fill_the_drafters_own_cache(model):
    """Every forward goes through the drafter's cache (under the name this transformers takes it by),
    so later forwards see the earlier tokens without recomputing them."""
    drafter = HFDraftModel(model)
    drafter.forward(torch.tensor(PREFIX))
    assert drafter.cache.get_seq_length() == len(PREFIX)
    drafter.forward(torch.tensor([40, 41]))
    assert drafter.cache.get_seq_length() == len(PREFIX) + 2


def test_the_cache_goes_by_the_name_the_decoder_takes():
    class Recent:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Older:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class Neither:
        def forward(self, input_ids=None, **kwargs): ...

    assert cache_argument(Recent()) == "cache"
    assert cache_argument(Older()) == "past_key_values"
    with pytest.raises(TypeError, match="Neither.forward takes neither `cache` nor `past_key_values`"):
        cache_argument(Neither())
