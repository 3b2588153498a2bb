"""Third-party plugin packages written and pip-installed by a test, as a user installs one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def install_package(root: Path, package: str, pyproject: str, modules: dict[str, str]) -> Path:
    """Write ``package`` (``{module name: source}`` and its ``pyproject``) under ``root`` and
    pip-install it into ``root / "site"`` (no network: setuptools from this environment);
    returns that directory, for ``PYTHONPATH``."""
    source = root / f"{package}_src"
    (source / package).mkdir(parents=True)
    (source / "pyproject.toml").write_text(pyproject)
    for name, text in modules.items():
        (source / package / f"{name}.py").write_text(textwrap.dedent(text))
    target = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), str(source)], check=True, capture_output=True, text=True)
    return target
