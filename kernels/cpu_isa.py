"""Which compiled CPU kernels run here: CPUID proposes, a self-test in a child process decides.

CPUID is not enough. On some virtual machines AMX instructions die with SIGILL although CPUID
lists AMX and Linux grants the tile-data permission, and a SIGILL must not take a server down.
So before the automatic kernel choice may use an instruction set, a child process runs each
kernel the CPU claims (AVX2, AVX-512, AVX512-BF16, AMX) on small problems against the
plain-PyTorch reference. The verdicts are kept beside the library, one file per CPU model, so
the test runs once per machine and library; a set that fails (or kills the child) is left out,
with one warning saying why. `HETERO_RUN_CPU_ISA=avx2` (or `portable`, `avx512`,
`avx512_bf16`) caps the choice, e.g. to compare paths.

The kernels (csrc/cpu_linear.cpp) take the best allowed set whatever the number of rows:
AMX tiles for bf16 activations (in_features a multiple of 32), else AVX512-BF16 dot products,
else AVX-512 or AVX2 FMA on float32 (bf16 activations widened exactly), else portable loops.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FEATURE_AVX512 = 1
FEATURE_AVX512_BF16 = 2
FEATURE_AMX = 4  # AMX-BF16 tiles, usable by this process
FEATURE_AVX2 = 8

CHILD_ENV = "HETERO_RUN_CPU_SELFTEST"
CAP_ENV = "HETERO_RUN_CPU_ISA"
TIMEOUT_S = 300

log = logging.getLogger("hetero_run.kernels.cpu_isa")


@dataclass(frozen=True)
class Isa:
    name: str  # as HETERO_RUN_CPU_ISA spells it
    label: str  # as logs print it
    feature: int  # cpu_features() bit; 0: always there
    path: int  # the ops' `path` argument that forces it
    bf16_only: bool  # runs bf16 activations only (the others widen bf16 to float32)


PORTABLE = Isa("portable", "portable loops", 0, 6, False)
ISAS = (  # weakest first
    PORTABLE,
    Isa("avx2", "AVX2", FEATURE_AVX2, 5, False),
    Isa("avx512", "AVX-512", FEATURE_AVX512, 4, False),
    Isa("avx512_bf16", "AVX512-BF16", FEATURE_AVX512_BF16, 3, True),
    Isa("amx", "AMX", FEATURE_AMX, 2, True),
)
BY_NAME = {isa.name: isa for isa in ISAS}


def verify(lib) -> int:
    """The feature bits the automatic choice may use: what this CPU supports and passed the
    self-test, within HETERO_RUN_CPU_ISA. Logs the outcome (once per process, by the caller)."""
    supported = int(lib.cpu_supported_features())
    verdicts = _verdicts(supported)
    allowed = 0
    for isa in ISAS[1:]:
        if supported & isa.feature and verdicts.get(isa.name) == "ok":
            allowed |= isa.feature
    for isa in ISAS[1:]:
        verdict = verdicts.get(isa.name)
        if supported & isa.feature and verdict not in (None, "ok"):
            log.warning("CPU kernels: %s is listed by CPUID, but its self-test %s; leaving it out", isa.label, verdict)
    allowed &= _cap_mask()
    log.info("CPU kernels: %s", summary(supported, allowed))
    return allowed


def chosen(allowed: int, bf16: bool) -> Isa:
    """The instruction set the kernels use for bf16 (or float32) activations under `allowed`
    (AMX only where in_features is a multiple of 32; AVX512-BF16 there otherwise)."""
    for isa in reversed(ISAS):
        if isa is PORTABLE or (allowed & isa.feature and (bf16 or not isa.bf16_only)):
            return isa
    return PORTABLE


def summary(supported: int, allowed: int) -> str:
    """One line: what runs bf16 and float32 activations, and why stronger sets do not."""
    bf16, fp32 = chosen(allowed, True), chosen(allowed, False)
    text = f"bf16 activations on {bf16.label}, float32 on {fp32.label}"
    skipped = []
    for isa in ISAS[1:]:
        if allowed & isa.feature:
            continue
        if not supported & isa.feature:
            skipped.append(f"{isa.label}: not on this CPU")
        elif not _cap_mask() & isa.feature:
            skipped.append(f"{isa.label}: capped by {CAP_ENV}")
        else:
            skipped.append(f"{isa.label}: failed its self-test")
    return text + (f" ({'; '.join(skipped)})" if skipped else "")


def verdict_file() -> Path:
    from hetero_run.kernels import cpu_ext

    return cpu_ext.cache_dir() / f"isa-{_cpu_key()}.json"


def _cap_mask() -> int:
    name = os.environ.get(CAP_ENV, "").strip().lower()
    if not name:
        return -1
    if name not in BY_NAME:
        log.warning("%s=%s is not one of %s; ignoring it", CAP_ENV, name, ", ".join(BY_NAME))
        return -1
    limit = ISAS.index(BY_NAME[name])
    return sum(isa.feature for isa in ISAS[: limit + 1])


def _cpu_key() -> str:
    """This CPU model and its feature flags (the verdicts hold for any machine with both)."""
    ident = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    ident.append(line.strip())
                if not line.strip() and len(ident) > 2:
                    break
    except OSError:
        pass
    return hashlib.sha256("\n".join(ident).encode()).hexdigest()[:12]


def _verdicts(supported: int) -> dict[str, str]:
    """name -> "ok" or what went wrong, for every set this CPU claims; cached per CPU model."""
    names = [isa.name for isa in ISAS[1:] if supported & isa.feature]
    path = verdict_file()
    try:
        cached = json.loads(path.read_text())
        if set(names) <= set(cached):
            return cached
    except (OSError, ValueError):
        pass
    verdicts, complete = _run_selftests(names)
    if complete:
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(verdicts, indent=1))
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("cannot keep the self-test verdicts in %s: %s", path, exc)
    return verdicts


def selftest_argv(names: list[str]) -> list[str]:
    """The child process that tests `names` (one line per step on stdout, see child_main)."""
    return [sys.executable, "-c", "from hetero_run.kernels import cpu_isa; cpu_isa.child_main()", *names]


def _run_selftests(names: list[str]) -> tuple[dict[str, str], bool]:
    """Test each set in a child; a child that dies is restarted after the set it died in.
    Returns the verdicts and whether every set got one (if not, nothing is cached)."""
    verdicts: dict[str, str] = {}
    left = list(names)
    while left:
        env = dict(os.environ, **{CHILD_ENV: "child", "OMP_NUM_THREADS": "1"})
        try:
            proc = subprocess.run(selftest_argv(left), capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("CPU kernels: the self-test could not run (%s); trusting CPUID except for AMX",
                        str(exc).splitlines()[0][:200])
            for name in left:
                verdicts[name] = "ok" if name != "amx" else "could not run"
            return verdicts, False
        started = None
        for line in proc.stdout.splitlines():
            word, _, rest = line.partition(" ")
            name, _, reason = rest.partition(" ")
            if word == "start":
                started = name
            elif word in ("ok", "bad") and name in left:
                verdicts[name] = "ok" if word == "ok" else f"gave wrong results ({reason})"
                started = None
        if started is None:  # every set it started finished
            missing = [n for n in left if n not in verdicts]
            if missing:
                tail = (proc.stderr.strip().splitlines() or [f"status {proc.returncode}"])[-1][:200]
                log.warning("CPU kernels: the self-test stopped early (%s); trusting CPUID except for AMX", tail)
                for name in missing:
                    verdicts[name] = "ok" if name != "amx" else "could not run"
                return verdicts, False
            break
        verdicts[started] = _death(proc.returncode)
        left = left[left.index(started) + 1:]
    return verdicts, True


def _death(code: int) -> str:
    if code < 0:
        try:
            return f"died with {signal.Signals(-code).name}"
        except ValueError:
            return f"died with signal {-code}"
    return f"ended with status {code}"


def child_main() -> None:
    """In the child: run each named set's kernels against the references, reporting as it goes."""
    import torch

    from hetero_run.kernels import cpu_ext

    lib = cpu_ext.ops()
    if lib is None:
        sys.exit("the compiled CPU kernels do not load")
    for name in sys.argv[1:]:
        isa = BY_NAME[name]
        print(f"start {name}", flush=True)
        error = _check(lib, isa, torch)
        print(f"ok {name}" if error is None else f"bad {name} {error}", flush=True)


def _check(lib, isa: Isa, torch) -> str | None:
    """The first disagreement with the references, or None."""
    from hetero_run.kernels import nvfp4

    g = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16] if isa.bf16_only else [torch.bfloat16, torch.float32]
    for out, inp in ((40, 256), (24, 96)):  # a whole group of 16 blocks; a tail of 6
        w = torch.randn(out, inp, generator=g)
        q = nvfp4.quantize(w)
        row_scale = q.global_scale.expand(out).contiguous()
        for n in (1, 6):  # one row of x; several (blocked, or through tiles)
            for dtype in dtypes:
                x = torch.randn(n, inp, generator=g).to(dtype)
                y = lib.nvfp4_linear(x, q.codes, q.block_scale.view(torch.uint8), row_scale, isa.path)
                ref = nvfp4.linear_reference(x, q.codes, q.block_scale, row_scale)
                for wt in ([torch.bfloat16] if dtype == torch.bfloat16 else [torch.bfloat16, torch.float32]):
                    wd = w.to(wt)
                    for got, want, what in ((y, ref, "nvfp4"), (lib.dense_linear(x, wd, isa.path),
                                                                 x.double() @ wd.double().T, "dense")):
                        err = (got.double() - want.double()).abs().max().item()
                        if not err <= 1e-4 * want.double().abs().max().item():
                            return f"{what} [{out}, {inp}] n={n} {dtype}: max error {err:.3g}"
    return None
