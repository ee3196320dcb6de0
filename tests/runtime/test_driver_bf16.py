"""Greedy speculative decoding in bf16 emits exactly the target alone's tokens.

The target is an untrained bf16 network, so its logits are flat and near-ties are everywhere;
the drafter is the same network in float32, so most drafts are accepted and verify forwards are
long. If a verify forward computed a token's logits with other bits than a one-token decode
forward does, the argmax would flip at some near-tie and the outputs would part.
"""

from __future__ import annotations

import functools

import pytest
import speculative_support as support
import torch

from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative.config import SpeculationConfig

PROMPTS = ["def is_prime(n):\n", "The quick brown", "Hello world! Hello there"]


@functools.cache
def flat_target():
    model = support.tiny_model(support.byte_level(), "qwen2", seed=3, layers=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(1 / 8)  # undo tiny_model's sharpening: flat logits, many near-ties
    return model


def outputs(algorithm: str, **config) -> tuple[list[list[int]], int]:
    draft = Drafter(HFDraftModel(flat_target()), support.byte_level(), "same") if algorithm != "none" else None
    runner = TargetRunner(load_model(flat_target(), max_tokens=512, dtype=torch.bfloat16))
    engine = SpeculativeEngine(runner, support.byte_level(), draft, SpeculationConfig(algorithm=algorithm, **config))
    results = [engine.generate(p, max_new_tokens=64, stop_ids=set()) for p in PROMPTS]
    return [r.token_ids for r in results], sum(r.accepted for r in results)


@pytest.mark.parametrize("config", [{}, {"draft_len": 12, "adaptive": False}], ids=["adaptive", "draft12"])
def test_bf16_speculative_output_is_the_target_alones(config):
    alone, _ = outputs("none")
    speculative, accepted = outputs("standard", **config)
    assert accepted > 50, "long accepted drafts make the verify forwards long"
    assert speculative == alone
