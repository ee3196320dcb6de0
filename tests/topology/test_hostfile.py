"""OpenMPI hostfiles: parsing, writing, and agreement with the topology."""

from pathlib import Path

import pytest

from hetero_run.topology.config import load_topology
from hetero_run.topology.errors import ConfigError
from hetero_run.topology.hostfile import (
    HostEntry,
    check_hostfile,
    hostfile_for,
    parse_hostfile,
    read_hostfile,
    write_hostfile,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


@pytest.fixture
def dual():
    return load_topology(EXAMPLES / "dual-spark.yaml")


def test_parse_comments_slots_and_users():
    hf = parse_hostfile(
        "# the pair\n\nspark-a slots=1   # rank 0\n\tuser@spark-b\tslots = 2 max_slots=4\nspark-c\n", "h"
    )
    assert hf.entries == (
        HostEntry("spark-a", 1, None, 3),
        HostEntry("user@spark-b", 2, 4, 4),
        HostEntry("spark-c", None, None, 5),
    )
    assert hf.hosts == ("spark-a", "spark-b", "spark-c")


def test_example_hostfile_matches_example_topology(dual):
    hf = read_hostfile(EXAMPLES / "dual-spark.hosts")
    assert hf.hosts == ("spark-a", "spark-b") and all(e.slots == 1 for e in hf.entries)
    check_hostfile(dual, hf)


@pytest.mark.parametrize("text,line,words", [
    ("spark-a slots=0\n", 1, "slots must be an integer >= 1, got '0'"),
    ("spark-a\nspark-a slots=1\n", 2, "duplicate host (also line 1)"),
    ("# x\nspark-a cores=2\n", 2, "unknown option 'cores'"),
    ("spark-a slots=1 junk\n", 1, "cannot read 'junk'"),
])
def test_bad_lines(text, line, words):
    with pytest.raises(ConfigError) as info:
        parse_hostfile(text, "hosts")
    assert info.value.file == "hosts" and info.value.line == line
    assert words in str(info.value)


def test_empty_hostfile():
    with pytest.raises(ConfigError, match="lists no hosts"):
        parse_hostfile("# only a comment\n", "hosts")


def test_write_then_read_round_trip(tmp_path, dual):
    path = write_hostfile(tmp_path / "hosts", dual)
    text = path.read_text()
    assert text.startswith("# hosts of ") and "spark-a slots=1\nspark-b slots=1\n" in text
    assert read_hostfile(path).entries == (HostEntry("spark-a", 1, None, 2), HostEntry("spark-b", 1, None, 3))
    assert hostfile_for(dual).hosts == ("spark-a", "spark-b")
    assert [p.name for p in tmp_path.iterdir()] == ["hosts"]  # no temporary file left behind


def test_hosts_out_of_order(dual):
    with pytest.raises(ConfigError) as info:
        check_hostfile(dual, parse_hostfile("spark-b\nspark-a\n", "hosts"))
    assert str(info.value).startswith("hosts:1: spark-b: is nodes[1] in ")
    assert "list the hosts in the topology's node order (spark-a, spark-b)" in str(info.value)


def test_host_not_in_topology(dual):
    with pytest.raises(ConfigError) as info:
        check_hostfile(dual, parse_hostfile("spark-a\nspark-x slots=1\n", "hosts"))
    assert str(info.value).startswith("hosts:2: spark-x: is not a node of ")
    assert "(nodes[1].host is 'spark-b')" in str(info.value)


def test_host_count_disagrees(dual):
    with pytest.raises(ConfigError, match="lists 1 host.* has 2 node.*spark-b missing"):
        check_hostfile(dual, parse_hostfile("spark-a\n", "hosts"))
    with pytest.raises(ConfigError) as info:
        check_hostfile(dual, parse_hostfile("spark-a\nspark-b\nspark-c\n", "hosts"))
    assert info.value.line == 3 and "lists 3 hosts" in str(info.value)


def test_user_prefix_and_case_are_the_same_host(dual):
    check_hostfile(dual, parse_hostfile("me@SPARK-A slots=1\nspark-b\n", "hosts"))
