"""Single-node fallback and -np against the topology's tensor-parallel size."""

from pathlib import Path

import pytest

from hetero_run.topology.config import load_topology, parse_topology
from hetero_run.topology.errors import ConfigError
from hetero_run.topology.fallback import banner, fallback_decision

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


@pytest.fixture
def dual():
    return load_topology(EXAMPLES / "dual-spark.yaml")


def test_full_size_is_no_fallback(dual):
    assert fallback_decision(dual, 2) == (2, None)


def test_one_rank_runs_at_tp1(dual):
    tp, reason = fallback_decision(dual, 1)
    assert tp == 1
    assert reason == ("launched with one rank, but the topology asks for TP=2 across spark-a, spark-b: running at "
                      "TP=1 on this node alone (single-node fallback)")
    assert banner(reason).startswith("SINGLE-NODE RUN: ")


def test_one_node_topology_runs_at_tp1():
    tp, reason = fallback_decision(load_topology(EXAMPLES / "single-spark.yaml"), 1)
    assert tp == 1 and "the topology has one node (spark-a)" in reason


@pytest.mark.parametrize("world", [3, 4])
def test_np_mismatch_is_an_error_naming_the_line(dual, world):
    with pytest.raises(ConfigError) as info:
        fallback_decision(dual, world)
    err = info.value
    assert err.field == "tensor_parallel_size" and err.line == 5 and err.file.endswith("dual-spark.yaml")
    assert f"the job has {world} ranks (mpirun -np {world}) but the topology's tensor-parallel size is 2" in str(err)


def test_two_ranks_on_a_one_node_topology_is_an_error():
    with pytest.raises(ConfigError, match="the job has 2 ranks"):
        fallback_decision(load_topology(EXAMPLES / "single-spark.yaml"), 2)


def test_policy_error_refuses_one_rank():
    text = (EXAMPLES / "dual-spark.yaml").read_text().replace("fallback: single-node", "fallback: error")
    topo = parse_topology(text, "strict.yaml")
    with pytest.raises(ConfigError) as info:
        fallback_decision(topo, 1)
    assert info.value.field == "fallback" and info.value.line == 8
    assert "fallback policy is 'error'" in str(info.value)
    assert fallback_decision(topo, 2) == (2, None)
