"""The fast drafter's converted checkpoint: made once per source, reused while the source is unchanged.

Reading SmolLM2's GGUF through transformers de-quantises every tensor (about 24 s); quantising
the projections to NVFP4 costs as much again. Both happen once: the result is a directory
beside the source (or under the cache root when that is not writable),

    SmolLM2-135M-Instruct.Q4_1.gguf
    SmolLM2-135M-Instruct.Q4_1.drafter-nvfp4-bf16/
        weights.safetensors     what `drafters.weights.load` reads (the compiled step's layout)
        config.json, tokenizer files
        hetero-run-drafter.json  manifest: format, weights, dtype, the source's size, mtime and
                                 sha256, every file's size

written to a temporary sibling and renamed into place (one writer at a time, under a lock), and
loaded in about a second. A cache whose manifest does not match (another source, a changed
file, a missing or truncated file, an older format) is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from hetero_run.runtime.drafters import weights as draft_weights
from hetero_run.topology.errors import UserError

log = logging.getLogger("hetero_run.runtime.drafters.cache")

MANIFEST = "hetero-run-drafter.json"
WEIGHTS_FILE = "weights.safetensors"
FORMAT = 1
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


class DrafterCacheError(UserError):
    """A converted drafter directory that cannot be read or written."""


def is_converted(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def name_for(source: Path, weights: str, dtype: torch.dtype) -> str:
    stem = source.stem if source.is_file() else source.name
    return f"{stem}.drafter-{weights}-{DTYPE_NAMES[dtype]}"


def location(source: Path, weights: str, dtype: torch.dtype, root: Path | None = None) -> Path:
    """Where the conversion of `source` lives: under `root` when given, else beside the source
    if its folder is writable, else under the cache root (`~/.cache/hetero-run/drafters`)."""
    source = source.resolve()
    name = name_for(source, weights, dtype)
    if root is not None:
        return Path(root) / f"{name}-{_path_tag(source)}"
    if os.access(source.parent, os.W_OK):
        return source.parent / name
    from hetero_run.runtime.fetch import cache_root

    return cache_root() / "drafters" / f"{name}-{_path_tag(source)}"


def _path_tag(source: Path) -> str:
    return hashlib.sha256(str(source).encode()).hexdigest()[:12]


def _fingerprint(source: Path, with_hash: bool) -> dict:
    """What identifies the source: a file's size, mtime and (when asked) sha256; a directory's
    files' sizes and mtimes."""
    if source.is_file():
        stat = source.stat()
        out = {"name": source.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if with_hash:
            digest = hashlib.sha256()
            with open(source, "rb") as f:
                while block := f.read(8 << 20):
                    digest.update(block)
            out["sha256"] = digest.hexdigest()
        return out
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(source.iterdir())
             if p.is_file() and not p.name.startswith(".")}
    return {"name": source.name, "files": files}


def _same_source(recorded: dict, source: Path) -> bool:
    now = _fingerprint(source, with_hash=False)
    if source.is_dir():
        return recorded == now
    if recorded.get("name") != now["name"] or recorded.get("bytes") != now["bytes"]:
        return False
    if recorded.get("mtime_ns") == now["mtime_ns"]:
        return True
    return recorded.get("sha256") == _fingerprint(source, with_hash=True)["sha256"]  # touched, maybe unchanged


def read_manifest(path: Path) -> dict | None:
    """The manifest of a complete converted directory (every listed file there, at its size), else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if manifest.get("format") != FORMAT or not isinstance(files, dict):
        return None
    for name, size in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return manifest


def valid(path: Path, source: Path | None, weights: str, dtype: torch.dtype) -> bool:
    """`path` holds a complete conversion of `source` (None: of anything) with these weights."""
    manifest = read_manifest(path)
    if manifest is None or manifest.get("weights") != weights or manifest.get("dtype") != DTYPE_NAMES[dtype]:
        return False
    return source is None or _same_source(manifest.get("source") or {}, source)


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write(dest: Path, step_weights, tokenizer, config, source: Path, weights: str, dtype: torch.dtype) -> Path:
    """Write a converted drafter to `dest` atomically (a sibling temporary, renamed into place)."""
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        draft_weights.save(step_weights, tmp / WEIGHTS_FILE)
        if config is not None:
            config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        mask = os.umask(0)
        os.umask(mask)
        for p in tmp.iterdir():  # readable as any other file this process writes (safetensors makes 0600)
            os.chmod(p, 0o666 & ~mask)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"format": FORMAT, "weights": weights, "dtype": DTYPE_NAMES[dtype],
                    "source": _fingerprint(source, with_hash=source.is_file()), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    except OSError as exc:
        raise DrafterCacheError(f"cannot write the converted drafter: {exc}", file=dest) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def converted(source: Path, weights: str, dtype: torch.dtype, convert, root: Path | None = None) -> Path | None:
    """The valid conversion of `source`, made now by `convert() -> (step_weights, tokenizer,
    config)` if there is none; None when `convert` returns None (an architecture the fast
    drafter does not run)."""
    dest = location(source, weights, dtype, root)
    if valid(dest, source, weights, dtype):
        return dest
    with _locked(dest):
        if valid(dest, source, weights, dtype):  # another process converted it meanwhile
            return dest
        if dest.exists():
            log.info("drafter cache %s is incomplete or from another source; converting again", dest)
        made = convert()
        if made is None:
            return None
        return write(dest, *made, source, weights, dtype)
