"""The root pyproject's entry-point table is pp-core's default plugin list; keep it honest."""

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from pp_core.errors import DISTRIBUTION
from tests.cases.cli import PP_CORE

ROOT = Path(__file__).resolve().parents[2]
REFRESH = "run `pip install -e .` to refresh the installed entry points"


def declared():
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pp_core"]
    return dict(table)


def modules_with_hookimpls():
    found = {}
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        if re.search(r"^@(pp_core\.)?hookimpl", path.read_text(), re.M):
            module = ".".join(path.relative_to(ROOT / "plugins").with_suffix("").parts)
            found[module.removesuffix(".__init__")] = module.removesuffix(".__init__")
    return found


def test_every_plugin_module_is_declared_under_its_own_module_path():
    table = declared()
    assert all(name == value for name, value in table.items()), table
    missing = set(modules_with_hookimpls()) - set(table)
    assert not missing, f"plugin modules without an entry point in pyproject.toml: {sorted(missing)}"


def test_installed_entry_points_match_pyproject():
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="pp_core")
                 if ep.dist is not None and ep.dist.metadata["Name"] == DISTRIBUTION}
    assert installed == declared(), REFRESH


@pytest.mark.cli
def test_plugins_command_lists_every_built_in():
    out = subprocess.run([sys.executable, "-m", "pp_core", "plugins"], capture_output=True,
                         text=True, check=True).stdout
    for name in declared():
        assert re.search(rf"^{re.escape(name)}  \[{DISTRIBUTION} ", out, re.M), name
    assert f"pp_core.model_initializers  [{DISTRIBUTION} " in out


@pytest.mark.cli
def test_help_teaches():
    out = subprocess.run([sys.executable, "-m", "pp_core", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("run", "schedule", "plugins"):
        assert command in out
    assert "examples:" in out and "PP_CORE_DISABLE_PLUGINS" in out
    out = subprocess.run([PP_CORE, "plugins", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "entry-point group 'pp_core'" in out and "--json" in out


def test_plugin_missing_an_optional_dependency_is_listed_as_unavailable_with_the_fix():
    import types

    from pp_core.app.commands.plugins import describe
    from pp_core.testing import plugins_with

    plugin = types.ModuleType("pp_needs_extra")
    plugin.PP_CORE_UNAVAILABLE = "foo is not installed; pip install 'pp-needs-extra[foo]'"
    [row] = [r for r in describe(plugins_with(plugin)) if r["name"] == "pp_needs_extra"]
    assert row["unavailable"] == plugin.PP_CORE_UNAVAILABLE and row["error"] is None


def test_no_test_runs_pp_core_from_path():
    """A bare "pp-core" in a test's command line is found on PATH, whichever installation that
    is (a fresh clone's scripts/test.sh has none there): run tests.cases.cli.PP_CORE instead."""
    bare = re.compile(r"""[\[(]\s*["']pp-core["']\s*,""")
    offenders = [f"{path.name}:{number}" for path in sorted((ROOT / "tests").rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if bare.search(line)]
    assert not offenders, f"tests running pp-core from PATH: {offenders}; use tests.cases.cli.PP_CORE"
