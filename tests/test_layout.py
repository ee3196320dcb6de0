"""The project imports as hetero_run.* and never shadows top-level `kernels` / `runtime`."""

import subprocess
import sys


def test_folders_import_under_hetero_run_only(tmp_path):
    code = (
        "import importlib.util, hetero_run.kernels, hetero_run.runtime, hetero_run.launch, "
        "hetero_run.topology\n"
        "for name in ('kernels', 'runtime', 'launch', 'topology'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    assert spec is None or 'hetero' not in str(spec.origin), (name, spec.origin)\n"
        "print('ok')\n"
    )
    # From an unrelated directory, as an installed user would run it.
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_transformers_import_is_not_confused_by_the_project(tmp_path):
    code = "import hetero_run.kernels, transformers.utils.import_utils as u; print(u.is_kernels_available())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("False")
