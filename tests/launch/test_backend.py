"""The process group's backend: decided alike on every rank from the table they exchanged, and
refused with one error naming the rank or host when NCCL cannot run."""

import pytest

from hetero_run.launch.bootstrap import Peer, choose_backend
from hetero_run.topology.errors import ConfigError


def peers(*ranks: tuple[str, int]) -> tuple[Peer, ...]:
    """(host, CUDA devices the rank sees) per rank."""
    return tuple(Peer(r, host, 1000 + r, gpus > 0, gpus) for r, (host, gpus) in enumerate(ranks))


def test_auto_takes_nccl_when_every_rank_has_a_device_of_its_own():
    assert choose_backend("auto", peers(("spark-a", 1), ("spark-b", 1))) == "nccl"
    assert choose_backend("auto", peers(("dgx", 2), ("dgx", 2))) == "nccl"
    assert choose_backend("auto", peers(("spark-a", 1))) == "nccl"


def test_auto_takes_gloo_when_a_rank_has_no_cuda():
    assert choose_backend("auto", peers(("spark-a", 1), ("cpu-host", 0))) == "gloo"
    assert choose_backend("auto", peers(("a", 0), ("b", 0))) == "gloo"


def test_gloo_is_taken_as_asked():
    assert choose_backend("gloo", peers(("spark", 1), ("spark", 1))) == "gloo"


def test_nccl_without_cuda_on_a_rank_names_it():
    with pytest.raises(ConfigError) as err:
        choose_backend("nccl", peers(("spark-a", 1), ("cpu-host", 0)))
    assert str(err.value) == ("backend nccl: needs a CUDA device on every rank; "
                              "rank 1 (host cpu-host, pid 1001) has none")


@pytest.mark.parametrize("requested, field", [("nccl", "backend nccl"),
                                              ("auto", "backend auto (nccl: every rank has CUDA)")])
def test_two_ranks_on_one_gpu_are_refused_naming_the_host(requested, field):
    # NCCL refuses two ranks of a communicator on one device: both would take cuda:0 and fail at
    # the first collective.
    with pytest.raises(ConfigError) as err:
        choose_backend(requested, peers(("spark-a", 1), ("spark-a", 1)))
    assert str(err.value) == (
        f"{field}: needs one CUDA device per rank, and host spark-a runs 2 ranks on 1: start at most 1 rank(s) "
        "there (one rank alone is the single-node fallback), or choose --backend gloo")
    with pytest.raises(ConfigError, match="host dgx runs 3 ranks on 2"):
        choose_backend(requested, peers(("spark-b", 1), ("dgx", 2), ("dgx", 2), ("dgx", 2)))
