"""ParallelContext's all-reduce under real `mpirun`: shared memory on one host, gloo otherwise."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import env_for_tests, mpirun_argv

pytestmark = pytest.mark.mpi
JOB = Path(__file__).with_name("allreduce_job.py")


@pytest.mark.parametrize("np", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_shared_memory_all_reduce_equals_gloo_on_every_rank(tmp_path, np):
    proc = subprocess.run(mpirun_argv(np) + [sys.executable, str(JOB), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env_for_tests())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(np)]
    assert all(r["rounds"] == 12 for r in results)  # 15 sums, the 3 oversized ones through gloo
    for rank in results:
        for ours, gloo in zip(rank["ours"], rank["gloo"], strict=True):
            # bf16: gloo rounds after each addition, shared memory once (in float32): 1 ulp apart
            tol = {"atol": 1e-2, "rtol": 2**-7} if ours.dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 0}
            torch.testing.assert_close(ours, gloo, **tol)
    for i in range(len(results[0]["ours"])):  # every rank holds bit-identical sums
        assert all(torch.equal(r["ours"][i], results[0]["ours"][i]) for r in results)


def test_shared_memory_path_can_be_turned_off(tmp_path):
    proc = subprocess.run(mpirun_argv(2, "-x", "HETERO_RUN_SHM_ALLREDUCE") + [sys.executable, str(JOB), str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env=env_for_tests({"HETERO_RUN_SHM_ALLREDUCE": "0"}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert torch.load(tmp_path / "rank0.pt")["rounds"] is None
