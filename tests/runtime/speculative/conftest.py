import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run thousands of tiny tensor ops: a second thread only adds wake-up latency
    (milliseconds per op when the other core is busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
