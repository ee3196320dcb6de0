import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # heads.py, also imported by the mpirun job

import heads  # noqa: E402
from support import one_thread  # noqa: F401  (autouse: tiny ops run on one thread)

_root = Path(tempfile.mkdtemp(prefix="hetero-run-eagle3-"))


@functools.cache
def target_dir(arch: str, layers: int = heads.TARGET_LAYERS) -> Path:
    return heads.write_target(_root / f"{arch}-{layers}", arch, layers=layers)


@functools.cache
def head_dir(arch: str, layout: str, kind: str) -> Path:
    return heads.write_head(_root / f"{arch}-{layout}-{kind}", target_dir(arch), layout, kind)


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_root, ignore_errors=True)
