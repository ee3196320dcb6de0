"""The speculative engine over the fast drafter (one slot of a DraftNetwork), dense and NVFP4:
greedy output token-identical to the target alone for every algorithm, on a drafter with
another vocabulary; and the slot it drafts on is the only one it takes."""

from __future__ import annotations

import functools

import pytest
import speculative_support as support
import torch

from hetero_run.runtime.drafters import weights as draft_weights
from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.drafters.network import DraftNetwork
from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative.config import SpeculationConfig

PROMPTS = ["def is_prime(n):\n", "naïve café résumé — 你"]


@functools.cache
def target_model():
    return support.trained_model(support.byte_level(), "qwen2", seed=0)


@functools.cache
def drafter_weights(kind: str):
    hf = support.trained_model(support.sentencepiece(), "llama", seed=1)
    dense = draft_weights.from_model(load_model(hf, max_tokens=8, dtype=torch.float32))
    return draft_weights.quantize(dense) if kind == "nvfp4" else draft_weights.cast(dense, torch.bfloat16)


@functools.cache
def reference(prompt: str, n: int = 40) -> list[int]:
    return support.reference_greedy(target_model(), support.byte_level()(prompt)["input_ids"], n)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("algorithm", ["slem", "tli", "slrs"])
def test_greedy_output_is_the_target_alones(algorithm, kind):
    network = DraftNetwork(draft_weights.with_fast_activations(drafter_weights(kind)), slots=3, max_tokens=512)
    drafter = Drafter(None, support.sentencepiece(), "fast-drafter", network)
    runner = TargetRunner(load_model(target_model(), max_tokens=512, dtype=torch.float32))
    engine = SpeculativeEngine(runner, support.byte_level(), drafter, SpeculationConfig(algorithm=algorithm))
    accepted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=40, stop_ids=set())
        assert result.token_ids == reference(prompt), (algorithm, kind, prompt)
        accepted += result.accepted
    assert accepted > 0, "drafts must be accepted for the comparison to mean something"
    assert network.free_slots == 2  # the engine drafts on the one slot its drafter view holds
