"""Same-architecture drafters through the fast drafter (the compiled step over one slot) match
transformers, trees included; NVFP4 weights take a quarter of the bytes and still draft."""

from __future__ import annotations

import pytest
import speculative_support as support
import torch
from tiny_models import reference_model, tiny_checkpoint

from hetero_run.runtime.drafters import weights as draft_weights
from hetero_run.runtime.drafters.fast import FastDraftModel
from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.drafters.load import load_drafter
from hetero_run.runtime.drafters.network import DraftNetwork
from hetero_run.runtime.models.loader import load_model

PREFIX = [1, 5, 9, 20, 33]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    hf = support.tiny_model(support.sentencepiece(), request.param, seed=7)
    return hf, FastDraftModel(load_model(hf, max_tokens=64, dtype=torch.float32))


def check_against_transformers(fast, reference, atol=1e-4):
    fast.truncate(0)
    close = (lambda a, b: torch.testing.assert_close(a, b, atol=atol, rtol=atol))  # noqa: E731
    close(fast.forward(torch.tensor(PREFIX)), reference.forward(torch.tensor(PREFIX)))
    ids, parents = torch.tensor([40, 41, 42, 43]), torch.tensor([-1, 0, 0, 2])
    close(fast.forward(ids, parents), reference.forward(ids, parents))
    close(fast.forward(torch.tensor([44]), torch.tensor([1])), reference.forward(torch.tensor([44]), torch.tensor([1])))
    fast.truncate(len(PREFIX) + 2)
    reference.truncate(len(PREFIX) + 2)
    close(fast.forward(torch.tensor([50, 51])), reference.forward(torch.tensor([50, 51])))
    rows = torch.tensor([4, 2, 9])
    close(fast.forward(torch.tensor([52]), head=fast.prune_head(rows)),
          reference.forward(torch.tensor([52]), head=reference.prune_head(rows)))


def test_chain_and_tree_forwards_match_transformers(pair):
    hf, fast = pair
    check_against_transformers(fast, HFDraftModel(hf))


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_qwen3_checkpoints_run_as_they_are_stored(quant, tmp_path):
    """q/k norms (qwen3), bf16 weights, and a ModelOpt NVFP4 checkpoint's own codes."""
    path = tiny_checkpoint("qwen3", quant)
    drafter = load_drafter(path, dtype=torch.float32, cache_root=tmp_path)
    assert isinstance(drafter.model, FastDraftModel)
    assert draft_weights.kind(drafter.network.weights) == ("nvfp4" if quant == "nvfp4" else "dense")
    check_against_transformers(drafter.model, HFDraftModel(reference_model(path)), atol=1e-3)


def test_loader_picks_the_fast_path_for_supported_architectures(tmp_path):
    tokenizer = support.sentencepiece()
    source = tmp_path / "model"
    support.tiny_model(tokenizer, "llama", seed=4).save_pretrained(source)
    tokenizer.save_pretrained(source)
    assert isinstance(load_drafter(source, dtype=torch.float32).model, FastDraftModel)
    assert isinstance(load_drafter(source, dtype=torch.float32, fast=False).model, HFDraftModel)


def test_nvfp4_drafter_weights_take_a_quarter_of_the_bytes_and_still_draft():
    hf = support.trained_model(support.sentencepiece(), "llama", seed=1)
    dense = draft_weights.from_model(load_model(hf, max_tokens=64, dtype=torch.float32))
    quantised = draft_weights.quantize(dense)
    layer_bytes = (lambda w: sum(layer.nbytes for layer in w.layers))  # noqa: E731
    assert layer_bytes(quantised) < 0.2 * layer_bytes(dense)  # fp32 -> 4 bits + scales
    assert quantised.head.nvfp4 and draft_weights.kind(quantised) == "nvfp4"
    ids = torch.tensor(support.sentencepiece()("def is_prime(n):\n    if n", add_special_tokens=False)["input_ids"])
    networks = [DraftNetwork(w, max_tokens=64) for w in (dense, quantised)]
    a, b = (network.view(network.acquire()).forward(ids) for network in networks)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.7
