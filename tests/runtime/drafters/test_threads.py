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
