"""Third-party plugin packages written and pip-installed by a test, as a user installs one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
dependencies = ["pp-core-torch"]

[project.entry-points.pp_core]
{entry} = "{package}"

[tool.setuptools]
packages = ["{package}"]
"""


def install_package(root: Path, package: str, modules: dict[str, str]) -> Path:
    """Write ``package`` (``{module name: source}``; its distribution is ``package`` with
    dashes, its ``pp_core`` entry point the package itself, named after its last part) under
    ``root`` and pip-install it into ``root / "site"`` (no network: setuptools from this
    environment); returns that directory, for ``PYTHONPATH``."""
    source = root / f"{package}_src"
    (source / package).mkdir(parents=True)
    (source / "pyproject.toml").write_text(PYPROJECT.format(
        name=package.replace("_", "-"), entry=package.split("_")[-1], package=package))
    for name, text in modules.items():
        (source / package / f"{name}.py").write_text(textwrap.dedent(text))
    target = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), str(source)], check=True, capture_output=True, text=True)
    return target


def make_dist(tmp_path, dist_name, modules, entry_points):
    """Write a real (unpacked) distribution onto ``tmp_path`` so importlib.metadata finds it."""
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    info = tmp_path / f"{dist_name.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[pp_core]\n{lines}\n")
