"""Every name a package's ``__all__`` promises resolves: ``from package import name`` works.

A lazy face (:func:`pp_core.lazy.lazy_face`) names what it imports only on first use, so a name
whose home moved fails only when someone asks for it (``from pp_core.runtime import
build_pipeline`` did, for a whole step). This asks for every one.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def packages() -> list[str]:
    """Every package of pp_core and of the built-in plugins, by dotted name."""
    found = []
    for base, top in ((ROOT, "pp_core"), (ROOT / "plugins", "pp_core_builtins")):
        for init in sorted((base / top).rglob("__init__.py")):
            found.append(".".join(init.parent.relative_to(base).parts))
    return found


@pytest.mark.parametrize("package", packages())
def test_every_name_in_all_resolves(package):
    module = importlib.import_module(package)
    names = getattr(module, "__all__", [])
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names {missing}, which do not resolve"
    assert len(set(names)) == len(names), f"{package}.__all__ names a name twice"


def test_a_lazy_face_names_the_package_and_the_name():
    from pp_core.lazy import lazy_face

    getattr_, dir_ = lazy_face("pp_core", {"gone": ".nowhere"})
    with pytest.raises(AttributeError, match=r"module 'pp_core' has no attribute 'missing'"):
        getattr_("missing")
    assert "gone" in dir_()
