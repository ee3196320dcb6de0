"""`hetero-run plan --drafter eagle3:DIR`: the head is counted on rank 0 only, with the target
embedding rows it reads at TP > 1 and its per-token feature log."""

from __future__ import annotations

import json

from conftest import head_dir, target_dir
from safetensors.torch import load_file

from hetero_run.runtime.planner import make_plan


def head_bytes(path) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(path / "model.safetensors").values())


def test_plan_counts_the_head_on_rank_0_with_the_embedding_rows_it_lacks():
    target, head = target_dir("qwen3"), head_dir("qwen3", "eagle", "random")
    one = make_plan(str(target), drafter=f"eagle3:{head}", tp=1, context=256)
    two = make_plan(str(target), drafter=f"eagle3:{head}", tp=2, context=256)
    assert one.ranks[0].drafter_weights_bytes == head_bytes(head)  # fp32 head, fp32 target: stored bytes
    rows = (300 - 150) * 64 * 4  # the target embedding rows rank 1 holds, fp32
    assert two.ranks[0].drafter_weights_bytes == head_bytes(head) + rows
    assert two.ranks[1].drafter_weights_bytes == 0 and two.ranks[1].drafter_kv_bytes_per_token == 0
    kv = 2 * 2 * 16 * 4  # the head's own K and V, one layer, 2 KV heads of 16, fp32
    assert two.ranks[0].drafter_kv_bytes_per_token == kv + 64 * 4  # + one fused feature row
    own = make_plan(str(target), drafter=f"eagle3:{head_dir('qwen3', 'vllm', 'random')}", tp=2, context=256)
    assert own.ranks[0].drafter_weights_bytes == head_bytes(head_dir("qwen3", "vllm", "random"))  # has its own


def test_plan_cli_accepts_an_eagle3_head(run_cli):
    target, head = target_dir("qwen3_moe"), head_dir("qwen3_moe", "modelopt", "random")
    out = run_cli("plan", "--target", target, "--drafter", f"eagle3:{head}", "--tp", "2", "--context", "256",
                  "--json", timeout=120)
    assert out.returncode == 0, out.output
    plan = json.loads(out.stdout)
    text = json.dumps(plan)
    assert "eagle3" in text
    bad = run_cli("plan", "--target", target, "--drafter", f"eagle3:{target}", timeout=120)
    assert bad.returncode == 2 and "not an EAGLE-3 head" in bad.output and "Traceback" not in bad.output
