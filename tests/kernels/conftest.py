import pytest
from kernel_support import WIDTHS, capped_width, forced_dense_streaming

from hetero_run.kernels import cpu_ext, cpu_isa


@pytest.fixture(params=["compiled", "pytorch"])
def library(request, monkeypatch):
    """Run the test twice: with the compiled CPU kernels (skipped where they do not build) and
    with the PyTorch paths they fall back to."""
    if request.param == "compiled" and cpu_ext.ops() is None:
        pytest.skip("the compiled kernels do not build here")
    if request.param == "pytorch":
        monkeypatch.setitem(cpu_ext._state, "ops", None)
    return request.param


def runnable(isa: cpu_isa.Isa) -> str | None:
    """Why `isa`'s kernels cannot be tested here, or None: every path the CPU supports is tested
    (forced through the ops' `path` argument), the others are skipped with the reason. A path
    whose self-test ran and gave wrong results is a bug in it, not a reason to skip: that fails."""
    if cpu_ext.ops() is None:
        return "the compiled kernels do not build here"
    if isa.feature and not cpu_ext.supported_features() & isa.feature:
        return f"this CPU has no {isa.label} (CPUID / OS)"
    verdict = cpu_isa._verdicts(cpu_ext.supported_features()).get(isa.name, "ok") if isa.feature else "ok"
    if verdict.startswith("gave wrong results"):
        pytest.fail(f"{isa.label}: its self-test {verdict}")
    if verdict != "ok":
        return f"{isa.label} is listed by CPUID but its self-test {verdict}"
    return None


def compiled_ops():
    """`torch.ops.hetero_run` with the compiled kernels, or the test skipped with the reason."""
    lib = cpu_ext.ops()
    if lib is None:
        pytest.skip("the compiled kernels do not build here")
    return lib


@pytest.fixture(params=[*WIDTHS, "pytorch"])
def row_ops(request, monkeypatch):
    """The compiled loops between the matrix products at each vector width this CPU runs (the
    others skipped with the reason), then the PyTorch paths they fall back to."""
    if request.param == "pytorch":
        monkeypatch.setitem(cpu_ext._state, "ops", None)
        yield request.param
        return
    lib = compiled_ops()
    with capped_width(lib, request.param):
        yield request.param


@pytest.fixture(params=WIDTHS)
def width(request):
    """The compiled element-wise loops (rounding to bf16) at each vector width this CPU runs."""
    lib = compiled_ops()
    with capped_width(lib, request.param):
        yield request.param


@pytest.fixture(params=WIDTHS)
def step_width(request):
    """The compiled drafter step at each vector width this CPU runs (the others skipped)."""
    lib = compiled_ops()
    with capped_width(lib, request.param):
        yield request.param


@pytest.fixture(params=cpu_isa.ISAS, ids=lambda isa: isa.name)
def isa(request) -> cpu_isa.Isa:
    """Each instruction set's kernels in turn, skipped (with the reason) where the CPU cannot run them."""
    reason = runnable(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture(params=[0, 1, 2], ids=["walk", "staged", "direct"])
def dense_streaming(request):
    """Each way the AVX-512 dense kernel streams few rows of x, forced in turn."""
    lib = compiled_ops()
    with forced_dense_streaming(lib, request.param):
        yield request.param
