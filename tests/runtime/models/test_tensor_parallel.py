"""Real `mpirun -np 2` (gloo): every architecture's TP shards against transformers, one job.

The job (tp_job.py) drives each model through `TargetRunner` on rank 0 while rank 1 serves it:
prompt logits (chunked prefill), a k + 1 token verify step, rollback to an accepted length and
a forward after it, and 64 greedy tokens; here they are compared with transformers on the same
weights (float32).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import env_for_tests, mpirun_argv
from tiny_models import ARCHITECTURES, reference_model, tiny_checkpoint

pytestmark = pytest.mark.mpi
JOB = Path(__file__).with_name("tp_job.py")
ATOL = 2e-5


def _case(name: str, path: Path, seed: int, prefill_chunk: int = 512, embedding_split="even") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"name": name, "path": str(path), "ids": torch.randint(0, 300, (24,), generator=g).tolist(),
            "prompt": 18, "draft": 4, "accept": 2, "after": torch.randint(0, 300, (3,), generator=g).tolist(),
            "greedy": 64, "prefill_chunk": prefill_chunk, "embedding_split": embedding_split}


def _run_job(cases: list[dict], np: int, tmp_path: Path) -> dict:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    proc = subprocess.run(mpirun_argv(np) + [sys.executable, str(JOB), str(spec), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env_for_tests())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sent = json.loads((tmp_path / "rank0.json").read_text())
    for rank in range(1, np):  # the workers served exactly what rank 0 sent, then stopped
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == sent
    return torch.load(tmp_path / "rank0.pt")


def _check(case: dict, got: dict) -> None:
    from transformers import GenerationConfig

    ref = reference_model(case["path"])
    ids, p, k, a = torch.tensor(case["ids"]), case["prompt"], case["draft"], case["accept"]
    with torch.no_grad():
        full = ref(ids[None, :p + k + 1]).logits[0]
        kept = torch.cat([ids[:p + a], torch.tensor(case["after"])])
        after = ref(kept[None]).logits[0, p + a:]
        config = GenerationConfig(max_new_tokens=case["greedy"], do_sample=False, eos_token_id=None, pad_token_id=0)
        mask = torch.ones(1, p, dtype=torch.long)
        greedy = ref.generate(ids[None, :p], generation_config=config, attention_mask=mask)
    name = case["name"]
    torch.testing.assert_close(got["prompt"], full[:p], atol=ATOL, rtol=0, msg=f"{name}: prompt")
    torch.testing.assert_close(got["verify"], full[p:], atol=ATOL, rtol=0, msg=f"{name}: verify")
    torch.testing.assert_close(got["after"], after, atol=ATOL, rtol=0, msg=f"{name}: after rollback")
    assert got["length"] == p + a + len(case["after"])
    assert got["greedy"] == greedy[0, p:].tolist(), name


def test_two_ranks_match_transformers_for_every_architecture(tmp_path):
    cases = [_case(arch, tiny_checkpoint(arch, "bf16"), seed=i, prefill_chunk=7)
             for i, arch in enumerate(ARCHITECTURES)]
    cases.append(_case("qwen3_moe-nvfp4", tiny_checkpoint("qwen3_moe", "nvfp4"), seed=9))
    cases.append(_case("qwen2-tied", tiny_checkpoint("qwen2", "bf16", tie_word_embeddings=True), seed=10))
    # the embedding's rows split unevenly: a quarter on rank 0, none on rank 0, balanced by memory
    cases.append(_case("llama-quarter", tiny_checkpoint("llama", "bf16"), seed=11, embedding_split=[80, 240]))
    cases.append(_case("qwen3-none-on-0", tiny_checkpoint("qwen3", "bf16"), seed=12, embedding_split=[0, 320]))
    cases.append(_case("qwen3_moe-balanced", tiny_checkpoint("qwen3_moe", "nvfp4"), seed=13,
                       embedding_split="balanced"))
    results = _run_job(cases, 2, tmp_path)
    for case in cases:
        _check(case, results[case["name"]])
        split = case["embedding_split"]
        rows = results[case["name"]]["embedding_rows"]
        assert sum(rows) == 320 and (rows == split if isinstance(split, list) else len(rows) == 2), case["name"]
    assert results["qwen2-tied"]["embedding_rows"] == [160, 160]


@pytest.mark.slow
def test_four_ranks_replicate_kv_heads(tmp_path):
    # 4 query heads and 2 KV heads over 4 ranks: each KV head lives on two ranks.
    cases = [_case(arch, tiny_checkpoint(arch, "bf16"), seed=i) for i, arch in enumerate(("qwen3", "qwen3_moe"))]
    results = _run_job(cases, 4, tmp_path)
    for case in cases:
        _check(case, results[case["name"]])
