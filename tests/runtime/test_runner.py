"""TargetRunner (rank 0) and serve_worker (other ranks): the command protocol, without MPI.

A recording stand-in for the process group shows exactly what crosses it; the real two-rank
runs are in tests/runtime/models/test_tensor_parallel.py.
"""

import pytest
import torch
from tiny_models import tiny_checkpoint

from hetero_run.runtime.models.batch import ForwardBatch
from hetero_run.runtime.models.kv_cache import KVCacheFull
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import HEADER, Command, TargetRunner, serve_worker


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


def _model(path, max_tokens=64):
    return load_model(path, dtype=torch.float32, max_tokens=max_tokens)


def test_single_rank_runner_is_the_model(path):
    model, reference = _model(path), _model(path)
    ids = torch.arange(5, 15)
    with TargetRunner(model) as runner:
        got = runner.forward(ids, torch.arange(10), num_logits=2)
        runner.truncate(4)
        assert runner.length == 4 and runner.max_tokens == 64
    torch.testing.assert_close(got, reference.forward(ids, torch.arange(10))[-2:], atol=0, rtol=0)


def test_commands_a_worker_replays_reproduce_rank_0(path):
    group = RecordingGroup(0)
    driver = TargetRunner(_model(path), group)
    driver.forward(torch.arange(3, 53), torch.arange(50), num_logits=1)  # a long prompt: 2 broadcasts
    driver.forward(torch.tensor([7, 8, 9]), torch.arange(50, 53))  # a verify step: 1 broadcast
    driver.truncate(51)  # rank 0 alone: the workers keep no lengths
    driver.forward(torch.tensor([1]), torch.tensor([51]))
    driver.close()
    driver.close()  # idempotent: one STOP
    assert [t.shape[0] for t in group.sent[:2]] == [HEADER, group.sent[0][1]]
    assert [tuple(t.shape) for t in group.sent[2:]] == [(HEADER,)] * 3
    headers = [t[:2].tolist() for t in group.sent if t.shape == (HEADER,)]
    assert [h[0] for h in headers] == [Command.STEP] * 3 + [Command.STOP]
    verify = ForwardBatch.from_tensor(group.sent[2][2:2 + headers[1][1]])
    assert verify.ids.tolist() == [7, 8, 9] and verify.positions.tolist() == [50, 51, 52]
    assert verify.prefix.tolist() == [51, 52, 53] and verify.logits_rows.tolist() == [0, 1, 2]
    worker_model = _model(path, max_tokens=64)
    served = serve_worker(worker_model, RecordingGroup(1, group.sent))
    assert served == 3 and driver.length == 52
    torch.testing.assert_close(worker_model.kv.k[:, :, :52], driver.model.kv.k[:, :, :52], atol=0, rtol=0)


def test_bad_calls_fail_on_rank_0_before_anything_is_sent(path):
    group = RecordingGroup(0)
    runner = TargetRunner(_model(path, max_tokens=8), group)
    with pytest.raises(KVCacheFull, match="would reach 9 tokens"):
        runner.forward(torch.arange(9), torch.arange(9))
    with pytest.raises(ValueError, match="one position each"):
        runner.forward(torch.arange(3), torch.arange(4))
    with pytest.raises(ValueError, match="num_logits must be in 1..3"):
        runner.forward(torch.arange(3), torch.arange(3), num_logits=4)
    with pytest.raises(ValueError, match="parents must come first"):
        runner.forward(torch.arange(3), torch.arange(3), parents=[-1, 2, 0])
    with pytest.raises(ValueError, match="outside the cache"):
        runner.step(ForwardBatch(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), torch.tensor([0]),
                                 torch.tensor([1]), torch.tensor([[99]]), 16, torch.tensor([0])))
    with pytest.raises(ValueError, match="cannot truncate a cache of 0 tokens to 2"):
        runner.truncate(2)
    assert group.sent == []


def test_workers_are_stopped_when_rank_0_fails(path):
    group = RecordingGroup(0)
    with pytest.raises(RuntimeError, match="decode loop broke"):
        with TargetRunner(_model(path), group):
            raise RuntimeError("decode loop broke")
    assert [t[:2].tolist() for t in group.sent] == [[Command.STOP, 0]]


def test_worker_rejects_unknown_commands(path):
    with pytest.raises(RuntimeError, match="rank 1 received unknown command 42"):
        serve_worker(_model(path), RecordingGroup(1, [torch.tensor([42] + [0] * (HEADER - 1))]))


def test_runner_belongs_to_rank_0(path):
    with pytest.raises(ValueError, match="other ranks run serve_worker"):
        TargetRunner(_model(path), RecordingGroup(1))
