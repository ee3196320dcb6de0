"""The memory plan and roofline: presets against the published arithmetic, the per-tensor
rules on a hand-made checkpoint, the longest context, the roofline formulas, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hetero_run.runtime.checkpoint import QuantConfig
from hetero_run.runtime.config import RunConfig
from hetero_run.runtime.models.kv_cache import DEFAULT_BLOCK_SIZE
from hetero_run.runtime.planner import (
    DoesNotFit,
    Node,
    expected_tokens_per_round,
    experts_touched,
    hardware_preset,
    make_plan,
    measure_bandwidth,
    plan_run,
    rank_tensors,
    relative_to_file,
    resolve,
    topology_nodes,
)
from hetero_run.runtime.planner.export_layout import expand
from hetero_run.runtime.planner.shape import ModelShape
from hetero_run.topology.errors import ConfigError, UserError

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
DUAL = ROOT / "topology/examples/dual-spark.yaml"
SINGLE = ROOT / "topology/examples/single-spark.yaml"


@pytest.fixture(scope="module")
def qwen235():
    return resolve("qwen3-235b-a22b-nvfp4")


@pytest.fixture(scope="module")
def eagle3():
    return resolve("eagle3-qwen3-235b", role="drafter")


@pytest.fixture(scope="module")
def dual_plan(qwen235, eagle3):
    nodes, tp = topology_nodes(str(DUAL))
    return make_plan(qwen235, drafter=eagle3, nodes=nodes, tp=tp, hardware="dgx-spark", context=32768)


def test_qwen3_235b_preset_matches_the_published_arithmetic(qwen235):
    # dual-spark.md: 235.09 B parameters; attention + experts NVFP4, the rest bf16: ~124.9 GiB
    from hetero_run.runtime.planner.report import _parameters

    assert _parameters(qwen235) == pytest.approx(235.09e9, rel=1e-3)
    assert qwen235.total_bytes / GiB == pytest.approx(124.9, rel=2e-3)
    assert qwen235.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert qwen235.tensors["model.layers.5.mlp.gate.weight"].dtype == torch.bfloat16  # router excluded
    assert qwen235.tensors["lm_head.weight"].shape == (151936, 4096)
    assert qwen235.tensors["model.layers.93.mlp.experts.127.down_proj.weight"] == \
        type(qwen235.tensors["lm_head.weight"])(torch.uint8, (4096, 768))


def test_two_sparks_fit_with_62_4_gib_of_weights_per_node(dual_plan):
    plan = dual_plan
    assert plan.fits and plan.verdict == "FITS"
    assert plan.tp == 2 and [r.node for r in plan.ranks] == ["spark-a", "spark-b"]
    for r in plan.ranks:
        assert r.weights_bytes / GiB == pytest.approx(62.4, rel=0.01)
        assert r.kv_bytes_per_token == 94 * 1024  # 94 KiB per token per node in bf16
        assert r.kv_bytes == 94 * 1024 * 32768
        assert r.capacity_bytes == 119 * GiB
        assert r.kv_room_bytes > 40 * GiB  # tens of GiB left for KV per node
    assert plan.ranks[0].drafter_bytes > 0 and plan.ranks[1].drafter_bytes == 0
    # the EAGLE-3 head from its shape: fc + one 2H-input layer + norms + 32000-row head + d2t/t2d,
    # plus the half of the target's embedding rank 1 holds (the head embeds through it): 0.58 GiB
    assert plan.ranks[0].drafter_weights_bytes / GiB == pytest.approx(1.10 + 0.58, abs=0.01)
    assert plan.max_context_tokens == 40960  # the model's limit, memory allows more
    assert plan.max_context_tokens_by_memory > 40960


def test_one_spark_does_not_fit_and_check_refuses_with_the_plan(qwen235, eagle3):
    nodes, tp = topology_nodes(str(SINGLE))
    plan = make_plan(qwen235, drafter=eagle3, nodes=nodes, tp=tp, context=32768)
    assert tp == 1 and not plan.fits and plan.max_context_tokens == 0
    assert plan.ranks[0].weights_bytes > nodes[0].memory_bytes  # weights alone exceed the node
    with pytest.raises(DoesNotFit) as info:
        plan.check()
    assert info.value.exit_code == 1 and isinstance(info.value, UserError)
    text = str(info.value)
    assert "DOES NOT FIT" in text and "rank 0 (spark-a) needs" in text and "target weights" in text


def test_single_node_fallback_of_the_dual_topology_plans_tp1(qwen235):
    nodes, tp = topology_nodes(str(DUAL), world_size=1)
    assert tp == 1 and [n.name for n in nodes] == ["spark-a"]


def test_longest_context_is_exact(qwen235, eagle3):
    nodes = [Node("a", 72 * GiB), Node("b", 72 * GiB)]
    plan = make_plan(qwen235, drafter=eagle3, nodes=nodes, tp=2, hardware="dgx-spark", context=1024)
    longest = plan.max_context_tokens_by_memory
    assert 0 < longest < 40960, longest
    at = make_plan(qwen235, drafter=eagle3, nodes=nodes, tp=2, hardware="dgx-spark", context=longest)
    over = make_plan(qwen235, drafter=eagle3, nodes=nodes, tp=2, hardware="dgx-spark", context=longest + 1)
    assert at.fits and not over.fits
    assert at.max_context_tokens == longest
    assert min(r.free_bytes for r in at.ranks) >= 0 > min(r.free_bytes for r in over.ranks)
    # what is left is less than one more block of the KV cache needs
    assert min(r.free_bytes for r in at.ranks) < DEFAULT_BLOCK_SIZE * at.ranks[0].per_context_token_bytes


def test_batch_multiplies_the_kv_cache(qwen235):
    nodes = [Node("a", 119 * GiB), Node("b", 119 * GiB)]
    one = make_plan(qwen235, nodes=nodes, tp=2, context=8192, batch=1)
    four = make_plan(qwen235, nodes=nodes, tp=2, context=8192, batch=4)
    assert four.ranks[1].kv_bytes == 4 * one.ranks[1].kv_bytes
    assert four.max_context_tokens_by_memory < one.max_context_tokens_by_memory // 3


# --- per-tensor rules on a checkpoint written here --------------------------------------------

def _write_checkpoint(path: Path, config: dict, quant: QuantConfig | None, dtype=torch.bfloat16,
                      extra: dict | None = None) -> Path:
    shape = ModelShape.for_target(config)
    tensors = {name: torch.zeros(info.shape, dtype=info.dtype) for name, info in expand(shape, quant, dtype).items()}
    tensors.update(extra or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    if quant is not None:
        (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {
            "quant_algo": quant.algo, "group_size": quant.group_size, "exclude_modules": list(quant.exclude_modules)}}))
    return path


LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, tie_word_embeddings=False)


def test_quantisation_exclusions_and_tp_shards_per_tensor(tmp_path):
    quant = QuantConfig("NVFP4", 16, ("lm_head", "model.embed_tokens", "model.layers.0.mlp.*"))
    k_scale = {"model.layers.1.self_attn.k_proj.k_scale": torch.zeros((), dtype=torch.float32)}
    ckpt = _write_checkpoint(tmp_path / "ck", LLAMA, quant, extra=k_scale)
    held = {t.name: t for t in rank_tensors(resolve(str(ckpt)), tp=2)}

    q = "model.layers.1.self_attn.q_proj"  # NVFP4, column-parallel: [64, 64] -> 32 rows per rank
    assert (held[f"{q}.codes"].dtype, held[f"{q}.codes"].shape) == (torch.uint8, (32, 32))
    assert (held[f"{q}.block_scale"].dtype, held[f"{q}.block_scale"].shape) == (torch.float8_e4m3fn, (32, 4))
    assert held[f"{q}.row_scale"].shape == (32,) and held[f"{q}.input_scale"].shape == (32,)
    o = "model.layers.1.self_attn.o_proj"  # NVFP4, row-parallel: [64, 64] -> 32 inputs per rank
    assert held[f"{o}.codes"].shape == (64, 16) and held[f"{o}.block_scale"].shape == (64, 2)
    assert held[f"{o}.row_scale"].shape == (64,)
    down = "model.layers.1.mlp.down_proj"  # [64, 96] -> 48 inputs: 3 whole 16-blocks
    assert held[f"{down}.codes"].shape == (64, 24)
    excluded = held["model.layers.0.mlp.gate_proj.weight"]  # excluded: dense bf16, rows split
    assert (excluded.dtype, excluded.shape) == (torch.bfloat16, (48, 64))
    assert held["model.embed_tokens.weight"].shape == (48, 64)  # vocab-parallel
    assert held["lm_head.weight"].shape == (48, 64) and held["lm_head.weight"].dtype == torch.bfloat16
    assert held["model.layers.1.input_layernorm.weight"].shape == (64,)  # replicated
    assert not any(name.endswith(".k_scale") for name in held)  # the runtime does not keep it
    total = sum(t.nbytes for t in held.values())
    assert make_plan(str(ckpt), nodes=[Node("a", GiB), Node("b", GiB)], tp=2).ranks[1].weights_bytes == total


def test_dense_dtype_follows_the_loader(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "fp32", LLAMA, None, dtype=torch.float32)
    auto = make_plan(str(ckpt), context=64)
    bf16 = make_plan(str(ckpt), context=64, dtype="bf16")
    assert auto.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert auto.ranks[0].weights_bytes == 2 * bf16.ranks[0].weights_bytes
    assert auto.ranks[0].kv_bytes_per_token == 2 * bf16.ranks[0].kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_fewer_kv_heads_than_ranks_replicates_one_head(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ck", LLAMA, None)
    plan = make_plan(str(ckpt), nodes=[Node("a", GiB)], tp=4, context=64)
    held = {t.name: t for t in plan.tensors}
    assert held["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)  # one whole head
    assert held["model.layers.0.self_attn.q_proj.weight"].shape == (16, 64)
    assert plan.ranks[0].kv_bytes_per_token == 2 * 2 * 1 * 16 * 2
    assert plan.ranks[0].capacity_bytes == GiB // 4  # four ranks share the node


def test_bad_shards_and_inputs_are_one_line_errors(tmp_path):
    odd = _write_checkpoint(tmp_path / "odd", dict(LLAMA, vocab_size=95), None)
    with pytest.raises(ConfigError, match=r"vocab_size = 95 does not divide across 2 tensor-parallel ranks"):
        make_plan(str(odd), nodes=[Node("a", GiB), Node("b", GiB)], tp=2)
    with pytest.raises(ConfigError, match="neither a checkpoint directory nor a preset.*qwen3-235b-a22b-nvfp4"):
        make_plan("no-such-model")
    with pytest.raises(ConfigError, match="EAGLE-3 head cannot be the target"):
        make_plan("eagle3-qwen3-235b")
    with pytest.raises(ConfigError, match="not an EAGLE-3 head"):
        make_plan(str(odd), drafter=f"eagle3:{odd}")
    with pytest.raises(ConfigError, match="unknown hardware preset 'tpu'.*dgx-spark"):
        make_plan(str(odd), hardware="tpu")
    with pytest.raises(ConfigError, match="context: must be an integer >= 1"):
        make_plan(str(odd), context=0)
    with pytest.raises(ConfigError, match="3 ranks do not spread evenly over 2 nodes"):
        make_plan(str(odd), nodes=[Node("a", GiB), Node("b", GiB)], tp=3)
    with pytest.raises(ConfigError, match="expected auto, bf16, fp16 or fp32"):
        make_plan(str(odd), dtype="int8")


# --- roofline -----------------------------------------------------------------------------------

def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.0, 3) == 1.0
    assert expected_tokens_per_round(1.0, 3) == 4.0
    assert expected_tokens_per_round(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens_per_round(0.8, 1) == pytest.approx(1.8)


def test_experts_touched():
    assert experts_touched(128, 8, 1) == pytest.approx(8)
    assert experts_touched(128, 8, 4) == pytest.approx(128 * (1 - (120 / 128) ** 4))  # ~29.1
    assert experts_touched(128, 8, 1000) == pytest.approx(128)


def test_roofline_reads_active_experts_kv_and_waits_for_the_link(dual_plan):
    plan, roof, hw = dual_plan, dual_plan.roofline, dual_plan.hardware
    groups = plan.ranks[1].weights_by_group
    row = 4096 * 2  # one bf16 embedding row
    kv = plan.ranks[1].kv_bytes_per_token
    dense = sum(v for g, v in groups.items() if g not in ("experts", "embedding"))
    expected = dense + groups["experts"] * 8 / 128 + row + (32768 + 1) * kv
    assert roof.decode.bytes_per_rank[1] == int(expected)
    assert roof.decode.collectives == 2 * 94 + 2
    assert roof.decode.seconds == pytest.approx(expected / 273e9 + 190 * 28e-6)
    assert roof.target_tokens_per_s == pytest.approx(1 / roof.decode.seconds)
    # verify of K+1 = 4 tokens: ~29 experts per layer when routing is independent, 8 when shared
    indep = dense + groups["experts"] * experts_touched(128, 8, 4) / 128 + 4 * row + (32768 + 4) * kv
    assert roof.verify.bytes_per_rank[1] == int(indep)
    assert roof.verify_shared.bytes_per_rank[1] - roof.decode.bytes_per_rank[1] == 3 * (kv + row)
    tau = expected_tokens_per_round(0.7, 3)
    round_s = roof.draft_round_extra_s + 3 * roof.draft_step.seconds + roof.verify.seconds
    assert roof.speculative_tokens_per_s() == pytest.approx(tau / round_s)
    assert roof.speculative_tokens_per_s() < roof.speculative_tokens_per_s(shared_routing=True)
    assert hw.name == "dgx-spark"


def test_roofline_one_node_matches_the_published_bytes_per_token(qwen235):
    plan = make_plan(qwen235, nodes=[Node("a", 512 * GiB)], tp=1, hardware="dgx-spark", context=1)
    weights_read = plan.roofline.decode.bytes_per_rank[0] - 2 * plan.ranks[0].kv_bytes_per_token
    assert weights_read / 1e9 == pytest.approx(13.1, rel=0.03)  # dual-spark.md: ~13.1 GB per token
    assert plan.roofline.decode.collectives == 0
    assert plan.roofline.target_tokens_per_s == pytest.approx(20.8, rel=0.03)  # ~20.8 tok/s on one node


def test_hardware_presets_and_measurement():
    spark = hardware_preset("dgx-spark")
    assert spark.memory_bandwidth_gbps == 273 and spark.link_latency_us == 28
    assert spark.with_(link_latency_us=41, memory_bandwidth_gbps=None).link_latency_us == 41
    assert hardware_preset("cpu-host").node_memory_bytes() > 0
    assert 0.1 < measure_bandwidth(32 << 20, repeats=2) < 10_000


# --- run config -----------------------------------------------------------------------------------

def test_run_config_file_relative_paths_and_overrides(tmp_path):
    (tmp_path / "t.yaml").write_text(DUAL.read_text())
    run_file = tmp_path / "run.yaml"
    run_file.write_text("target: qwen3-235b-a22b-nvfp4\ndrafter: eagle3-qwen3-235b\ntopology: t.yaml\n"
                        "context: 16384\nbatch: 1\n")
    run = RunConfig.load(run_file)
    assert run.with_overrides(context=4096, batch=None).context == 4096
    assert relative_to_file(run).topology == str(tmp_path / "t.yaml")
    assert relative_to_file(run).target == "qwen3-235b-a22b-nvfp4"  # a preset, not a path
    plan = plan_run(run)
    assert plan.fits and plan.tp == 2 and plan.context == 16384 and plan.hardware.name == "dgx-spark"
    single = plan_run(run, world_size=1)  # one rank launched on the two-node topology: fallback
    assert single.tp == 1 and not single.fits


@pytest.mark.parametrize("text, message", [
    ("target: x\ncontxt: 5\n", r"run.yaml:2: contxt: unknown key"),
    ("target: x\ncontext: lots\n", r"run.yaml:2: context: .*'lots'"),
    ("drafter: x\n", r"run.yaml:1: .*'target'"),
    ("target: [1, 2\n", r"run.yaml:\d+: invalid YAML"),
])
def test_run_config_errors_name_file_line_and_field(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        RunConfig.load(path)
