"""`hetero-run plan --drafter eagle3:DIR`: the head is counted on rank 0 only, with the target
embedding rows it reads at TP > 1 and its per-token feature log; the planner reads every head
layout with the EAGLE-3 loader's own config reader."""

from __future__ import annotations

import dataclasses
import json

import heads
import pytest
import torch
from conftest import head_dir, target_dir
from safetensors.torch import load_file

from hetero_run.runtime.config import BatchingConfig
from hetero_run.runtime.eagle3 import load_eagle3, read_head
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.planner import make_plan, resolve
from hetero_run.topology.errors import ConfigError


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


@pytest.mark.parametrize("layout", heads.LAYOUTS)
def test_planner_reads_each_layout_as_the_eagle3_loader(layout):
    path = head_dir("qwen3", layout, "random")
    model = load_model(target_dir("qwen3"), max_tokens=64, dtype=torch.float32)
    loaded, _, _ = read_head(path, model.config)
    planned = resolve(f"eagle3:{path}", role="drafter").shape
    assert planned.eagle3 and planned.head.aux_layers == ()  # aux layers are resolved against a target
    assert dataclasses.replace(planned.head, aux_layers=loaded.aux_layers) == loaded  # every other field
    assert planned.decoder == loaded.layer and planned.num_layers == 1
    assert (planned.draft_vocab_size, planned.target_hidden_size, planned.vocab_size) == (heads.DRAFT_VOCAB, 64, 300)
    head = load_eagle3(path, model, None).model.head
    per_slot = head.kv.nbytes // head.kv.num_slots
    assert planned.kv_bytes_per_token(1, torch.float32) == loaded.kv_bytes_per_token(torch.float32) == per_slot
    plan = make_plan(str(target_dir("qwen3")), drafter=f"eagle3:{path}", tp=1, context=64,
                     batching=BatchingConfig(max_num_seqs=2))
    assert plan.ranks[0].drafter_kv_bytes == (per_slot + 64 * 4) * 64 * 2  # + the fused features, per sequence


def test_plan_refuses_a_head_for_another_target(tmp_path):
    path = heads.write_head(tmp_path / "h", target_dir("qwen3"), "eagle")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "target_hidden_size": 128}))
    with pytest.raises(ConfigError, match="target_hidden_size: the head reads target states of width 128"):
        make_plan(str(target_dir("qwen3")), drafter=f"eagle3:{path}", context=64)
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="num_hidden_layers: only one-layer heads are supported, got 2"):
        make_plan(str(target_dir("qwen3")), drafter=f"eagle3:{path}", context=64)
