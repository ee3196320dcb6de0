"""The project imports as hetero_run.* and never shadows top-level `kernels` / `runtime`."""

import subprocess
import sys


def test_folders_import_under_hetero_run_only(tmp_path):
    code = (
        "import importlib, importlib.util, os, hetero_run\n"
        "for name in ('kernels', 'runtime', 'launch', 'topology'):\n"
        "    ours = os.path.realpath(importlib.import_module('hetero_run.' + name).__file__)\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    assert spec is None or os.path.realpath(str(spec.origin)) != ours, (name, spec.origin)\n"
        "print('ok')\n"
    )
    # From an unrelated directory, as an installed user would run it.
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_transformers_import_is_not_confused_by_the_project(tmp_path):
    """transformers sees Hugging Face's `kernels` package exactly when that distribution is
    installed (recent transformers releases depend on it), never this project's folder."""
    code = (
        "import importlib.metadata as m, importlib.util, hetero_run.kernels, transformers.utils.import_utils as u\n"
        "try:\n"
        "    m.version('kernels'); installed = True\n"
        "except m.PackageNotFoundError:\n"
        "    installed = False\n"
        "spec, ours = importlib.util.find_spec('kernels'), hetero_run.kernels.__file__\n"
        "assert spec is None or spec.origin != ours, spec.origin\n"
        "print(u.is_kernels_available() == installed)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("True")
