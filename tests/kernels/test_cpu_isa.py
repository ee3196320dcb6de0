"""The instruction-set choice: CPUID proposes, a self-test in a child process decides, the
verdicts are cached, a failure (even a SIGILL) only leaves that set out, with one warning."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hetero_run.kernels import cpu_ext, cpu_isa, nvfp4

needs_lib = pytest.mark.skipif(cpu_ext.ops() is None, reason="compiled CPU kernels unavailable here")


@needs_lib
def test_the_verdicts_of_this_cpu_decide_the_features():
    supported = cpu_ext.supported_features()
    verdicts = cpu_isa._verdicts(supported)
    claimed = [isa for isa in cpu_isa.ISAS[1:] if supported & isa.feature]
    assert {isa.name for isa in claimed} <= set(verdicts)
    passed = sum(isa.feature for isa in claimed if verdicts[isa.name] == "ok")
    assert cpu_ext.features() == passed & cpu_isa._cap_mask()
    assert cpu_isa.verdict_file().is_file()


def _fake_child(tmp_path, monkeypatch, body: str):
    """The self-test's child replaced by a script: it is given the names still to test."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    calls = tmp_path / "calls"
    monkeypatch.setattr(cpu_isa, "selftest_argv", lambda names: [sys.executable, str(script), str(calls), *names])
    return calls


def test_a_child_that_dies_fails_only_the_set_it_died_in(tmp_path, monkeypatch):
    calls = _fake_child(tmp_path, monkeypatch, """
        import os, signal, sys
        with open(sys.argv[1], "a") as f:
            f.write(" ".join(sys.argv[2:]) + "\\n")
        for name in sys.argv[2:]:
            print("start", name, flush=True)
            if name == "amx":
                os.kill(os.getpid(), signal.SIGILL)  # as AMX does on some virtual machines
            print("ok", name, flush=True)
    """)
    verdicts, complete = cpu_isa._run_selftests(["avx2", "amx", "avx512"])
    assert complete
    assert verdicts == {"avx2": "ok", "amx": "died with SIGILL", "avx512": "ok"}
    assert calls.read_text().splitlines() == ["avx2 amx avx512", "avx512"]  # restarted after the crash


def test_wrong_results_fail_the_set(tmp_path, monkeypatch):
    _fake_child(tmp_path, monkeypatch, """
        import sys
        for name in sys.argv[2:]:
            print("start", name)
            print("bad", name, "nvfp4 [40, 256] n=1: max error 3" if name == "avx512_bf16" else "")
            if name != "avx512_bf16":
                print("ok", name)
    """)
    verdicts, complete = cpu_isa._run_selftests(["avx512", "avx512_bf16"])
    assert complete and verdicts["avx512"] == "ok"
    assert verdicts["avx512_bf16"] == "gave wrong results (nvfp4 [40, 256] n=1: max error 3)"


def test_a_child_that_cannot_run_trusts_cpuid_but_not_amx(tmp_path, monkeypatch):
    _fake_child(tmp_path, monkeypatch, "import sys; sys.exit('no torch here')\n")
    verdicts, complete = cpu_isa._run_selftests(["avx2", "amx"])
    assert not complete  # not cached: the next process tries again
    assert verdicts == {"avx2": "ok", "amx": "could not run"}


class _FakeLib:
    def __init__(self, supported):
        self.supported = supported

    def cpu_supported_features(self):
        return self.supported


def test_verify_leaves_failed_sets_out_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_isa, "verdict_file", lambda: tmp_path / "isa.json")
    (tmp_path / "isa.json").write_text('{"avx2": "ok", "avx512": "ok", "avx512_bf16": "ok", "amx": "died with SIGILL"}')
    monkeypatch.delenv(cpu_isa.CAP_ENV, raising=False)
    every = cpu_isa.FEATURE_AVX2 | cpu_isa.FEATURE_AVX512 | cpu_isa.FEATURE_AVX512_BF16 | cpu_isa.FEATURE_AMX
    with caplog.at_level(logging.INFO, logger="hetero_run.kernels.cpu_isa"):
        allowed = cpu_isa.verify(_FakeLib(every))
    assert allowed == every & ~cpu_isa.FEATURE_AMX
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["CPU kernels: AMX is listed by CPUID, but its self-test died with SIGILL; leaving it out"]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["CPU kernels: bf16 activations on AVX512-BF16, float32 on AVX-512 (AMX: failed its self-test)"]


def test_the_choice_can_be_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_isa, "verdict_file", lambda: tmp_path / "isa.json")
    (tmp_path / "isa.json").write_text('{"avx2": "ok", "avx512": "ok", "avx512_bf16": "ok"}')
    supported = cpu_isa.FEATURE_AVX2 | cpu_isa.FEATURE_AVX512 | cpu_isa.FEATURE_AVX512_BF16
    monkeypatch.setenv(cpu_isa.CAP_ENV, "avx2")
    assert cpu_isa.verify(_FakeLib(supported)) == cpu_isa.FEATURE_AVX2
    assert "AVX-512: capped by HETERO_RUN_CPU_ISA" in cpu_isa.summary(supported, cpu_isa.FEATURE_AVX2)
    monkeypatch.setenv(cpu_isa.CAP_ENV, "portable")
    assert cpu_isa.verify(_FakeLib(supported)) == 0
    assert cpu_isa.chosen(0, True) is cpu_isa.PORTABLE


@needs_lib
def test_a_capped_process_computes_the_same_products(tmp_path):
    """The cap reaches the kernels (and their automatic choice) in a fresh process."""
    code = textwrap.dedent("""
        import torch
        from hetero_run.kernels import cpu_ext, nvfp4
        from hetero_run.kernels.nvfp4_linear import nvfp4_linear
        print(cpu_ext.features(), cpu_ext.describe())
        q = nvfp4.quantize(torch.randn(30, 256, generator=torch.Generator().manual_seed(1)))
        rs = q.global_scale.expand(30).contiguous()
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
        torch.save(nvfp4_linear(x, q.codes, q.block_scale, rs), {path!r})
    """)
    results = {}
    for cap in ("portable", ""):
        path = str(tmp_path / f"y-{cap or 'best'}.pt")
        env = dict(os.environ, **{cpu_isa.CAP_ENV: cap})
        proc = subprocess.run([sys.executable, "-c", code.format(path=path)], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        results[cap] = (proc.stdout, torch.load(path))
    assert results["portable"][0].startswith("0 bf16 activations on portable loops, float32 on portable loops")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    q = nvfp4.quantize(torch.randn(30, 256, generator=torch.Generator().manual_seed(1)))
    ref = nvfp4.linear_reference(x, q.codes, q.block_scale, q.global_scale.expand(30).contiguous())
    for _, y in results.values():
        assert (y - ref).abs().max() <= 2e-5 * ref.abs().max()
