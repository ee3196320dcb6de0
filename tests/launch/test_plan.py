"""`hetero-run plan`: verdicts and exit statuses on the shipped topologies, the KV cache in
blocks (text and JSON), run config files, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DUAL = ROOT / "topology/examples/dual-spark.yaml"
SINGLE = ROOT / "topology/examples/single-spark.yaml"
GiB = 1 << 30
PER_RANK = ("rank", "weights_bytes", "kv_bytes", "drafter_bytes", "total_bytes", "capacity_bytes")


def test_two_sparks_fit_json(run_cli):
    out = run_cli("plan", "--target", "qwen3-235b-a22b-nvfp4", "--drafter", "eagle3-qwen3-235b",
                  "--topology", DUAL, "--context", "32768", "--json")
    assert out.returncode == 0, out.output
    plan = json.loads(out.stdout)
    assert plan["fits"] is True and plan["max_context_tokens"] == 40960
    # serve's defaults: 8 sequences, 512 rows a step, blocks of 16
    assert (plan["max_num_seqs"], plan["max_num_batched_tokens"], plan["block_size"]) == (8, 512, 16)
    assert plan["kv_cache_tokens_requested"] is None
    assert plan["kv_blocks"] == 8 * 2048 and plan["kv_tokens"] == 8 * 32768
    assert plan["sequences"] == 8 and plan["max_num_seqs_fit"] is True
    assert [r["rank"] for r in plan["per_rank"]] == [0, 1]
    for r in plan["per_rank"]:
        assert all(isinstance(r[key], int) for key in PER_RANK)
        assert r["weights_bytes"] / GiB == pytest.approx(62.4, rel=0.01)
        assert r["kv_block_bytes"] == 16 * 94 * 1024 and r["kv_blocks"] == plan["kv_blocks"]
        assert r["kv_bytes"] == 8 * 94 * 1024 * 32768
        assert r["capacity_bytes"] == 119 * GiB and r["total_bytes"] < r["capacity_bytes"]
        assert r["kv_room_bytes"] > 40 * GiB
        assert r["kv_blocks_by_memory"] == r["kv_room_bytes"] // r["kv_block_bytes"]
        assert r["sequences_by_memory"] == r["kv_blocks_by_memory"] // 2048 and r["max_num_seqs_fit"] is True
    assert [r["sequences_by_memory"] for r in plan["per_rank"]] == [15, 16]
    assert plan["per_rank"][0]["drafter_bytes"] > 0 == plan["per_rank"][1]["drafter_bytes"]
    roof = plan["roofline"]
    assert roof["decode"]["collectives"] == 190 and roof["memory_bandwidth_gbps"] == 273
    spec = roof["speculative"]
    assert spec["draft_len"] == 3 and spec["acceptance"] == 0.7
    assert 0 < spec["tokens_per_s"] <= spec["tokens_per_s_shared_routing"]


def test_two_sparks_table_shows_blocks_and_sequences(run_cli):
    out = run_cli("plan", "--target", "qwen3-235b-a22b-nvfp4", "--topology", DUAL, "--context", "8192",
                  "--max-num-seqs", "100", "--block-size", "32", "--max-num-batched-tokens", "1024")
    assert out.returncode == 0, out.output
    text = out.stdout
    assert "up to 100 sequences and 1024 rows a step, KV blocks of 32 tokens" in text
    assert "KV cache per block (32 tokens)" in text and "2.94 MiB" in text  # 32 x 94 KiB
    assert "sequences of 8,192 tokens at once" in text and "--max-num-seqs 100 at full context fit" in text
    assert "activations / workspace (est., 1024 rows)" in text
    # 100 sequences of 8K (25,600 blocks of 32) do not fit: the cache takes the tightest rank's room
    assert "only 67 sequences of 8,192 tokens fit at once, not --max-num-seqs 100" in text
    assert "FITS: longest context 40,960 tokens" in text
    assert "KV cache: 17,225 blocks of 32 tokens (551,200 tokens) on every rank, 67 sequences of 8,192" in text


def test_one_spark_does_not_fit_exit_1_with_the_table(run_cli):
    out = run_cli("plan", "--target", "qwen3-235b-a22b-nvfp4", "--drafter", "eagle3-qwen3-235b",
                  "--topology", SINGLE)
    assert out.returncode == 1, out.output
    assert "DOES NOT FIT" in out.stdout and "rank 0 (spark-a) needs" in out.stdout
    assert "target weights" in out.stdout and "tok/s" in out.stdout
    assert "Traceback" not in out.output


def test_run_config_file_and_flag_overrides(run_cli, tmp_path):
    (tmp_path / "topo.yaml").write_text(DUAL.read_text())
    run = tmp_path / "run.yaml"
    run.write_text("target: qwen3-235b-a22b-nvfp4\ntopology: topo.yaml\ncontext: 8192\nmax_num_seqs: 2\n")
    out = run_cli("plan", "--config", run, "--context", "4096", "--acceptance", "0.8", "--draft-len", "2",
                  "--drafter", "eagle3-qwen3-235b", "--link-latency-us", "41", "--json")
    assert out.returncode == 0, out.output
    plan = json.loads(out.stdout)
    assert plan["context_tokens"] == 4096 and plan["max_num_seqs"] == 2 and plan["tensor_parallel_size"] == 2
    assert plan["kv_blocks"] == 2 * 256 and plan["per_rank"][1]["kv_bytes"] == 94 * 1024 * 4096 * 2
    assert plan["roofline"]["link_latency_us"] == 41
    assert plan["roofline"]["speculative"]["expected_tokens_per_round"] == pytest.approx(1 + 0.8 + 0.64)


@pytest.mark.parametrize("args, message", [
    (("--target", "no-such-model"), "neither a checkpoint directory nor a preset"),
    (("--target", "qwen3-235b-a22b-nvfp4", "--context", "0"), "context"),
    (("--target", "qwen3-235b-a22b-nvfp4", "--acceptance", "1.5"), "--acceptance: must be between 0 and 1"),
    (("--target", "qwen3-235b-a22b-nvfp4", "--hardware", "tpu"), "unknown hardware preset 'tpu'"),
    (("--drafter", "eagle3-qwen3-235b",), "give --target DIR|PRESET or --config RUN.yaml"),
    (("--target", "qwen3-235b-a22b-nvfp4", "--max-num-seqs", "0"), "--max-num-seqs: must be a whole number >= 1"),
    (("--target", "qwen3-235b-a22b-nvfp4", "--block-size", "0"), "--block-size: must be a whole number >= 1"),
    (("--target", "qwen3-235b-a22b-nvfp4", "--max-num-batched-tokens", "4"),
     "--max-num-batched-tokens: must be >= max_num_seqs (8), got 4"),
    (("--target", "qwen3-235b-a22b-nvfp4", "--kv-cache-tokens", "8"),
     "--kv-cache-tokens: must be a whole number >= 16"),
    (("--target", "qwen3-235b-a22b-nvfp4", "--context", "8192", "--kv-cache-tokens", "1000"),
     "--kv-cache-tokens: 1,000 tokens hold less than one sequence of the context (8,192 tokens: 512 blocks of 16)"),
])
def test_bad_input_is_one_line_exit_2(run_cli, args, message):
    out = run_cli("plan", *args)
    assert out.returncode == 2, out.output
    assert message in out.stderr and "Traceback" not in out.output


def test_kv_cache_tokens_beyond_the_room_does_not_fit(run_cli):
    out = run_cli("plan", "--target", "qwen3-235b-a22b-nvfp4", "--topology", DUAL, "--context", "8192",
                  "--kv-cache-tokens", "2000000")
    assert out.returncode == 1, out.output
    assert "DOES NOT FIT" in out.stdout and "Traceback" not in out.output
    assert "--kv-cache-tokens: 2,000,000 tokens (125,000 blocks of 16) do not fit: rank 0 (spark-a) has room for" \
        in out.stdout


def test_checkpoint_on_this_machine_with_measured_bandwidth(run_cli):
    from tiny_models import tiny_checkpoint

    path = tiny_checkpoint("qwen3_moe", "bf16")
    out = run_cli("plan", "--target", path, "--measure-bandwidth", "--per-tensor", "--json")
    assert out.returncode == 0, out.output
    plan = json.loads(out.stdout)
    assert plan["hardware"]["name"] == "cpu-host" and plan["roofline"]["bandwidth_measured"] is True
    assert plan["roofline"]["memory_bandwidth_gbps"] > 0.1
    assert plan["context_tokens"] == 256  # the tiny model's max_position_embeddings
    tensors = {t["name"]: t for t in plan["tensors_per_rank"]}
    assert sum(t["bytes"] for t in tensors.values()) == plan["per_rank"][0]["weights_bytes"]
    assert tensors["model.layers.0.mlp.gate.weight"]["shape"] == [4, 64]


@pytest.mark.mpi
def test_generate_refuses_a_plan_that_does_not_fit_before_loading(run_cli):
    from tiny_models import tiny_checkpoint

    path = tiny_checkpoint("qwen3", "bf16")
    out = run_cli("generate", "--target", path, "--prompt", "def add", "--max-new-tokens", "2",
                  "--context", "200000000", np=2)
    assert out.returncode == 1, out.output
    assert "DOES NOT FIT" in out.output and "rank 0 (this machine) needs" in out.output
    assert "loaded in" not in out.output and "Traceback" not in out.output


@pytest.mark.parametrize("args, message", [
    (("--kv-cache-tokens", str(10**12)),
     r"--kv-cache-tokens: 1,000,000,000,000 tokens \(62,500,000,000 blocks of 16\) do not fit: rank 0 \(this machine\) "
     r"has room for [\d,]+ blocks"),
    (("--context", "256", "--kv-cache-tokens", "100"),
     r"--kv-cache-tokens: 100 tokens hold less than one sequence of the context \(256 tokens: 16 blocks of 16\)"),
])
def test_serve_refuses_a_kv_cache_the_plan_cannot_give_before_loading(run_cli, args, message):
    """`serve` takes its KV cache from the plan: a request for more than the room, or for less
    than one sequence, stops it before the port opens or a weight is read."""
    import re

    from tiny_models import tiny_checkpoint

    out = run_cli("serve", "--target", tiny_checkpoint("qwen3", "bf16"), "--port", "0", *args)
    assert out.returncode == 2, out.output
    lines = [line for line in out.stderr.splitlines() if "kv-cache-tokens" in line]
    assert len(lines) == 1 and re.search(message, lines[0]), out.stderr
    assert "listening on" not in out.output and "loaded in" not in out.output and "Traceback" not in out.output
