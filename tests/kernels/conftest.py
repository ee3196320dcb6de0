import pytest

from hetero_run.kernels import cpu_ext


@pytest.fixture(params=["compiled", "pytorch"])
def library(request, monkeypatch):
    """Run the test twice: with the compiled CPU kernels (skipped where they do not build) and
    with the PyTorch paths they fall back to."""
    if request.param == "compiled" and cpu_ext.ops() is None:
        pytest.skip("the compiled kernels do not build here")
    if request.param == "pytorch":
        monkeypatch.setitem(cpu_ext._state, "ops", None)
    return request.param
