"""Shared fixtures. Multi-rank helpers live in tests/_dist.py."""

import pytest

from pp_core.testing import plugin_manager


@pytest.fixture
def pm():
    """A fresh plugin manager with no entry points loaded: tests add exactly what they need."""
    return plugin_manager()
