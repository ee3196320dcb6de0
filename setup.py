"""Maps the top-level folders to the `hetero_run.*` namespace (metadata lives in pyproject.toml)."""

from pathlib import Path

from setuptools import setup

FOLDERS = ("launch", "topology", "runtime", "kernels")
ROOT = Path(__file__).parent

# Folders of data files only, installed beside the code that reads them.
DATA = {"hetero_run.topology.examples": ["*"], "hetero_run.runtime.presets": ["*.json"],
        "hetero_run.kernels.csrc": ["*.cpp", "*.h"]}

packages = [
    "hetero_run." + ".".join(init.parent.relative_to(ROOT).parts)
    for folder in FOLDERS
    for init in sorted((ROOT / folder).rglob("__init__.py"))
]
setup(
    packages=packages + list(DATA),
    package_dir={f"hetero_run.{folder}": folder for folder in FOLDERS},
    package_data=DATA,
)
