"""pp-core's distribution is ``pp-core-torch``: the name ``pp-core`` on the package index belongs
to another project (``pp.core``, a Zope package; ``-``, ``_`` and ``.`` make one name there), so
nothing in the repository may tell anyone to install it - a user following such a line, or a
plugin listing it as a dependency, gets that package."""

import os
import re
import tomllib
from pathlib import Path

from pp_core.errors import DISTRIBUTION, install_extra

ROOT = Path(__file__).resolve().parents[2]
OLD = r"pp[-_.]core(?![-_.]torch)"  # the old name, in any of its spellings, not the new one
PIP_INSTALL_OLD = re.compile(rf"""pip3?\s+install\s+(?:-\S+\s+)*["']?{OLD}\b""", re.I)
DEPENDS_ON_OLD = re.compile(rf"""["']{OLD}(?:\[[^\]]*\])?\s*(?:[<>=!~;][^"']*)?["']""")


SKIPPED = {"__pycache__", "build", "dist", "runs", "node_modules"}
"""Folders no commit holds: bytecode, builds, run outputs (hidden ones - .git, .venv* - too)."""


def _tracked_text_files():
    """The repository's text files, walked (no ``git``: a test of the fast tier starts no
    process), less what is never committed."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED
                   and not d.endswith(".egg-info")]
        for file in files:
            path = Path(folder) / file
            name = str(path.relative_to(ROOT))
            if path.suffix in (".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".txt", ".cfg", "") \
                    and path.is_file():
                try:
                    yield name, path.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    continue


def _requirements(pyproject: dict) -> list[str]:
    project = pyproject.get("project", {})
    return [*project.get("dependencies", []),
            *(r for extra in project.get("optional-dependencies", {}).values() for r in extra),
            *pyproject.get("build-system", {}).get("requires", [])]


def test_the_distribution_is_named_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == "pp-core-torch"
    assert project["optional-dependencies"]["suite"][0].startswith(f"{DISTRIBUTION}[")
    plugin = tomllib.loads((ROOT / "examples/pp_example_plugin/pyproject.toml").read_text())
    assert plugin["project"]["dependencies"] == [DISTRIBUTION]
    assert install_extra("lora") == "pip install 'pp-core-torch[lora]'"


def test_no_text_tells_anyone_to_install_the_other_projects_name():
    offenders = []
    for name, text in _tracked_text_files():
        if name == "tests/structure/test_distribution_name.py":
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if PIP_INSTALL_OLD.search(line) or ("depend" in line.lower() and
                                                 DEPENDS_ON_OLD.search(line)):
                offenders.append(f"{name}:{number}: {line.strip()}")
        if name.endswith("pyproject.toml"):  # every requirement of a project, however laid out
            offenders += [f"{name}: requires {r!r}" for r in _requirements(tomllib.loads(text))
                          if re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", r)[0].lower())
                          == "pp-core"]
    assert not offenders, ("lines that install the package index's 'pp-core' (another project); "
                           f"name {DISTRIBUTION!r}:\n" + "\n".join(offenders))


def test_the_checks_catch_each_spelling():
    for line in ("pip install 'pp-core[lora]'", 'pip install "pp_core[transformers]"',
                 "pip install -U pp.core", "python -m pip install pp-core"):
        assert PIP_INSTALL_OLD.search(line), line
    assert DEPENDS_ON_OLD.search('dependencies = ["pp-core>=0.1"]')
    for line in ("pip install 'pp-core-torch[lora]'", "pip install ./examples/pp_example_plugin",
                 "pip install pp_core_torch"):
        assert not PIP_INSTALL_OLD.search(line), line
    assert not DEPENDS_ON_OLD.search('dependencies = ["pp-core-torch"]')
