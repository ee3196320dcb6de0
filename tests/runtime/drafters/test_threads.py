"""The drafter's thread count is measured, and restored after each drafter call."""

from __future__ import annotations

import speculative_support as support
import torch

from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.drafters.threads import calibrate_threads, drafter_threads


def test_threads_are_restored_and_calibration_picks_a_measured_count():
    model = HFDraftModel(support.tiny_model(support.sentencepiece(), "llama", seed=1))
    torch.set_num_threads(2)  # the autouse fixture restores the original count afterwards
    with drafter_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    assert calibrate_threads(model) in (1, 2)
    assert model.length == 0 and torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert calibrate_threads(model) is None


def test_kernel_calibration_keeps_the_faster_of_amx_and_the_vector_kernels():
    """Where the CPU kernels may use AMX, a compiled drafter step's forwards of few and of many rows
    are timed on the tiles and on the vector kernels and each keeps the faster; elsewhere there is
    nothing to choose."""
    import pytest

    from hetero_run.kernels.drafter_step import compiled_available
    from hetero_run.runtime.drafters import weights as draft_weights
    from hetero_run.runtime.drafters.fast import FastDraftModel
    from hetero_run.runtime.drafters.network import DraftNetwork
    from hetero_run.runtime.drafters.threads import calibrate_kernels
    from hetero_run.runtime.models.loader import load_model

    if not compiled_available():
        pytest.skip("the compiled kernels do not build here")
    target = load_model(support.tiny_model(support.sentencepiece(), "llama", seed=1), max_tokens=64,
                        dtype=torch.float32)
    dense = draft_weights.from_model(target)
    bf16 = DraftNetwork(draft_weights.with_fast_activations(draft_weights.quantize(dense)), 1, 64)
    model = FastDraftModel(bf16, bf16.acquire())
    choices = bf16.step.kernel_choices()
    chosen = calibrate_kernels(model)
    assert model.length == 0
    if choices == ("vector",):
        assert chosen is None and bf16.step.kernels == ("vector", "vector", 1)
    else:
        few, many, many_from = chosen
        assert choices == ("amx", "vector") and few in choices and many in choices and many_from in (1, 4, 32)
        assert bf16.step.kernels == chosen and (many_from == 1) == (few == many)
    fp32 = DraftNetwork(dense, 1, 64)  # float32 activations: the tiles do not apply
    assert calibrate_kernels(FastDraftModel(fp32, fp32.acquire())) is None
    assert calibrate_kernels(HFDraftModel(support.tiny_model(support.sentencepiece(), "llama", seed=1))) is None
