"""The real CPU pair (slow): every algorithm (prompt lookup, suffix trees and hybrids included),
greedy, token-identical to the target alone.

Target Qwen2.5-Coder-0.5B-Instruct through the runtime's model code (TargetRunner, TP=1) in
float32, in bf16 and as the NVFP4 checkpoint `fetch` converts: token identity needs logits that
do not depend on how many tokens share a forward (kernels/batch_invariance.py), which is what
bf16 and NVFP4 exercise; drafters SmolLM2-135M-Instruct (runtime model code, NVFP4 weights; another vocabulary, GPT-2
style BPE) and Gemma 3 270M (transformers; SentencePiece with byte fallback). Needs the pair's
files (`hetero-run fetch cpu-pair --dest DIR`) in $HETERO_RUN_PAIR (default: fetch's cache).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from support import PAIR

from hetero_run.runtime.drafters.load import load_drafter
from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.speculative.config import SpeculationConfig

pytestmark = pytest.mark.slow
TARGET = PAIR / "qwen2.5-coder-0.5b-instruct.gguf"
TARGET_NVFP4 = PAIR / "qwen2.5-coder-0.5b-instruct-nvfp4"
SMOL = PAIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = PAIR / "gemma-3-270m-q4_k_m.gguf"
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain in one sentence what a hash map is. Then say «done» — 完成."]
NEW_TOKENS = 32


def _need(path: Path) -> None:
    if not path.is_file():
        pytest.skip(f"{path} is not here (fetch the CPU pair first)")


@functools.cache
def target(kind: str = "fp32"):
    """kind: fp32 / bf16 (the GGUF, dequantised) or nvfp4 (the converted checkpoint, bf16 activations)."""
    from transformers import AutoTokenizer

    from hetero_run.runtime.models.loader import load_model
    from hetero_run.runtime.runner import TargetRunner

    _need(TARGET)
    path = TARGET_NVFP4 if kind == "nvfp4" else TARGET
    if not (path / "model.safetensors").is_file() and kind == "nvfp4":
        pytest.skip(f"{path} is not here (`hetero-run fetch cpu-pair` converts it)")
    tokenizer = AutoTokenizer.from_pretrained(str(PAIR), gguf_file=TARGET.name)
    return TargetRunner(load_model(path, max_tokens=1024, dtype="fp32" if kind == "fp32" else "bf16")), tokenizer


@functools.cache
def drafter(path: Path):
    _need(path)
    return load_drafter(path, dtype=torch.bfloat16, weights="nvfp4")


@functools.cache
def reference(prompt: str, kind: str = "fp32") -> list[int]:
    runner, tokenizer = target(kind)
    return SpeculativeEngine(runner, tokenizer, None, SpeculationConfig(algorithm="none")).generate(
        prompt, NEW_TOKENS, chat=True).token_ids


@pytest.mark.parametrize("kind", ["fp32", "bf16", "nvfp4"])
@pytest.mark.parametrize("algorithm", ["slem", "tli", "slrs", "auto"])
def test_smollm2_drafting_for_qwen_is_lossless(algorithm, kind):
    runner, tokenizer = target(kind)
    engine = SpeculativeEngine(runner, tokenizer, drafter(SMOL), SpeculationConfig(algorithm=algorithm))
    accepted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, NEW_TOKENS, chat=True)
        assert result.token_ids == reference(prompt, kind), (algorithm, kind, prompt)
        accepted += result.accepted
    if algorithm != "auto":
        assert accepted > 0


@pytest.mark.parametrize("algorithm", ["slem", "tli"])
def test_gemma_drafting_for_qwen_is_lossless(algorithm):
    runner, tokenizer = target("bf16")
    engine = SpeculativeEngine(runner, tokenizer, drafter(GEMMA), SpeculationConfig(algorithm=algorithm))
    for prompt in PROMPTS:
        result = engine.generate(prompt, NEW_TOKENS, chat=True)
        assert result.token_ids == reference(prompt, "bf16"), (algorithm, prompt)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("algorithm, hybrid", [("ngram", False), ("suffix", False), ("slem", True)])
def test_model_free_and_hybrid_rounds_on_the_real_pair_are_lossless(algorithm, hybrid, kind):
    runner, tokenizer = target(kind)
    engine = SpeculativeEngine(runner, tokenizer, drafter(SMOL) if hybrid else None,
                               SpeculationConfig(algorithm=algorithm, hybrid=hybrid))
    for prompt in PROMPTS + PROMPTS[:1]:  # the repeat meets its first generation in the suffix cache
        result = engine.generate(prompt, NEW_TOKENS, chat=True)
        assert result.token_ids == reference(prompt, kind), (algorithm, kind, prompt)
