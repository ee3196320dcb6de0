"""TargetRunner (rank 0) and serve_worker (other ranks): the command protocol, without MPI.

A recording stand-in for the process group shows exactly what crosses it; the real two-rank
runs are in tests/runtime/models/test_tensor_parallel.py.
"""

import pytest
import torch
from tiny_models import tiny_checkpoint

from hetero_run.runtime.models.kv_cache import KVCacheFull
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import HEADER, INLINE, Command, TargetRunner, serve_worker


class RecordingGroup:
    """Quacks like ParallelContext for the runner: rank 0 records broadcasts, a worker replays them."""

    def __init__(self, rank: int, replay: list[torch.Tensor] | None = None):
        self.rank, self.size, self.device = rank, 2, torch.device("cpu")
        self.sent: list[torch.Tensor] = []
        self.replay = list(replay or [])

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            self.sent.append(x.clone())
        else:
            x.copy_(self.replay.pop(0))
        return x


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen3", "bf16")


def _model(path, max_tokens=32):
    return load_model(path, dtype=torch.float32, max_tokens=max_tokens)


def test_single_rank_runner_is_the_model(path):
    model, reference = _model(path), _model(path)
    ids = torch.arange(5, 15)
    with TargetRunner(model) as runner:
        got = runner.forward(ids, torch.arange(10), num_logits=2)
        runner.truncate(4)
        assert runner.length == 4 and runner.max_tokens == 32
    torch.testing.assert_close(got, reference.forward(ids, torch.arange(10))[-2:], atol=0, rtol=0)


def test_commands_a_worker_replays_reproduce_rank_0(path):
    group = RecordingGroup(0)
    driver = TargetRunner(_model(path), group)
    driver.forward(torch.arange(3, 23), torch.arange(20), num_logits=1)  # longer than INLINE: 2 broadcasts
    driver.forward(torch.tensor([7, 8, 9]), torch.arange(20, 23))  # a verify step: 1 broadcast
    driver.truncate(21)
    driver.forward(torch.tensor([1]), torch.tensor([21]))
    driver.close()
    driver.close()  # idempotent: one STOP
    assert [tuple(t.shape) for t in group.sent] == [(HEADER,), (2, 20)] + [(HEADER,)] * 4
    headers = [t[:4].tolist() for t in group.sent if t.shape == (HEADER,)]
    assert headers == [[Command.FORWARD, 20, 0, 1], [Command.FORWARD, 3, 0, 0], [Command.TRUNCATE, 0, 21, 0],
                       [Command.FORWARD, 1, 0, 0], [Command.STOP, 0, 0, 0]]
    verify = group.sent[2]
    assert verify[4:7].tolist() == [7, 8, 9] and verify[4 + INLINE:7 + INLINE].tolist() == [20, 21, 22]
    worker_model = _model(path)
    served = serve_worker(worker_model, RecordingGroup(1, group.sent))
    assert served == 4 and worker_model.length == driver.length == 22
    torch.testing.assert_close(worker_model.kv.k[:, :, :22], driver.model.kv.k[:, :, :22], atol=0, rtol=0)


def test_bad_calls_fail_on_rank_0_before_anything_is_sent(path):
    group = RecordingGroup(0)
    runner = TargetRunner(_model(path, max_tokens=8), group)
    with pytest.raises(KVCacheFull, match="would reach 9 tokens"):
        runner.forward(torch.arange(9), torch.arange(9))
    with pytest.raises(ValueError, match="bad forward"):
        runner.forward(torch.arange(3), torch.arange(4))
    with pytest.raises(ValueError, match="bad forward"):
        runner.forward(torch.arange(3), torch.arange(3), num_logits=4)
    with pytest.raises(ValueError, match="cannot truncate a cache of 0 tokens to 2"):
        runner.truncate(2)
    assert group.sent == []


def test_workers_are_stopped_when_rank_0_fails(path):
    group = RecordingGroup(0)
    with pytest.raises(RuntimeError, match="decode loop broke"):
        with TargetRunner(_model(path), group):
            raise RuntimeError("decode loop broke")
    assert [t[:4].tolist() for t in group.sent] == [[Command.STOP, 0, 0, 0]]


def test_worker_rejects_unknown_commands(path):
    with pytest.raises(RuntimeError, match="rank 1 received unknown command 42"):
        serve_worker(_model(path), RecordingGroup(1, [torch.tensor([42, 0, 0, 0] + [0] * 2 * INLINE)]))


def test_runner_belongs_to_rank_0(path):
    with pytest.raises(ValueError, match="other ranks run serve_worker"):
        TargetRunner(_model(path), RecordingGroup(1))
