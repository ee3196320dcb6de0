"""Same-architecture drafters through the runtime's model code match transformers, trees included."""

from __future__ import annotations

import pytest
import speculative_support as support
import torch

from hetero_run.runtime.drafters.fast import FastDraftModel
from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.drafters.load import load_drafter
from hetero_run.runtime.models.loader import load_model

PREFIX = [1, 5, 9, 20, 33]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    hf = support.tiny_model(support.sentencepiece(), request.param, seed=7)
    return hf, FastDraftModel(load_model(hf, max_tokens=64, dtype=torch.float32))


def test_chain_and_tree_forwards_match_transformers(pair):
    hf, fast = pair
    fast.truncate(0)
    reference = HFDraftModel(hf)
    torch.testing.assert_close(fast.forward(torch.tensor(PREFIX)), reference.forward(torch.tensor(PREFIX)),
                               atol=1e-4, rtol=1e-4)
    ids, parents = torch.tensor([40, 41, 42, 43]), torch.tensor([-1, 0, 0, 2])
    torch.testing.assert_close(fast.forward(ids, parents), reference.forward(ids, parents), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fast.forward(torch.tensor([44]), torch.tensor([1])),
                               reference.forward(torch.tensor([44]), torch.tensor([1])), atol=1e-4, rtol=1e-4)
    fast.truncate(len(PREFIX) + 2)
    reference.truncate(len(PREFIX) + 2)
    torch.testing.assert_close(fast.forward(torch.tensor([50, 51])), reference.forward(torch.tensor([50, 51])),
                               atol=1e-4, rtol=1e-4)
    rows = torch.tensor([4, 2, 9])
    torch.testing.assert_close(fast.forward(torch.tensor([52]), head=fast.prune_head(rows)),
                               reference.forward(torch.tensor([52]), head=reference.prune_head(rows)),
                               atol=1e-4, rtol=1e-4)


def test_loader_picks_the_fast_path_for_supported_architectures(tmp_path):
    tokenizer = support.sentencepiece()
    support.tiny_model(tokenizer, "llama", seed=4).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert isinstance(load_drafter(tmp_path, dtype=torch.float32).model, FastDraftModel)
    assert isinstance(load_drafter(tmp_path, dtype=torch.float32, fast=False).model, HFDraftModel)


def test_nvfp4_drafter_weights_take_a_quarter_of_the_bytes_and_still_draft():
    from hetero_run.runtime.drafters.fast import quantize_nvfp4

    hf = support.trained_model(support.sentencepiece(), "llama", seed=1)
    dense = load_model(hf, max_tokens=64, dtype=torch.float32)
    quantised = load_model(hf, max_tokens=64, dtype=torch.float32)
    before = sum(layer.nbytes for layer in quantised.layers)
    quantize_nvfp4(quantised)
    assert sum(layer.nbytes for layer in quantised.layers) < 0.2 * before  # fp32 -> 4 bits + scales
    ids = torch.tensor(support.sentencepiece()("def is_prime(n):\n    if n", add_special_tokens=False)["input_ids"])
    a = FastDraftModel(dense).forward(ids)
    b = FastDraftModel(quantised).forward(ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.7
